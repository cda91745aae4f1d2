// Every dartree op schema, in one place. Each op has a launcher per device that registers it
// (csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu: checks, dispatch, threads or stream) over torch-free
// kernels (csrc/include/dartree/cpu/<op>.h, csrc/include/dartree/<op>.cuh); fake (meta) kernels
// and Python wrappers live in dartree/ops.py, references in dartree/reference.py.
#include <Python.h>
#include <torch/library.h>

// A bare module: importing dartree._C runs the static registrars below and in the kernel files.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(dartree, m) {
  // prefix_len is a SymInt so that torch.compile traces it symbolically (one graph for every round).
  // Move the accepted tree rows of every layer's K and V into place after a verify pass:
  // kv[..., prefix_len + j, :] = kv[..., prefix_len + accepted[j], :] for j < len(accepted).
  // kv: [..., S, D] contiguous (the whole static cache); accepted: int64 [A], increasing.
  m.def("kv_commit(Tensor(a!) kv, SymInt prefix_len, Tensor accepted) -> ()");

  // Attention of T draft-tree queries over a static KV cache (the target's verify pass).
  // q [B, Hq, T, D]; k, v [B, Hkv, S, D], the tree's own keys at rows [prefix_len, prefix_len + T);
  // tree_mask bool [B, T, T], True where key j is query i or one of its ancestors. Query i sees
  // keys [0, prefix_len) and the tree keys its mask row allows; rows after prefix_len + T are never
  // read. Hq % Hkv == 0 (grouped-query heads); scale defaults to D ** -0.5.
  // Returns a new contiguous [B, Hq, T, D] tensor in q's dtype.
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor tree_mask, SymInt prefix_len, "
        "float? scale=None) -> Tensor");

  // ---- draft-tree ops (launchers: csrc/{cpu,cuda}/{candidate_topk,expand_level,prune_tree,
  // verify_tree,build_dartree}.*; build_dartree's level walk, shared by both: dartree/build_plan.h;
  // references and wrappers: dartree/reference.py, dartree/ops.py). Outputs are preallocated by
  // the caller and every element of them is written; an output of numel 0 means "not wanted"
  // where noted.
  // Compute dtype T: float64 for float64 input, float32 otherwise.

  // The C best tokens of each row of logits [k, V] (float32/float64/float16/bfloat16): values
  // [k, C] T descending, ids [k, C] int64 (equal values: lower id first, NaN first), lse [k] T the
  // row's logsumexp over all V, or lse of numel 0 to skip it. C = ids.size(1), 1 <= C <= V.
  m.def("candidate_topk(Tensor logits, Tensor(a!) values, Tensor(b!) ids, Tensor(c!) lse) -> ()");

  // One DARTree level (see reference.expand_level): f frontier parents, C candidates, the best
  // Q = parent_pos.size(0) of the f * E (parent, candidate < E) pairs, then the winners' GRU step.
  // parent_scores [f] T; parent_states [f, G] T or None; z [r] T or None (uncorrected level);
  // w_s [r, G] T; cand_w2 [C, r] T; cand_b2 [C] T or None; cand_base [C] T; cand_ids [C] int64;
  // input_table [V, 3G] (any float dtype) or None (no GRU); w_hh [3G, G] T; b_hh [3G] T or None.
  // Outputs parent_pos, tokens [Q] int64, scores [Q] T, states [Q, G] T (numel 0 without a table).
  m.def("expand_level(Tensor parent_scores, Tensor? parent_states, Tensor? z, Tensor? w_s, "
        "Tensor? cand_w2, Tensor? cand_b2, Tensor cand_base, Tensor cand_ids, int num_expand, "
        "Tensor? input_table, Tensor? w_hh, Tensor? b_hh, Tensor(a!) parent_pos, "
        "Tensor(b!) tokens, Tensor(c!) scores, Tensor(d!) states) -> ()");

  // Keep the root and the N - 1 = kept.size(0) - 1 best nodes of a tree by
  // scores + depth_bonus * depths (ties: lower index), in index order, plus the verify layout.
  // parents, depths [M] int64 (parents[0] == -1, 0 <= parents[i] < i), scores [M] float.
  // Outputs [N]: kept (old indices, ascending), new_parents (-1 for the root), new_depths (the
  // verify positions are prefix + depth), first_child / next_sibling (-1 = none; children in
  // index order); ancestors int32 [N, ceil(N / 32)]: bit j of row i set when j is i or one of its
  // ancestors; status int32 [1]: 0; 1 when a kept node's parent was pruned; 2 when parents are
  // not a tree. The CPU kernel raises instead; the CUDA kernel only sets the flag, so the
  // prefix-closure check costs no host sync (ops.prune_tree_layout(check=True) reads it).
  m.def("prune_tree(Tensor parents, Tensor depths, Tensor scores, float depth_bonus, "
        "Tensor(a!) kept, Tensor(b!) new_parents, Tensor(c!) new_depths, Tensor(d!) ancestors, "
        "Tensor(e!) first_child, Tensor(f!) next_sibling, Tensor(g!) status) -> ()");

  // The verify walk: from the root, move to the lowest-index child whose token equals
  // target_tokens[cur] while one exists. parents, tokens, target_tokens [T] int64; optional
  // first_child / next_sibling [T] int64 (from prune_tree; built from parents when None).
  // Outputs: accepted [T] int64 (the path, then -1), num_accepted [] int64, bonus [] int64
  // (target_tokens[last accepted]). A malformed tree raises on the CPU and gives num_accepted 0
  // on CUDA (no host sync).
  m.def("verify_tree(Tensor parents, Tensor tokens, Tensor target_tokens, Tensor? first_child, "
        "Tensor? next_sibling, Tensor(a!) accepted, Tensor(b!) num_accepted, Tensor(c!) bonus) "
        "-> ()");

  // The whole DARTree build of one round after candidate_topk (see tree.build_dartree): levels
  // d < L = len(plan) select plan[d] nodes each, slot d's candidates are cand_values/cand_ids
  // [k, C] (T, int64), corrected when z is given and d >= prefix_len, GRU step when input_table
  // is given and d < L - 1; then, when N - 1 < sum(plan), pruning to the N - 1 best nodes by
  // score + depth_bonus * depth. root [1] int64; root_state [G] T (needed with z or a table);
  // z [k, r]; w_s [r, G]; w_2 [V2, r] (the head's W_2: rows cand_ids[d] are read) or [k, C, r]
  // (rows already gathered); b_2 [V2] or [k, C] likewise; input_table [V, 3G] any float;
  // w_hh [3G, G]; b_hh [3G]. Outputs [N], N = tokens.size(0) = 1 + min(budget, sum(plan)):
  // tokens, parents, depths int64, scores T; status int32 [1]: 0, 1 as in prune_tree, 2 a
  // candidate id outside W_2 or input_table (CUDA only: the CPU checks ids and raises).
  m.def("build_dartree(Tensor cand_values, Tensor cand_ids, Tensor root, Tensor? root_state, "
        "Tensor? z, Tensor? w_s, Tensor? w_2, Tensor? b_2, Tensor? input_table, "
        "Tensor? w_hh, Tensor? b_hh, int num_expand, int[] plan, int prefix_len, "
        "float depth_bonus, Tensor(a!) tokens, Tensor(b!) parents, Tensor(c!) depths, "
        "Tensor(d!) scores, Tensor(e!) status) -> ()");

  // ---- batch-invariant ("exact") ops: every output row is a function of that row's inputs alone,
  // bitwise, whatever the batch around it (launchers: csrc/cpu/exact_*.cpp, csrc/cuda/exact.cu).

  // out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), all of x's dtype (float32, float64,
  // float16, bfloat16), float32 accumulation (float64 for float64). Each output element's
  // reduction order is fixed by K alone: row m's bits do not depend on M or on the other rows.
  m.def("exact_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");

  // exact_linear with the weight kept as GGUF blocks: packed [N, row bytes] uint8, each row K /
  // block values blocks of type `qtype` (GGML number: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8,
  // Q4_K 12, Q5_K 13, Q6_K 14; others refused); x float32/float16/bfloat16. Equals, bit for bit,
  // exact_linear(x, W.to(x.dtype), bias) where W [N, K] is the float32 dequantisation of gguf-py
  // (and so of transformers' GGUF loader): the kernels rebuild W's rows inside the call.
  m.def("packed_linear(Tensor x, Tensor packed, int qtype, int K, Tensor? bias=None) -> Tensor");

  // Greedy decoding's output layer (CPU; kernels and the bound: dartree/cpu/greedy_head.h): the
  // argmax of each row of packed_linear(x, packed, qtype, K) without its whole float32 product.
  // x float32 [T, K]; codes uint8 [G, K / 4, 64] and stats float32 [3, 16 G] (G = ceil(V / 16),
  // V = packed.size(0)): dartree.greedy_head.head_codes of the dequantised packed rows. Returns
  // int64 [T]: argmax_row's order over the exact logits (a NaN first, ties the lowest column).
  m.def("greedy_head(Tensor x, Tensor codes, Tensor stats, Tensor packed, int qtype, int K) -> Tensor");
  // The bounds greedy_head reads: upper, lower float32 [T, V] with lower <= logit <= upper for
  // every exact float32 logit of x against the weights the codes were built from (rows with a NaN
  // or an infinity: -inf and +inf).
  m.def("greedy_head_bounds(Tensor x, Tensor codes, Tensor stats, int V) -> (Tensor, Tensor)");

  // tree_attention's contract, with each row a function of its logical key list alone (the prefix
  // keys, then its ancestors and itself in index order): a tree row equals the same query run as
  // a chain of one-token steps, bitwise, for any T, prefix split or thread count.
  m.def("exact_tree_attention(Tensor q, Tensor k, Tensor v, Tensor tree_mask, SymInt prefix_len, "
        "float? scale=None) -> Tensor");

  // The decoder layers of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) over T tokens of one
  // sequence, with the bits of transformers' forward when its linear layers run exact_linear (or
  // are packed) and its attention (exact_)tree_attention. CPU only (launcher:
  // csrc/cpu/decoder_stack.cpp; reference: dartree/decoder_stack.py's loop). x [T, H] the
  // embeddings (float32, bfloat16 or float16; not modified); kv [L, 2, 1, Hkv, S, D] the static
  // cache: each layer writes its roped keys and values at rows [start, start + T), then attends
  // with tree_mask bool [1, T, T] (the prefix rows [0, start) seen by all); cos, sin_signed
  // [T, D]: RoPE's tables, sin with its first half negated. Per layer l: weights, qtypes, biases
  // [7 l + j] for q, k, v, o, gate, up, down (qtype -1: a dense [N, K] weight in x's dtype, else
  // packed GGUF rows of that GGML type), norms [2 l], [2 l + 1] the input and post-attention RMSNorm
  // weights (with qk_norm: [4 l .. 4 l + 3], then q_norm and k_norm); heads = [Hq, Hkv, D,
  // qk_norm]; eps: the RMSNorms' epsilon; scaling: attention's. exact: exact_tree_attention, else
  // tree_attention. Returns the last layer's output [T, H] (before the final norm) and the outputs
  // of the layers in keep, in keep's order.
  m.def("decoder_stack(Tensor x, Tensor(a!) kv, SymInt start, Tensor tree_mask, Tensor cos, "
        "Tensor sin_signed, Tensor[] weights, int[] qtypes, Tensor?[] biases, Tensor[] norms, int[] heads, "
        "float eps, float scaling, bool exact, int[] keep) -> (Tensor, Tensor[])");

  // Position-keyed sampling (kernels: csrc/include/dartree/sample_keyed.cuh,
  // csrc/include/dartree/cpu/sample_keyed.h; launchers: csrc/{cpu,cuda}/sample_keyed.*;
  // reference: dartree/reference.py::sample_keyed). Gumbel-max over
  // logits [T, V] (float32/float64/float16/bfloat16) with noise keyed by (seed, positions[t],
  // token id) alone, so row t's token depends on its row, seed, positions[t] and temperature only;
  // temperature 0 = argmax. positions int64 [T]; output tokens int64 [T], preallocated.
  m.def("sample_keyed(Tensor logits, Tensor positions, int seed, float temperature, "
        "Tensor(a!) tokens) -> ()");
}
