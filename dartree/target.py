"""Target adapter over `transformers`: tree attention, a static KV cache, and layer features.

`TargetModel` runs a Hugging Face causal LM (Llama, Qwen2, Qwen3, Mistral without a sliding
window, ...) with dartree's own attention function, registered with transformers'
`AttentionInterface` under the name `ATTENTION_NAME`. For the duration of each call the model's
config selects that function; the model runs with `use_cache=False` and explicit `position_ids`,
and the per-call state (`_Pass`) travels to every attention layer as the keyword argument
`dartree_pass`. There the layer's new K/V rows are written into the single static cache tensor and
its queries attend with `dartree.ops.tree_attention` (verify) or causally (prefill). No mask function
is registered under that name in `AttentionMaskInterface`: transformers then skips mask creation
entirely (`attention_mask` is None), including its packed-sequence check on `position_ids`, which
would cost a host sync per call (tree positions are not consecutive).
Features are the outputs of chosen decoder layers, captured by forward hooks for the call only.
Llama, Mistral, Qwen2 and Qwen3 run `dartree.decoder_stack.forward` instead of the model's forward:
the same modules, weights and operations (bit for bit: tests/test_decoder_stack.py) in one loop
that calls `_attend` directly, without transformers' per-call overhead.

Example (greedy decoding, one token per round):

    target = TargetModel(hf_model, feature_layers=[1])
    target.allocate(max_len=512)
    logits, _ = target.prefill(prompt_ids)                      # prompt_ids: LongTensor [n]
    bonus = int(logits[-1].argmax())
    for _ in range(16):
        logits, _ = target.verify(DraftTree.chain(torch.tensor([bonus])))
        target.commit(torch.zeros(1, dtype=torch.long))
        bonus = int(logits[0].argmax())
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F
from transformers.modeling_utils import AttentionInterface

from . import compilation, decoder_stack, exact_mode, greedy_head, linear_routing, ops
from .gguf import PackedLinear
from .kv_cache import StaticKVCache
from .sampling import Sampling

ATTENTION_NAME = "dartree_static_tree"


@dataclasses.dataclass
class _Pass:
    """State of one target forward, read by `_attention` in every layer.

    kv:        the static cache [L, 2, 1, Hkv, max_len, D]
    start:     first cache row of this call's tokens (= the committed prefix length)
    tree_mask: bool [1, T, T] ancestor-or-self mask (verify), or None for a causal prefill
    layers:    number of attention calls seen, checked against the model's layer count
    exact:     attend with the batch-invariant `ops.exact_tree_attention` (prefill included)
    """

    kv: torch.Tensor
    start: int
    tree_mask: torch.Tensor | None
    layers: int = 0
    exact: bool = False


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """dartree's attention for transformers' `AttentionInterface`.

    query [1, Hq, T, D], key/value [1, Hkv, T, D] (RoPE already applied) for the T new tokens.
    Writes key/value into cache rows [start, start + T) of layer `module.layer_idx` and returns
    (output [1, T, Hq, D], None) as transformers expects.
    """
    state = kwargs.get("dartree_pass")
    if state is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} only runs inside TargetModel calls")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"sliding-window attention is not supported (window {kwargs['sliding_window']})")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("attention logit soft-capping and attention sinks are not supported")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"attention module {type(module).__name__} has no layer_idx")
    return _attend(state, layer, query, key, value, scaling).transpose(1, 2), None


def _attend(state, layer, query, key, value, scaling):
    """Write key/value [1, Hkv, T, D] into cache rows [start, start + T) of `layer`, then attend:
    query [1, Hq, T, D] -> [1, Hq, T, D]."""
    size = query.shape[2]
    k_cache, v_cache = state.kv[layer, 0], state.kv[layer, 1]
    ops.write_rows(state.kv, layer, state.start, key, value)
    if state.exact:  # a prefill is the chain over its own keys
        mask = state.tree_mask
        if mask is None:
            mask = torch.ones(size, size, dtype=torch.bool, device=query.device).tril()[None]
        out = ops.exact_tree_attention(query, k_cache, v_cache, mask, state.start, scaling)
    elif state.tree_mask is None:  # prefill from an empty cache: plain causal attention
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        out = ops.tree_attention(query, k_cache, v_cache, state.tree_mask, state.start, scaling)
    state.layers += 1
    return out


AttentionInterface.register(ATTENTION_NAME, _attention)


def _verify_stack(model, ids, positions, tree_mask, kv, start, exact, linear, keep):
    """decoder_stack.forward over a verify tree with dartree's attention, as one function for
    torch.compile: (logits [T, V], {layer: [T, H]}, attention calls seen)."""
    state = _Pass(kv=kv, start=start, tree_mask=tree_mask, exact=exact)
    logits, captured = decoder_stack.forward(model, ids, positions, linear,
                                             functools.partial(_attend, state), keep)
    return logits, captured, state.layers


def layer_feature(model, layer: int, output: torch.Tensor) -> torch.Tensor:
    """The feature a drafter reads from decoder layer `layer` of `model` (a transformers causal
    LM), given that layer's output: transformers' `hidden_states[layer + 1]`, so the output itself,
    except the last layer's, which is taken after the final norm. Training (`train.features`) and
    inference (`TargetModel`) both capture through this one function; `decoder_stack.forward`
    applies the same norm in its loop (tests check all three against `hidden_states`)."""
    if layer == model.config.num_hidden_layers - 1:
        return model.model.norm(output)
    return output


class TargetModel:
    """A transformers causal LM with a static KV cache, tree verification and feature capture.

    model:          a `transformers` causal LM whose attention goes through `AttentionInterface`
                    and whose decoder layers are `model.model.layers` (batch size 1 throughout)
    feature_layers: decoder layer ids l whose outputs are the features, concatenated in this order;
                    feature l == transformers' `hidden_states[l + 1]` (for the last layer, after
                    the final norm, as transformers and the public DFlash code read it)

    exact:          run prefill and verify on the batch-invariant kernels (`dartree.exact()`), so
                    every row's logits have the bits of one-token decoding under `dartree.exact()`
    compile:        run verify's forward through torch.compile (fullgraph; Llama-family models
                    on dartree's own loop, `decoder_stack`): True, False or "auto"
                    (`compilation.resolve_compile`). The prefill stays eager (its length changes
                    per prompt). `compile_seconds` sums the time of calls that compiled a graph.

    The user's model is not changed: the attention implementation is switched only during calls,
    hooks exist only during calls, and no parameter or config field is kept modified.
    """

    def __init__(self, model, feature_layers, exact=False, compile="auto"):
        self.model = model
        self.config = model.config
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"model {type(model).__name__} has no decoder layers at model.model.layers")
        if not getattr(model, "_supports_attention_backend", False):
            raise ValueError(f"model {type(model).__name__} does not route its attention through "
                             "transformers' AttentionInterface")
        _check_full_attention(self.config)
        self._layers = layers
        self.num_layers = len(layers)
        self.feature_layers = [int(l) for l in feature_layers]
        bad = [l for l in self.feature_layers if not 0 <= l < self.num_layers]
        if bad:
            raise ValueError(f"feature_layers must be in [0, {self.num_layers}), got {bad}")
        cfg = self.config
        self.hidden_size = cfg.hidden_size
        heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.vocab_size = model.get_output_embeddings().out_features
        param = next(model.parameters())  # a norm's weight: never a packed GGUF layer
        self.device, self.dtype = param.device, param.dtype
        self.exact = bool(exact)
        if self.exact and not ops.exact_kernels_available(self.device):
            raise ValueError(f"exact=True needs dartree's batch-invariant kernels on {self.device} "
                             f"(extension built: {ops.HAS_EXTENSION})")
        self._gemv_rows = 0 if self.exact else linear_routing.gemv_rows(self.dtype, self.device)
        self.compiled = compilation.resolve_compile(compile, self.exact)
        self.compile_seconds = 0.0
        # every config object the attention modules read `_attn_implementation` from
        self._configs = list({id(m.config): m.config for m in model.modules()
                              if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")}.values())
        # transformers' forward runs where dartree's own loop cannot stand in for it
        self._stack_unsupported = decoder_stack.unsupported(model)
        # ... and where its layers can run as one `ops.decoder_stack` call (CPU)
        self._one_call = (self._stack_unsupported is None and ops.decoder_stack_available(self.device)
                          and decoder_stack.op_unsupported(model) is None)
        self._all_packed = all(type(m) is PackedLinear for layer in layers
                               for m in decoder_stack.projections(layer))
        self._hooked = decoder_stack.Hooks(list(model.modules()))  # asked at every call
        self._stack_args = None  # ops.decoder_stack's weights, read once per allocate()
        self.cache = StaticKVCache(self.num_layers, self.num_kv_heads, self.head_dim, batch_dims=(1,))
        self._tree_size = None  # T of the last verify, until its commit
        self._greedy = None  # (output layer, whether a GreedyHead applies to it)

    # ------------------------------------------------------------------------------ embeddings

    def embed(self, ids):
        """Input embedding of ids (LongTensor [n]) -> [n, H] in the model dtype."""
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, h):
        """Output embedding: h [n, H] -> logits [n, V]."""
        return self.model.get_output_embeddings()(h)

    # ------------------------------------------------------------------------------ cache

    kv = property(lambda self: self.cache.tensor, doc="The static cache [L, 2, 1, Hkv, max_len, D].")
    max_len = property(lambda self: self.cache.max_len, doc="Positions the cache holds.")
    seq_len = property(lambda self: self.cache.length, doc="Committed positions (the prefix length).")

    def allocate(self, max_len):
        """Allocate the static cache kv [L, 2, 1, Hkv, max_len, D] (model dtype, zeros); seq_len = 0.

        The tensor is reused when it already has this max_len. The model's weight tensors are
        looked up again at the next forward (values are always read at the call: a module or
        tensor replaced in the model is seen from the next allocate on)."""
        if self.cache.allocate(int(max_len), self.dtype, self.device) and self.compiled:
            self.cache.mark_dynamic()  # one verify graph for every cache length (it changes per call)
        self._tree_size = None
        self._stack_args = None

    def prefill(self, ids, last_only=False):
        """Run the prompt ids (LongTensor [n], or [1, n]) causally at positions 0..n-1.

        Requires seq_len == 0; writes K/V rows [0, n) and sets seq_len = n.
        last_only: the logits of the last position alone, [1, V] (what a decoder reads: the output
        layer over every position was about a tenth of a float32 SmolLM2 prefill).
        Returns (logits [n, V], features [n, nF*H]) in the model dtype."""
        self.cache.check_allocated()
        if self.seq_len != 0:
            raise RuntimeError(f"prefill needs an empty cache (seq_len 0), got seq_len {self.seq_len}; "
                               "call allocate() to start a new generation")
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        self._check_tokens(ids, "ids", values=True)
        self.cache.check_fits(ids.numel())
        logits, features = self._forward(ids, torch.arange(ids.numel(), device=self.device), None,
                                         last_only=last_only)
        self.cache.length = ids.numel()
        return logits, features

    def verify(self, tree, check=True, greedy=False):
        """Run a draft tree (root = the bonus token at position seq_len) against the committed prefix.

        tree:   `dartree.tree.DraftTree` with T nodes (tokens, depths [T] int64 on this device;
                `ancestor_mask()` bool [T, T])
        check:  also check the token values are in the vocabulary (one host sync)
        greedy: return each row's argmax token instead of its logits: int64 [T], the first
                largest logit (a NaN first), as `Sampling().tokens` picks it. A packed float32
                output layer on an AVX512-VNNI CPU then computes only the logits that can win
                (`dartree.greedy_head`: SmolLM2's output layer 0.55-0.87 against 1.2-1.3 ms at
                one row, 1.3-1.9 against 3.2-3.3 ms at 8; bench/greedy_head.py).
        Node i sits at position seq_len + depths[i] and sees the prefix, its ancestors and itself.
        Writes the tree's K/V at rows [seq_len, seq_len + T); seq_len is unchanged until commit.
        Returns (logits [T, V] or tokens [T], features [T, nF*H]); logits and features in the
        model dtype."""
        self.cache.check_allocated()
        tokens, depths = tree.tokens, tree.depths
        self._check_tokens(tokens, "tree.tokens", values=check)
        size = tokens.numel()
        if depths.shape != tokens.shape or depths.dtype != torch.int64 or depths.device != tokens.device:
            raise ValueError(f"tree.depths must be int64 {tuple(tokens.shape)} on {tokens.device}, "
                             f"got {depths.dtype} {tuple(depths.shape)} on {depths.device}")
        mask = tree.ancestor_mask()
        if mask.shape != (size, size) or mask.dtype != torch.bool or mask.device != tokens.device:
            raise ValueError(f"tree.ancestor_mask() must be bool [{size}, {size}] on {tokens.device}, "
                             f"got {mask.dtype} {tuple(mask.shape)} on {mask.device}")
        self.cache.check_fits(self.seq_len + size)
        logits, features = self._forward(tokens, self.seq_len + depths, mask[None], greedy)
        self._tree_size = size
        return logits, features

    def commit(self, accepted, check=True):
        """Keep the accepted path of the last verified tree: seq_len += len(accepted).

        accepted: int64 [a] tree indices, strictly increasing, accepted[0] == 0 (the root), on
                  this device; cache rows seq_len + accepted[j] move to seq_len + j in every layer
        check:    also check the index values (one host sync)"""
        if self._tree_size is None:
            raise RuntimeError("commit needs a verified tree: call verify() first")
        if accepted.dim() != 1 or accepted.dtype != torch.int64 or accepted.device != self.device:
            raise ValueError(f"accepted must be a 1-D int64 tensor on {self.device}, got "
                             f"{accepted.dtype} {tuple(accepted.shape)} on {accepted.device}")
        count = accepted.numel()
        if not 1 <= count <= self._tree_size:
            raise ValueError(f"accepted must hold 1..{self._tree_size} indices (the tree size), got {count}")
        if check:
            idx = accepted.tolist()
            if idx[0] != 0 or any(b <= a for a, b in zip(idx, idx[1:])) or idx[-1] >= self._tree_size:
                raise ValueError("accepted must be strictly increasing tree indices starting at 0 and "
                                 f"below the tree size {self._tree_size}, got {idx}")
        self.cache.commit(accepted)
        self._tree_size = None

    # ------------------------------------------------------------------------------ internals

    def _forward(self, ids, positions, tree_mask, greedy=False, last_only=False):
        """One forward of ids [T] at positions [T] with dartree's attention; see verify/prefill.

        Llama-family models run `decoder_stack.forward` (transformers' arithmetic without its
        per-call overhead), anything else transformers' own forward. greedy: the rows' argmax
        tokens instead of the logits; last_only: the last row's alone."""
        head = self._greedy_head() if greedy else None
        state = _Pass(kv=self.kv, start=self.seq_len, tree_mask=tree_mask,
                      exact=self.exact or exact_mode.active())
        gemv = ids.numel() <= self._gemv_rows
        if self._stack_unsupported is None and not self._hooked():
            linear = linear_routing.stack_linear(state.exact, gemv, self.dtype, self.device)
            keep = frozenset(self.feature_layers)
            if last_only:  # the output layer on the last row only ([1, T, K] for `linear`)
                layer = self.model.get_output_embeddings()
                rows = head or (lambda h: decoder_stack.project(layer, h[None], linear)[0])
                head = lambda hidden: rows(hidden[-1:])  # noqa: E731
            with torch.no_grad():
                if self.compiled and tree_mask is not None and not state.exact:
                    logits, captured = self._compiled_forward(ids, positions, state, linear, keep)
                    head = None  # (a compiled target has none: the graph gives logits)
                elif self._one_call and (tree_mask is not None or state.exact) and \
                        (state.exact or gemv or self._all_packed):
                    # every layer in one op call: the same bits as the loop below when its linear
                    # layers are exact_linear or packed (a non-exact prefill takes SDPA there)
                    if tree_mask is None:
                        tree_mask = torch.ones(ids.numel(), ids.numel(), dtype=torch.bool,
                                               device=self.device).tril()[None]
                    if self._stack_args is None:
                        self._stack_args = decoder_stack.stack_arguments(self.model)
                    logits, captured = decoder_stack.op_forward(self.model, ids, positions, state.kv,
                                                                state.start, tree_mask, state.exact,
                                                                keep, linear, self._stack_args, head)
                    state.layers = self.num_layers
                else:
                    logits, captured = decoder_stack.forward(self.model, ids, positions, linear,
                                                             functools.partial(_attend, state), keep, head)
        else:
            logits, captured = self._hf_forward(ids, positions, state, gemv)
            head = None
        if state.layers != self.num_layers:
            raise RuntimeError(f"only {state.layers} of {self.num_layers} layers of {type(self.model).__name__} "
                               "ran through transformers' AttentionInterface")
        if head is None:  # every row's logits came back
            if last_only:
                logits, positions = logits[-1:], positions[-1:]
            if greedy:
                logits = Sampling().tokens(logits, positions)
        hidden = [captured[l] for l in self.feature_layers]
        features = torch.cat(hidden, dim=-1) if hidden else torch.zeros(ids.numel(), 0, dtype=self.dtype,
                                                                         device=self.device)
        return logits, features

    def prepare_greedy(self) -> None:
        """Build the output layer's GreedyHead now (SmolLM2: 0.7 s, 28 MB) where one applies,
        rather than in the first greedy verify: a decoder calls this before it times a round."""
        self._greedy_head()

    def _greedy_head(self):
        """The output layer's GreedyHead where one applies (greedy_head.head_of: shared, built
        once), else None."""
        layer = self.model.get_output_embeddings()
        if self._greedy is None or self._greedy[0] is not layer:  # (a layer replaced in the model)
            self._greedy = (layer, greedy_head.applies(layer, self.dtype) and not self.compiled)
        return greedy_head.head_of(layer) if self._greedy[1] else None

    def _compiled_forward(self, ids, positions, state, linear, keep):
        """The verify forward through this model's compiled `_verify_stack` (one per linear and
        feature set: dartree.compilation); adds a compiling call's time to compile_seconds. The
        prefix length is traced as a SymInt (ops.cpp), so rounds do not recompile."""
        verify_stack = compilation.compiled(_verify_stack, self.model, (linear, keep))
        (logits, captured, state.layers), seconds = compilation.timed(lambda: verify_stack(
            self.model, ids, positions, state.tree_mask, state.kv, state.start, state.exact,
            linear, keep))
        self.compile_seconds += seconds
        return logits, captured

    def _hf_forward(self, ids, positions, state, gemv):
        """transformers' forward, dartree's attention selected: (logits [T, V], {layer: [T, H]})."""
        captured = {}
        routed = linear_routing.hf_linears(self.exact, self._gemv_rows if gemv else 0)
        with torch.no_grad(), self._attention_selected(), self._hooks(captured), routed:
            out = self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                             dartree_pass=state)
        return out.logits[0], {layer: layer_feature(self.model, layer, h) for layer, h in captured.items()}

    @contextlib.contextmanager
    def _attention_selected(self):
        """Select dartree's attention on the model's configs for the duration of a call."""
        previous = [cfg._attn_implementation for cfg in self._configs]
        try:
            for cfg in self._configs:
                cfg._attn_implementation = ATTENTION_NAME
            yield
        finally:
            for cfg, name in zip(self._configs, previous):
                cfg._attn_implementation = name

    @contextlib.contextmanager
    def _hooks(self, captured):
        """Capture the outputs ([1, T, H] -> [T, H]) of the feature layers during a call."""
        def hook(layer):
            def save(module, args, output):
                captured[layer] = (output[0] if isinstance(output, tuple) else output)[0]
            return save

        handles = [self._layers[l].register_forward_hook(hook(l)) for l in set(self.feature_layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _check_tokens(self, ids, name, values):
        if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
        if ids.device != self.device:
            raise ValueError(f"{name} is on {ids.device}, the target on {self.device}")
        if values:
            low, high = torch.stack(torch.aminmax(ids)).tolist()
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"{name} must be token ids in [0, {self.vocab_size}), got values in [{low}, {high}]")


def _check_full_attention(config):
    """Refuse configs with sliding-window (or any non-full) attention layers."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise ValueError(f"only full-attention layers are supported, the model has {other}")
    elif getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"sliding-window attention is not supported (sliding_window {config.sliding_window})")
