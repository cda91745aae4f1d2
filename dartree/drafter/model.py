"""The DFlash block-diffusion drafter (research/ALGORITHMS.md §1).

The drafter is a stack of Qwen3-style decoder layers that read the target's hidden states
("context features") through KV injection: every layer projects the fused context features ``c``
and the block states ``x`` with the *same* k/v projections (and k_norm), so the block queries
attend over ``[context ; block]`` with no mask. The drafter has no embedding and no LM head of its
own: block tokens are embedded with the target's input embedding and its hidden states are read
out with the target's LM head.

Two passes share the layers: :meth:`Drafter.draft` (inference: one block per round, the context
K/V in a static cache) and :meth:`Drafter.forward` (training: many blocks of many windows at
once, no cache, a mask in place of the cache's extent).

Example::

    drafter = load_drafter("Qwen3-8B-Domino-b16", target)
    drafter.reset(max_len=4096)
    h = drafter.draft(prompt_features, bonus=first_token, s=prompt_len)   # [k, H]
    logits = drafter.base_logits(h)                                      # [k, V]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import compilation, ops
from ..kv_cache import StaticKVCache
from ..reference import compute_dtype
from .config import (DrafterConfig, check_fits_target, embedding_table, module_dtype_device,
                     target_io)
from .head import DominoHead
from .vocab import check_ids, restrict_lm_head

_HEAD_KEYS = ("prefix_gru.", "embed_proj.")  # checkpoint keys of the head, at the top level
_HEAD_PREFIX = "head."  # where they live in the module


class RMSNorm(nn.Module):
    """``w * x / rms(x)``, computed in at least float32 and cast back (Qwen3/Llama semantics)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(compute_dtype(x.dtype))
        xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xc.to(x.dtype)


def _rope_inv_freq(config: DrafterConfig, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] in ``dtype`` on CPU, attention scaling) for the drafter's RoPE.

    Plain RoPE is computed in ``dtype`` (float32 reproduces transformers exactly); scaled
    types come from transformers' rope init functions (float32).
    """
    if config.rope_scaling is None:
        exponent = torch.arange(0, config.head_dim, 2, dtype=dtype) / config.head_dim
        return 1.0 / (config.rope_theta ** exponent), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = Qwen3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_parameters={**config.rope_scaling, "rope_theta": config.rope_theta},
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](hf_config, "cpu")
    return inv_freq.to(dtype), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, D] rotated by cos/sin [n, D] (half-split layout, as transformers)."""
    return x * cos + _rotate_half(x) * sin


class DrafterAttention(nn.Module):
    """KV-injection attention: block queries over [context ; block] keys.

    Shapes carry any leading batch dims: ``[..., n, H]`` rows -> ``[..., heads, n, D]``.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., n, H] (context features or normed block states) -> K, V [..., Hkv, n, D],
        K roped by cos/sin ([n, D], or broadcastable to K)."""
        heads = (self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).unflatten(-1, heads)).transpose(-3, -2)
        v = self.v_proj(x).unflatten(-1, heads).transpose(-3, -2)
        return _apply_rope(k, cos, sin), v

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, H] normed block states -> Q [..., Hq, T, D], roped at the block positions."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        return _apply_rope(q.transpose(-3, -2), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [Hq, T, D] over k, v [Hkv, S, D] (GQA, every key visible), or with a leading batch
        dim N and mask None or bool [N, 1, T, S] (True: visible) -> o_proj output [(N,) T, H]."""
        batched = q.dim() == 4
        if not batched:  # SDPA's fused CPU kernels take 4-D inputs only
            q, k, v = q[None], k[None], v[None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             scale=self.head_dim ** -0.5, enable_gqa=True)
        out = out.transpose(1, 2).flatten(2)
        return self.o_proj(out if batched else out[0])


class DrafterMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """One pre-norm decoder layer with KV injection.

    :meth:`forward_cached` (inference) writes the K/V of the new context rows and of the block
    into a static cache and attends over the cache; :meth:`forward` (training) takes the K/V
    of whole windows and a visibility mask. Both share the block's norm, projections,
    attention and MLP.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, c: torch.Tensor, cos_c: torch.Tensor, sin_c: torch.Tensor,
                cos_b: torch.Tensor, sin_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One layer over the blocks of N windows, no cache.

        x [N, T, H] block rows; c [N, L, H] fused features of each window at positions
        [0, L); cos_c/sin_c [L, D] at those positions; cos_b/sin_b [N, 1, T, D] at each block
        row's position; mask bool [N, 1, T, L + T]: which context and block keys a row sees.
        """
        kc, vc = self.self_attn.keys_values(c, cos_c, sin_c)
        xn, kb, vb = self._block_keys_values(x, cos_b, sin_b)
        return self._attend_and_mlp(x, xn, torch.cat([kc, kb], -2), torch.cat([vc, vb], -2),
                                    cos_b, sin_b, mask)

    def forward_cached(self, x: torch.Tensor, c: torch.Tensor, cache: torch.Tensor, index: int,
                       start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One layer over the block.

        x [B, H] block states; c [n, H] fused features of the new context rows at positions
        [start, start + n); cache [L, 2, Hkv, max_len, D] (this layer's is cache[index]);
        cos/sin [n + B, D] for positions start .. start + n + B - 1. Writes context K/V at rows
        [start, start + n) and block K/V at rows [start + n, start + n + B), attends over rows
        [0, start + n + B).
        """
        n, end = c.shape[0], start + c.shape[0] + x.shape[0]
        if n:
            ops.write_rows(cache, index, start, *self.self_attn.keys_values(c, cos[:n], sin[:n]))
        xn, kb, vb = self._block_keys_values(x, cos[n:], sin[n:])
        ops.write_rows(cache, index, start + n, kb, vb)
        kv = cache[index]
        return self._attend_and_mlp(x, xn, kv[0, :, :end], kv[1, :, :end], cos[n:], sin[n:])

    def _block_keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(normed block rows, their K, their V)."""
        xn = self.input_layernorm(x)
        return (xn, *self.self_attn.keys_values(xn, cos, sin))

    def _attend_and_mlp(self, x: torch.Tensor, xn: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
        """The residual attention of the block's queries over k, v, then the residual MLP."""
        attn = self.self_attn
        x = x + attn.attend(attn.queries(xn, cos, sin), k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """A DFlash drafter bound to a target model (whose embedding and LM head it uses).

    Runs in the target's dtype on the target's device. Per generation: :meth:`reset` once,
    then one :meth:`draft` per round; the context K/V of committed positions live in a static
    cache ``[L, 2, Hkv, max_len, D]``, the block's K/V are written past the context and
    dropped (overwritten) next round. Training calls the module itself (:meth:`forward`).

    Attributes: ``config``, ``path`` (checkpoint folder or None), ``head`` (DominoHead or None),
    ``block_size`` (B), ``num_slots`` (k), ``shift_label``, ``prefix_len`` (P),
    ``target_layer_ids``, ``mask_token_id``, ``ctx_len``, ``max_len``.
    """

    def __init__(self, config: DrafterConfig, target: Any, *, gru_bias: bool = False,
                 w1_bias: bool = False, w2_bias: bool = False):
        super().__init__()
        config.validate()
        embed, lm_head, target_config = target_io(target)
        check_fits_target(config, (embed.num_embeddings, embed.embedding_dim),
                          target_config.num_hidden_layers)
        self.config = config
        self.path: Path | None = None
        self._target_io = (embed, lm_head)  # a tuple: not registered, never saved or moved
        n_features = len(config.target_layer_ids)
        self.fc = nn.Linear(n_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = (DominoHead(config.hidden_size, config.vocab_size, config.emb_dim,
                                config.gru_hidden_dim, gru_bias=gru_bias, w1_bias=w1_bias,
                                w2_bias=w2_bias)
                     if config.is_domino else None)
        with torch.device("cpu"):
            _rope_inv_freq(config, torch.float32)  # fail at load on bad rope parameters
        # the context's and the block's K/V: [L, 2, Hkv, max_len, D], rows [0, ctx_len) committed
        self.cache = StaticKVCache(config.num_layers, config.num_kv_heads, config.head_dim,
                                   zeros=False)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._block_ids: torch.Tensor | None = None
        self._draft_vocab: torch.Tensor | None = None  # ascending ids on the CPU, or None: all
        self._draft_head: tuple = ()  # (LM head of those rows, (dtype, device), the ids there): unregistered

    block_size = property(lambda self: self.config.block_size)
    num_slots = property(lambda self: self.config.num_slots)
    shift_label = property(lambda self: self.config.shift_label)
    prefix_len = property(lambda self: self.config.pure_draft_prefix_len)
    target_layer_ids = property(lambda self: list(self.config.target_layer_ids))
    mask_token_id = property(lambda self: self.config.mask_token_id)
    device = property(lambda self: self.fc.weight.device)
    max_len = property(lambda self: self.cache.max_len)

    @property
    def ctx_len(self) -> int:
        """Positions whose K/V are in the cache: the context the next draft starts from."""
        return self.cache.length

    @ctx_len.setter
    def ctx_len(self, value: int) -> None:
        self.cache.length = value

    dtype = property(lambda self: self.fc.weight.dtype)

    def refresh_input_table(self) -> None:
        """Rebuild ``head.input_table`` from the target embedding (after changing W_ih)."""
        if self.head is not None:
            self.head.build_input_table(embedding_table(self._target_io[0]))

    def reset(self, max_len: int) -> None:
        """Prepare a generation: static context cache and RoPE tables for positions
        [0, max_len) (reused when shape, device and dtype are unchanged); ctx_len = 0.

        ``max_len`` must cover the last block: every draft at position s needs s + B <= max_len.
        """
        if isinstance(max_len, bool) or not isinstance(max_len, int) \
                or max_len < self.block_size:
            raise ValueError(f"max_len must be an int >= block_size ({self.block_size}), "
                             f"got {max_len!r}")
        cfg, device = self.config, self.device
        if self.cache.allocate(max_len, self.dtype, device):  # a new shape, dtype or device
            self._cos, self._sin = self._rope_tables(max_len)
            self._block_ids = torch.empty(cfg.block_size, dtype=torch.long, device=device)
        self._block_ids.fill_(cfg.mask_token_id)

    def _rope_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_len, D] in the drafter dtype; angles computed in >= float32."""
        with torch.device("cpu"):
            inv_freq, scaling = _rope_inv_freq(self.config, compute_dtype(self.dtype))
        inv_freq = inv_freq.to(self.device)
        freqs = torch.arange(max_len, device=self.device).to(inv_freq.dtype)[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype)

    @torch.no_grad()
    def draft(self, features: torch.Tensor, bonus: int | torch.Tensor, s: int,
              compiled: bool = False) -> torch.Tensor:
        """One block-diffusion pass: hidden states of the k used slots.

        features [n, nF*H] (target dtype): target features of positions [ctx_len, s), n = s -
        ctx_len; bonus: the root token at position s (int, or a LongTensor with one element on
        the drafter's device, not range-checked to avoid a host sync); s: its position.
        compiled: run the pass through torch.compile (fullgraph; n, the context length and the
        cache length symbolic after their first change: one graph for every round).
        Returns h [k, H] (after the final norm): slots 0..B-1 with shift_label, else 1..B-1;
        slot i predicts the token at position s + 1 + i (minus 1 without shift_label).
        Afterwards ctx_len = s.
        """
        self._check_draft_args(features, bonus, s)
        if isinstance(bonus, torch.Tensor):
            self._block_ids[:1].copy_(bonus.reshape(1))
        else:
            self._block_ids[0] = bonus
        if compiled:
            self.cache.mark_dynamic()  # the cache length changes per call, as the tables'
            for table in (self._cos, self._sin):
                torch._dynamo.maybe_mark_dynamic(table, 0)
            h = compilation.compiled(_block_pass, self)(self, features, self.ctx_len)
        else:
            h = _block_pass(self, features, self.ctx_len)
        self.ctx_len = s
        return h

    def forward(self, features: torch.Tensor, roots: torch.Tensor, anchors: torch.Tensor
                ) -> torch.Tensor:
        """Drafter states of many blocks at once, with gradients and no cache (training).

        features [N, L, nF*H]: target features of N windows of L positions; anchors LongTensor
        [N, A]: block positions in [1, L), distinct per row; roots LongTensor [N, A]: the token
        at each anchor. Block (r, i) = [roots[r, i], MASK x (B-1)] at positions a .. a+B-1
        (a = anchors[r, i]) sees the context rows < a of window r and its own rows.
        Returns h [N, A, k, H] after the final norm: for each block, what
        ``draft(features[r, :a], roots[r, i], s=a)`` returns after a reset.
        """
        cfg = self.config
        width = len(cfg.target_layer_ids) * cfg.hidden_size
        if features.dim() != 3 or features.shape[2] != width or anchors.dim() != 2 \
                or roots.shape != anchors.shape or anchors.shape[0] != features.shape[0]:
            raise ValueError(f"forward needs features [N, L, {width}], roots and anchors [N, A], "
                             f"got features {list(features.shape)}, roots "
                             f"{list(roots.shape)}, anchors {list(anchors.shape)}")
        N, L = features.shape[:2]
        A, B = anchors.shape[1], cfg.block_size
        block_ids = torch.full((N, A, B), cfg.mask_token_id, dtype=torch.long,
                               device=self.device)
        block_ids[:, :, 0] = roots
        x = self.embed(block_ids).to(self.dtype).view(N, A * B, -1)
        c = self._fuse(features)
        cos, sin = self._rope_tables(L + B)
        positions = (anchors[:, :, None] + torch.arange(B, device=self.device)).view(N, A * B)
        cos_b, sin_b = cos[positions][:, None], sin[positions][:, None]  # [N, 1, A*B, D]
        mask = _block_mask(anchors, L, B)
        for layer in self.layers:
            x = layer(x, c, cos[:L], sin[:L], cos_b, sin_b, mask)
        return self._readout(x.view(N, A, B, -1))

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., nF*H] -> the fused context rows c [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def _readout(self, x: torch.Tensor) -> torch.Tensor:
        """Block rows [..., B, H] -> the k used slots after the final norm [..., k, H]."""
        h = self.norm(x)
        return h if self.shift_label else h[..., 1:, :]

    def _check_draft_args(self, features: torch.Tensor, bonus: int | torch.Tensor, s: int) -> None:
        if self.cache.tensor is None:
            raise RuntimeError("call Drafter.reset(max_len) before draft()")
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"s must be an int, got {type(s).__name__}")
        if s < self.ctx_len:
            raise ValueError(f"s must be >= ctx_len ({self.ctx_len}), got {s}")
        if s + self.block_size > self.max_len:
            raise ValueError(f"block at position {s} (+{self.block_size}) exceeds the drafter "
                             f"cache (max_len {self.max_len})")
        width = len(self.config.target_layer_ids) * self.config.hidden_size
        expected = (s - self.ctx_len, width)
        if not isinstance(features, torch.Tensor) or tuple(features.shape) != expected:
            got = list(features.shape) if isinstance(features, torch.Tensor) else type(features)
            raise ValueError(f"features must be [{expected[0]}, {width}] (positions "
                             f"[{self.ctx_len}, {s}) x {len(self.config.target_layer_ids)} "
                             f"layers), got {got}")
        if not features.is_floating_point():
            raise ValueError(f"features must be floating point, got {features.dtype}")
        if features.device != self.device:
            raise ValueError(f"features must be on {self.device}, got {features.device}")
        if isinstance(bonus, torch.Tensor):
            if bonus.numel() != 1 or bonus.dtype != torch.long or bonus.device != self.device:
                raise ValueError(f"bonus must be an int or a one-element int64 tensor on "
                                 f"{self.device}, got {bonus.dtype} {list(bonus.shape)} on "
                                 f"{bonus.device}")
        elif isinstance(bonus, bool) or not isinstance(bonus, int) \
                or not 0 <= bonus < self.config.vocab_size:
            raise ValueError(f"bonus must be a token id in [0, {self.config.vocab_size}), "
                             f"got {bonus!r}")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids LongTensor [...] -> [..., H] through the target's input embedding (its dtype)."""
        return self._target_io[0](ids)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> base logits [..., V] through the target's LM head (its dtype)."""
        lm_head = self._target_io[1]
        return lm_head(h.to(module_dtype_device(lm_head)[0]))

    @property
    def logit_size(self) -> int:
        """V of the logits: the rows of the target's LM head."""
        return getattr(self._target_io[1], "out_features", self.config.vocab_size)

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """The tokens drafting scores (ascending int64 ids, on the CPU), or None: all of them."""
        return self._draft_vocab

    def set_draft_vocab(self, ids) -> None:
        """Draft over these token ids only (`draft_logits`); None: over the whole vocabulary.
        See dartree.drafter.vocab (`load_drafter` reads the folder's draft_vocab.json)."""
        self._draft_vocab = None if ids is None else check_ids(ids, self.logit_size)
        self._draft_head = ()

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The logits drafting ranks: h [..., H] -> [..., V], `base_logits` where no draft
        vocabulary is set; else the LM head over the draft vocabulary's rows only, every other
        token at -inf (never proposed)."""
        if self._draft_vocab is None:
            return self.base_logits(h)
        sub = self.vocab_logits(h)
        out = sub.new_full((*sub.shape[:-1], self.logit_size), float("-inf"))
        return out.index_copy_(-1, self._draft_head[2], sub)

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> [..., S]: the logits of the draft vocabulary's S tokens only, in its
        (ascending) order, through those rows of the target's LM head (training computes its
        loss on these: what drafting ranks). Needs a draft vocabulary."""
        if self._draft_vocab is None:
            raise RuntimeError("vocab_logits needs a draft vocabulary (set_draft_vocab)")
        lm_head = self._target_io[1]
        dtype, device = module_dtype_device(lm_head)
        if not self._draft_head or self._draft_head[1] != (dtype, device):  # the LM head moved
            self._draft_head = (restrict_lm_head(lm_head, self._draft_vocab),
                                (dtype, device), self._draft_vocab.to(device))
        return self._draft_head[0](h.to(dtype))

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under their checkpoint names (head keys at the top level, no input_table)."""
        return {(k[len(_HEAD_PREFIX):] if k.startswith(_HEAD_PREFIX) else k): v
                for k, v in self.state_dict().items()}

    def load_checkpoint_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Take ``weights`` under their checkpoint names (the inverse of
        :meth:`checkpoint_state_dict`), strictly, assigning the tensors as they are."""
        state = {(_HEAD_PREFIX + k if k.startswith(_HEAD_KEYS) else k): v
                 for k, v in weights.items()}
        self.load_state_dict(state, strict=True, assign=True)


def _block_pass(drafter: Drafter, features: torch.Tensor, start: int) -> torch.Tensor:
    """Drafter.draft's pass over its block (ids in drafter._block_ids) after the n = len(features)
    new context rows at positions [start, start + n): h [k, H]."""
    c = drafter._fuse(features)
    x = drafter.embed(drafter._block_ids).to(drafter.dtype)
    end = start + features.shape[0] + drafter.block_size
    cos, sin = drafter._cos[start:end], drafter._sin[start:end]
    for index, layer in enumerate(drafter.layers):
        x = layer.forward_cached(x, c, drafter.cache.tensor, index, start, cos, sin)
    return drafter._readout(x)


def _block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """bool [N, 1, A*B, L + A*B] for anchors [N, A]: a block's rows see the context keys before
    its anchor and the keys of their own block."""
    N, A = anchors.shape
    L, B, device = context_len, block_size, anchors.device
    ctx_visible = torch.arange(L, device=device)[None, None, :] < anchors[:, :, None]  # [N, A, L]
    ctx_visible = ctx_visible[:, :, None, :].expand(N, A, B, L).reshape(N, A * B, L)
    own = torch.arange(A, device=device).repeat_interleave(B)
    blk_visible = (own[:, None] == own[None, :]).expand(N, A * B, A * B)
    return torch.cat([ctx_visible, blk_visible], dim=-1)[:, None]
