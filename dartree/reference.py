"""Plain-PyTorch versions of every dartree op: the oracles for tests and the fallback kernels.

Each function states its contract (shapes, dtypes, semantics); `dartree.ops` validates inputs and
dispatches to the compiled kernels when they are built, to these functions otherwise. The sections
follow the op families of `dartree.ops`, in its order: cache, attention, tree, linear, sampling.
"""

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------
# cache: kv_commit


def kv_commit(kv, prefix_len, accepted):
    """Keep only the accepted branch of a verified tree in a static KV cache, in place; returns None.

    kv:       [..., S, D] (e.g. the whole cache [L, 2, B, Hkv, S, D])
    accepted: int64 [A] tree indices, strictly increasing, accepted[0] == 0
    effect:   kv[..., prefix_len + j, :] = kv[..., prefix_len + accepted[j], :] for j < A
    """
    rows = kv.index_select(-2, accepted + prefix_len)  # a copy: sources and targets may overlap
    kv[..., prefix_len:prefix_len + accepted.numel(), :] = rows


# ---------------------------------------------------------------------------------------------
# attention: tree_attention, exact_tree_attention (batch-invariant: the reference gives the values;
# the kernel adds that each row's bits are a function of that row's inputs alone, see csrc/ops.cpp)


def tree_attention(q, k, v, tree_mask, prefix_len, scale=None):
    """Attention of T tree queries over a static KV cache (grouped-query heads allowed).

    q:         [B, Hq, T, D]
    k, v:      [B, Hkv, S, D]; rows [0, prefix_len) are the committed prefix, rows
               [prefix_len, prefix_len + T) the tree's own keys, rows after are ignored; Hq % Hkv == 0
    tree_mask: bool [B, T, T], True where key j is query i or one of its ancestors
    scale:     softmax scale, default D ** -0.5
    returns    [B, Hq, T, D] in q's dtype: query i attends to every prefix key and to the tree
               keys allowed by row i of tree_mask.
    """
    batch, heads, size, _ = q.shape
    end = prefix_len + size
    if k.shape[2] < end:
        raise ValueError(f"tree_attention: prefix_len {prefix_len} + T {size} exceeds the key length {k.shape[2]}")
    if heads % k.shape[1]:
        raise ValueError(f"tree_attention: Hq {heads} is not a multiple of Hkv {k.shape[1]}")
    if tree_mask.shape != (batch, size, size) or tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_attention: tree_mask must be bool [{batch}, {size}, {size}], "
                         f"got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    mask = torch.ones(batch, 1, size, end, dtype=torch.bool, device=q.device)
    mask[:, 0, :, prefix_len:] = tree_mask
    return F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], attn_mask=mask,
                                          scale=scale, enable_gqa=True)


def exact_tree_attention(q, k, v, tree_mask, prefix_len, scale=None):
    """`tree_attention` in float64, returned in q's dtype (shapes and semantics: tree_attention)."""
    return tree_attention(q.double(), k.double(), v.double(), tree_mask, prefix_len, scale).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# tree: the draft-tree ops (candidate top-k, one DARTree level, the whole build, pruning and its
# verify layout, the verify walk)


def compute_dtype(dtype):
    """The dtype arithmetic runs in: float64 stays float64; every other float dtype computes in
    float32 (as the kernels accumulate, and transformers computes norms and RoPE)."""
    return torch.promote_types(dtype, torch.float32)


def stable_topk(x, n):
    """Indices of the n largest entries along the last dim: value descending, equal values by lower
    index (a stable sort's order, without sorting the whole row). x: float [..., N], 0 <= n <= N."""
    size = x.shape[-1]
    if n == 0 or size <= 4096 or 8 * n >= size:  # a sort is cheap here and needs no host sync
        return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :n]
    values, pos = torch.topk(x, n, dim=-1)
    inside = x >= values[..., -1:]
    width = int(inside.sum(-1).max())
    if width > n:  # ties at the threshold: gather every entry inside it, by index
        earlier_first = torch.arange(size, 0, -1, device=x.device)
        pos = torch.topk(torch.where(inside, earlier_first, 0), width, dim=-1).indices
    pos = torch.sort(pos, dim=-1).values
    order = torch.sort(x.gather(-1, pos), dim=-1, descending=True, stable=True).indices[..., :n]
    return pos.gather(-1, order)


def candidate_topk(logits, num_candidates):
    """The C best tokens of every draft slot, and each slot's log-normaliser over the whole vocabulary.

    logits:         float [k, V] (any float dtype)
    num_candidates: C, 1 <= C <= V
    returns (values, ids, lse):
      values [k, C] compute dtype (float64 for float64 input, else float32), descending per row
      ids    [k, C] int64 token ids; equal values are ordered by the lower token id
      lse    [k]    compute dtype, logsumexp of the row over all V tokens
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"candidate_topk: logits must be a float [k, V] tensor, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if not 1 <= num_candidates <= vocab:
        raise ValueError(f"candidate_topk: num_candidates must be in [1, {vocab}], got {num_candidates}")
    x = logits.to(compute_dtype(logits.dtype))
    ids = stable_topk(x, num_candidates)
    return x.gather(1, ids), ids, torch.logsumexp(x, dim=-1)


def expand_level(parent_scores, parent_states, z, w_s, cand_w2, cand_b2, cand_base, cand_ids,
                 num_expand, num_select, input_table=None, w_hh=None, b_hh=None):
    """One DARTree level: score every (frontier parent, candidate) pair, keep the best Q, step the GRU.

    parent_scores [f]        path log-scores of the frontier; their dtype is the compute dtype
    parent_states [f, G]     GRU states of the frontier, or None (needed by the correction or the GRU)
    z             [r]        W_z h_i (+ b1) of this slot, or None for an uncorrected level
    w_s           [r, G]     state half of the correction's first layer (with z)
    cand_w2       [C, r]     rows of W_2 for the C candidates (with z)
    cand_b2       [C]        rows of b2 for the candidates, or None
    cand_base     [C]        base logits of the candidates, in candidate order (base-descending)
    cand_ids      [C] int64  token ids of the candidates
    num_expand    E, 1 <= E <= C: each parent may take only its first E candidates
    num_select    Q, 1 <= Q <= f * E
    input_table   [V, 3G]    E·W_ihᵀ (+ b_ih), or None: no GRU step, states out is None
    w_hh, b_hh    [3G, G], [3G] or None: the GRU's recurrent weights (gate order r, z, n)

    Per parent p and candidate j < C:
      c[p, j]  = cand_base[j] + (W_2[j] · SiLU(z + w_s g_p) + b2[j])    (corrected level)
               = cand_base[j]                                           (z is None)
      lp[p, j] = c[p, j] - logsumexp over all C candidates of c[p, :]   (renormalised over C)
      S[p, j]  = parent_scores[p] + lp[p, j]                            for j < E
    The Q pairs with the largest S are kept, ordered by S descending; equal scores keep the lower
    flat index p * E + j (lower parent position first, then lower candidate position).
    GRU step for each winner: g' = GRUCell(input_table[token], g_parent).
    returns (parent_pos [Q] int64 positions in the frontier, tokens [Q] int64, scores [Q] compute
    dtype, states [Q, G] compute dtype or None).
    """
    count = parent_scores.shape[0]
    width = cand_base.shape[0]
    if not 1 <= num_expand <= width:
        raise ValueError(f"expand_level: num_expand must be in [1, {width}], got {num_expand}")
    if not 1 <= num_select <= count * num_expand:
        raise ValueError(f"expand_level: num_select must be in [1, {count * num_expand}], got {num_select}")
    dtype = parent_scores.dtype
    logits = cand_base.to(dtype).expand(count, width)
    if z is not None:
        mid = F.silu(z.to(dtype) + parent_states.to(dtype) @ w_s.to(dtype).T)  # [f, r]
        delta = mid @ cand_w2.to(dtype).T  # [f, C]
        if cand_b2 is not None:
            delta = delta + cand_b2.to(dtype)
        logits = logits + delta
    log_probs = logits[:, :num_expand] - torch.logsumexp(logits, dim=-1, keepdim=True)
    flat = (parent_scores[:, None] + log_probs).reshape(-1)
    best = stable_topk(flat, num_select)
    parent_pos = torch.div(best, num_expand, rounding_mode="floor")
    tokens = cand_ids[best % num_expand]
    states = None
    if input_table is not None:
        states = _gru_cell(input_table[tokens].to(dtype), parent_states[parent_pos].to(dtype),
                           w_hh.to(dtype), None if b_hh is None else b_hh.to(dtype))
    return parent_pos, tokens, flat[best], states


def _gru_cell(gi, g, w_hh, b_hh):
    """PyTorch GRU cell from the input term gi [n, 3G] and the state g [n, G]."""
    gh = F.linear(g, w_hh, b_hh)
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    reset = torch.sigmoid(i_r + h_r)
    update = torch.sigmoid(i_z + h_z)
    new = torch.tanh(i_n + reset * h_n)
    return (1 - update) * new + update * g


def build_dartree(cand_values, cand_ids, root, root_state, z, w_s, w_2, b_2, input_table,
                  w_hh, b_hh, num_expand, plan, prefix_len, budget, depth_bonus):
    """The whole DARTree build of one round, level by level with `expand_level`, then `prune_tree`.

    cand_values [k, C] compute dtype T, cand_ids [k, C] int64: each slot's candidates (from
    `candidate_topk`); root int64 [1]; plan: nodes selected per level (len L <= k); level d uses
    slot d, is corrected when z is not None and d >= prefix_len, and steps the GRU when
    input_table is not None and d < L - 1. root_state [G] or [1, G] (with z or input_table), or
    None with input_table and w_hh: then GRU(input_table[root], 0), the Domino head's root state;
    z [k, r]; w_s [r, G]; w_2 [V2, r] (the head's W_2, indexed by cand_ids) or [k, C, r] (rows
    already gathered); b_2 [V2] or [k, C] likewise, or None; input_table [V, 3G];
    w_hh [3G, G]; b_hh [3G] or None. When sum(plan) > budget, the root and the `budget` best
    nodes by score + depth_bonus * depth are kept (`prune_tree`).
    returns (tokens, parents, depths int64 [N], scores T [N]), N = 1 + min(budget, sum(plan)):
    depth by depth, within a depth by score descending (ties: lower parent position, then lower
    candidate position); pruning keeps that order.
    """
    dtype, device = cand_values.dtype, cand_values.device
    state = None if root_state is None else root_state.reshape(1, -1).to(dtype)
    if state is None and input_table is not None:
        width = w_hh.shape[1]
        state = _gru_cell(input_table[root.reshape(1)].to(dtype), cand_values.new_zeros(1, width),
                          w_hh.to(dtype), None if b_hh is None else b_hh.to(dtype))
    cand_w2 = None if w_2 is None else (w_2[cand_ids] if w_2.dim() == 2 else w_2)
    cand_b2 = None if b_2 is None else (b_2[cand_ids] if b_2.dim() == 1 else b_2)
    frontier = torch.zeros(1, dtype=torch.int64, device=device)
    tokens, parents = [root.reshape(1)], [frontier - 1]
    depths, scores = [torch.zeros_like(frontier)], [torch.zeros(1, dtype=dtype, device=device)]
    placed = 1
    for depth, count in enumerate(plan, start=1):
        slot = depth - 1
        correction = (None,) * 4
        if z is not None and slot >= prefix_len:
            correction = (z[slot], w_s, cand_w2[slot], None if cand_b2 is None else cand_b2[slot])
        gru = (input_table, w_hh, b_hh) if input_table is not None and depth < len(plan) else (None,) * 3
        parent_pos, new_tokens, new_scores, new_state = expand_level(
            scores[-1], state, *correction, cand_values[slot], cand_ids[slot], num_expand, count, *gru)
        tokens.append(new_tokens)
        parents.append(frontier[parent_pos])
        depths.append(torch.full((count,), depth, dtype=torch.int64, device=device))
        scores.append(new_scores)
        frontier = torch.arange(placed, placed + count, device=device)
        placed += count
        state = new_state
    tokens, parents = torch.cat(tokens), torch.cat(parents)
    depths, scores = torch.cat(depths), torch.cat(scores)
    if placed - 1 <= budget:
        return tokens, parents, depths, scores
    kept, new_parents = prune_tree(parents, depths, scores, budget, depth_bonus)
    return tokens[kept], new_parents, depths[kept], scores[kept]


def prune_tree(parents, depths, scores, budget, depth_bonus):
    """Keep the root and the `budget` best nodes of a tree by score + depth_bonus * depth.

    parents [M] int64 (parents[0] == -1, parents[i] < i), depths [M] int64, scores [M] float;
    index 0 is the root, always kept. key[i] = scores[i] + depth_bonus * depths[i], computed in
    scores' dtype (depth_bonus and the depth are rounded to it first). The min(budget, M - 1) non-root
    nodes with the largest key are kept; equal keys keep the lower index.
    returns (kept [N'] int64 ascending with kept[0] == 0, new_parents [N'] int64 indices into kept,
    new_parents[0] == -1), N' = 1 + min(budget, M - 1).
    The kept set is prefix-closed when no key exceeds its parent's key (path scores never increase
    along an edge and depth_bonus <= 0); a kept node whose parent was dropped raises ValueError.
    """
    size = parents.shape[0]
    if parents.dim() != 1 or size == 0 or depths.shape != parents.shape or scores.shape != parents.shape:
        raise ValueError(f"prune_tree: parents, depths and scores must be [M] tensors with M >= 1, got "
                         f"{tuple(parents.shape)}, {tuple(depths.shape)}, {tuple(scores.shape)}")
    if budget < 1:
        raise ValueError(f"prune_tree: budget must be >= 1, got {budget}")
    keys = scores[1:] + depth_bonus * depths[1:].to(scores.dtype)
    best = stable_topk(keys, min(budget, size - 1)) + 1
    kept = torch.cat([best.new_zeros(1), torch.sort(best).values])
    remap = torch.full((size,), -1, dtype=torch.int64, device=parents.device)
    remap[kept] = torch.arange(kept.shape[0], device=parents.device)
    new_parents = remap[parents[kept].clamp_min(0)]
    new_parents[0] = -1
    if bool((new_parents[1:] < 0).any()):
        raise ValueError("prune_tree: a kept node's parent was pruned; scores + depth_bonus * depths "
                         "must not increase from a parent to its child")
    return kept, new_parents


def tree_layout(parents):
    """The verify layout of a tree whose parents come before their children.

    parents [N] int64 (parents[0] == -1, 0 <= parents[i] < i)
    returns (ancestors int32 [N, ceil(N / 32)]: bit j % 32 of word j // 32 in row i is set when j
    is i or one of its ancestors (the tree attention mask, bit-packed);
    first_child [N] int64: the lowest-index child, -1 for a leaf;
    next_sibling [N] int64: the next higher-index child of the same parent, -1 for the last).
    """
    size = parents.shape[0]
    device = parents.device
    rows = torch.arange(size, device=device)
    mask = torch.zeros(size, size, dtype=torch.bool, device=device)
    mask[rows, rows] = True
    node = parents.clone()
    for _ in range(size):
        has = node >= 0
        if not bool(has.any()):
            break
        mask[rows[has], node[has]] = True
        node = torch.where(has, parents[node.clamp_min(0)], node)
    words = -(-size // 32)
    bits = torch.zeros(size, words * 32, dtype=torch.int64, device=device)
    bits[:, :size] = mask.long()
    packed = (bits.view(size, words, 32) << torch.arange(32, device=device)).sum(-1)
    ancestors = (packed - (packed >= 2 ** 31).long() * 2 ** 32).to(torch.int32)
    children = rows[1:]
    first_child = torch.full((size,), size, dtype=torch.int64, device=device)
    first_child.scatter_reduce_(0, parents[1:], children, "amin")
    first_child[first_child == size] = -1
    next_sibling = torch.full((size,), -1, dtype=torch.int64, device=device)
    order = torch.sort(parents[1:], stable=True).indices + 1  # children grouped by parent, by index
    same = parents[order[1:]] == parents[order[:-1]]
    next_sibling[order[:-1][same]] = order[1:][same]
    return ancestors, first_child, next_sibling


def verify_tree(parents, tokens, target_tokens):
    """Walk a verified draft tree: the longest root path the target agrees with, and the bonus token.

    parents [T] int64 (parents[0] == -1, parents[i] < i), tokens [T] int64 (tokens[0] = root),
    target_tokens [T] int64: the target's own token after each node (argmax or sample of its row).
    Starting at the root, move to the child whose token equals target_tokens[cur] (the lowest index
    if several do) while there is one.
    returns (accepted [a] int64 tree indices of the path, accepted[0] == 0, increasing;
    bonus: 0-dim int64 tensor, target_tokens[last accepted]).
    """
    size = parents.shape[0]
    for name, tensor in (("parents", parents), ("tokens", tokens), ("target_tokens", target_tokens)):
        if tensor.dim() != 1 or tensor.shape[0] != size or tensor.dtype != torch.int64 or size == 0:
            raise ValueError(f"verify_tree: {name} must be a non-empty int64 [T] tensor like parents "
                             f"[{size}], got {tensor.dtype} {tuple(tensor.shape)}")
    par, tok, want = parents.tolist(), tokens.tolist(), target_tokens.tolist()
    if par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par) if i):
        raise ValueError("verify_tree: parents must have parents[0] == -1 and 0 <= parents[i] < i")
    children = [[] for _ in range(size)]
    for node in range(1, size):
        children[par[node]].append(node)
    path = [0]
    while True:
        cur = path[-1]
        nxt = next((c for c in children[cur] if tok[c] == want[cur]), None)
        if nxt is None:
            break
        path.append(nxt)
    return torch.tensor(path, dtype=torch.int64, device=parents.device), target_tokens[path[-1]].clone()


# ---------------------------------------------------------------------------------------------
# linear: exact_linear (batch-invariant: the reference gives the values; the kernel adds that each
# row's bits are a function of that row's inputs alone, see csrc/ops.cpp)


def exact_linear(x, weight, bias=None):
    """x [M, K] @ weight [N, K]^T (+ bias [N]) computed in float64, returned in x's dtype [M, N]."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def packed_linear(x, packed, qtype, K, bias=None):
    """x [M, K] @ W^T (+ bias) with W [N, K] the float32 weights of GGUF blocks `packed`
    [N, row bytes] (uint8), rounded to x's dtype: exact_linear on the dequantised weights."""
    from .gguf_blocks import dequantize

    return exact_linear(x, dequantize(packed, qtype, K).to(x.dtype), bias)


def greedy_head(x, packed, qtype, K):
    """The first largest logit of each row of packed_linear(x, packed, qtype, K), a NaN first
    (sample_keyed's argmax): int64 [T]."""
    logits = packed_linear(x, packed, qtype, K)
    return sample_keyed(logits, torch.zeros(x.shape[0], dtype=torch.int64, device=x.device), 0, 0.0)


def greedy_head_bounds(x, codes, stats, V):
    """csrc/include/dartree/cpu/greedy_head.h's bounds in float64: x [T, K] float32 rounded to int8
    per 32 values, the codes [G, K / 4, 64] (q + 128 of 16 columns, 4 k at a time) and stats [3, 16 G]
    (scale, err, qnorm) -> (upper, lower) float32 [T, V]; rows with a NaN or an infinity: +inf, -inf."""
    T, K = x.shape
    G, blocks = codes.shape[0], K // 32
    q = (codes.reshape(G, K // 4, 16, 4).permute(0, 2, 1, 3).reshape(G * 16, K)[:V].double() - 128)
    scale, err, qnorm = (stats[i, :V].double() for i in range(3))
    xb = x.reshape(T, blocks, 32)
    s = xb.abs().amax(-1) / 127                                     # float32, as the kernel divides
    xq = torch.where(s[..., None] > 0, torch.round(xb / s[..., None]).clamp(-127, 127), 0.0).double()
    sd = s.double()
    acc = torch.einsum("tbk,vbk,tb->tv", xq, q.reshape(-1, blocks, 32), sd)  # sum_b s_b sum_k q xq
    approx = scale * acc                                           # the offset cancels exactly here
    x64 = x.double()
    delta = (x64 - (sd[..., None] * xq).reshape(T, K)).norm(dim=1)
    u = 2.0 ** -24
    fp = u * ((K + 8) * 127 * x64.abs().sum(1) + (blocks + 3) * 383 * (sd * xq.abs().sum(-1)).sum(1))
    bound = 1.001 * (err * x64.norm(dim=1)[:, None] + qnorm * delta[:, None] + fp[:, None] * scale) \
        + approx.abs() * 2.0 ** -20
    finite = torch.isfinite(x).all(1, keepdim=True) & (x64.abs().sum(1, keepdim=True) < 1e28)
    upper = torch.where(finite, approx + bound, torch.inf).float()
    lower = torch.where(finite, approx - bound, -torch.inf).float()
    return upper, lower


# ---------------------------------------------------------------------------------------------
# sampling: position-keyed sampling (sample_keyed): the integer hash and the float steps of
# csrc/include/dartree/sample_keyed.cuh, one torch op per C operation (each rounds once, as the
# kernels do)

_GOLDEN = 0x9E3779B97F4A7C15
_SEED_SALT = 0x5851F42D4C957F2D
_U64 = (1 << 64) - 1


def _signed64(x):
    """A uint64 value as the int64 with the same bits (torch integer tensors are signed)."""
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


def _shr(x, k):
    """Logical right shift of int64 tensors (>> on signed tensors is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x):
    """SplitMix64's finaliser on int64 tensors; products wrap mod 2^64 like uint64 in C."""
    x = x ^ _shr(x, 30)
    x = x * _signed64(0xBF58476D1CE4E5B9)
    x = x ^ _shr(x, 27)
    x = x * _signed64(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def _seed_key(seed):
    """mix64(seed ^ kSeedSalt) as a Python int in [0, 2^64)."""
    return int(_mix64(torch.tensor(_signed64(seed ^ _SEED_SALT)))) & _U64


def _log_keyed(x):
    """fdlibm's logf of positive normal float32 x, step for step as in log_keyed."""
    ix = x.view(torch.int32) + (0x3F800000 - 0x3F3504F3)
    k = (ix >> 23) - 0x7F
    f = ((ix & 0x007FFFFF) + 0x3F3504F3).view(torch.float32) - 1.0
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    t1 = w * (w * float.fromhex("0x1.f13c4cp-3") + float.fromhex("0x1.999c26p-2"))
    t2 = z * (w * float.fromhex("0x1.23d3dcp-2") + float.fromhex("0x1.555554p-1"))
    r = t2 + t1
    hfsq = (f * 0.5) * f
    dk = k.to(torch.float32)
    y = s * (hfsq + r)
    y = y + dk * float.fromhex("0x1.2fefa2p-17")
    y = y - hfsq
    y = y + f
    return y + dk * float.fromhex("0x1.62e3p-1")


def keyed_gumbel(seed, positions, vocab_ids):
    """The Gumbel noise of sample_keyed: float32 [T, n] for positions int64 [T] and token ids
    int64 [n]; entry (t, j) depends on (seed, positions[t], vocab_ids[j]) alone."""
    key = _signed64(_seed_key(seed))
    rows = _mix64(positions.to(torch.int64) * _signed64(_GOLDEN) + key)
    bits = _mix64(rows[:, None] + (vocab_ids.to(torch.int64)[None] + 1) * _signed64(_GOLDEN))
    u = (_shr(bits, 41) * 2 + 1).to(torch.float32) * 2.0 ** -24
    return -_log_keyed(-_log_keyed(u))


def _first_best(scores):
    """Per row: the first NaN, else the first maximum (the kernels' `beats` order)."""
    best = scores.max(dim=-1, keepdim=True).values
    hit = (scores == best) | (scores.isnan() & best.isnan())
    ids = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    return torch.where(hit, ids, scores.shape[-1]).min(dim=-1).values


def sample_keyed(logits, positions, seed, temperature, chunk=1 << 20):
    """Position-keyed Gumbel-max sampling: the token of every row, int64 [T].

    logits:      [T, V] float32/float64/float16/bfloat16 (read as float32)
    positions:   int64 [T], the absolute position of each row (any int64: a key)
    seed:        int in [0, 2^64)
    temperature: 0 = argmax; else token_t = argmax_v fl(fl(l_v * inv_t) + g(seed, p_t, v)) with
                 inv_t = float32(1 / temperature) and g = keyed_gumbel. Order: NaN first, then
                 the larger score, then the lower id. Rows are done `chunk` elements at a time.
    """
    logits = logits.to(torch.float32)
    if temperature == 0:
        return _first_best(logits)
    inv_t = float(torch.tensor(1.0 / temperature, dtype=torch.float32))
    vocab = logits.shape[1]
    ids = torch.arange(vocab, device=logits.device)
    step = max(1, chunk // max(vocab, 1))
    out = [_first_best(logits[i:i + step] * inv_t + keyed_gumbel(seed, positions[i:i + step], ids))
           for i in range(0, logits.shape[0], step)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64, device=logits.device)
