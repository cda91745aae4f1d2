"""Greedy answers for many prompts at once: continuous batching over a static KV cache.

`greedy_answers` answers every prompt of a list with the target's greedy decoding, `slots` of them
at a time. Each step decodes one token for every slot in one batched forward; a slot whose answer
ends (EOS, `max_new_tokens`, or a full cache row) is refilled at once with the next prompt, so no
row keeps generating after its end and no row is padded on the left (HF `generate` on a batch
does both). Refills due in the same step are prefilled together: their tokens go through the
linear layers as one packed sequence, attention runs per prompt (causal, over its own tokens).
Once no prompt is left, the answers still running move to the first slots whenever half the
slots are idle, so the last steps decode only them.

The forward walks a Llama-family model's own modules and weights (embedding, RMSNorms, rotary
table, projections, LM head) with q/k/v and gate/up fused into one matrix each, as
`dartree.decoder_stack` does for batch 1. The cache is [slots, Hkv, max_len, D] per layer; a
decode step writes row `length[b]` of each slot and attends over rows `0 .. length[b]` by a
boolean mask, over the first `max(length) + 1` rows only. The q heads that share a kv head
attend as that head's query rows (GQA without copying K/V).

Example::

    model, tok = dartree.defaults.load_smollm2(device="cpu", dtype=torch.bfloat16)
    for index, answer in greedy_answers(model, prompt_ids, max_new_tokens=128,
                                        eos_token_id=tok.eos_token_id, slots=96):
        ...  # answer: list[int], ends with the EOS token when the target stopped by itself

tests/test_answers.py checks every answer against HF `generate(do_sample=False)` of the prompt
alone; bench/answer_throughput.py times it against the batched HF path.
"""

from __future__ import annotations

import dataclasses
import collections
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclasses.dataclass
class _Layer:
    norm1: nn.Module
    qkv: torch.Tensor            # [Hq*D + 2*Hkv*D, H]: q, k, v rows stacked
    qkv_bias: torch.Tensor | None
    q_norm: nn.Module | None     # Qwen3: RMSNorm over each head before RoPE
    k_norm: nn.Module | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm2: nn.Module
    gate_up: torch.Tensor        # [2*I, H]: gate rows, then up rows
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    act: nn.Module


def _check_model(model: nn.Module) -> None:
    name = type(model).__name__
    if name not in ARCHITECTURES:
        raise ValueError(f"model must be one of transformers' {', '.join(ARCHITECTURES)}, "
                         f"got {type(model).__module__}.{name}")
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(f"sliding-window attention is not supported (window "
                         f"{config.sliding_window})")
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if "dynamic" in rope or "longrope" in rope:
        raise ValueError(f"RoPE type {rope!r} changes with the sequence length; not supported")
    for i, layer in enumerate(model.model.layers):
        for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for proj in names:
                module = getattr(getattr(layer, block), proj, None)
                if type(module) is not nn.Linear:
                    raise ValueError(f"layer {i} {block}.{proj} must be an nn.Linear, got "
                                     f"{type(module).__name__}")
    if type(model.get_output_embeddings()) is not nn.Linear:
        raise ValueError("the model's output embedding must be an nn.Linear")


def _cat_bias(modules: list[nn.Linear]) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else m.weight.new_zeros(m.out_features)
                      for b, m in zip(biases, modules)])


class _Stack:
    """The model's weights laid out for batched decoding, and its static KV cache."""

    def __init__(self, model: nn.Module, slots: int, max_len: int):
        _check_model(model)
        body, config = model.model, model.config
        first = body.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scaling = first.scaling
        self.embed, self.norm, self.lm_head = body.embed_tokens, body.norm, model.lm_head
        self.layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
            self.layers.append(_Layer(
                layer.input_layernorm, torch.cat([m.weight for m in qkv]), _cat_bias(qkv),
                getattr(attn, "q_norm", None), getattr(attn, "k_norm", None),
                attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm,
                torch.cat([m.weight for m in gate_up]), _cat_bias(gate_up),
                mlp.down_proj.weight, mlp.down_proj.bias, mlp.act_fn))
        weight = self.embed.weight
        # the rotary table of every position: the outer product positions x inv_freq has one
        # term per element, so its rows equal what the rotary module computes per call
        positions = torch.arange(max_len, device=weight.device)[None]
        cos, sin = body.rotary_emb(weight[:1][None], positions)
        self.cos, self.sin = cos[0], sin[0]                        # [max_len, D]
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        self.k = [weight.new_zeros(shape) for _ in self.layers]
        self.v = [weight.new_zeros(shape) for _ in self.layers]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] at positions [N]: transformers' apply_rotary_pos_emb."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer: _Layer, h: torch.Tensor, positions: torch.Tensor):
        """h [N, H] -> q [N, Hq, D], k and v [N, Hkv, D], RoPE applied."""
        d = self.head_dim
        q, k, v = F.linear(h, layer.qkv, layer.qkv_bias).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(-1, self.heads, d), k.view(-1, self.kv_heads, d), v.view(-1, self.kv_heads, d)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        return self._rope(q, positions), self._rope(k, positions), v

    def _finish(self, layer: _Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + F.linear(attended, layer.o, layer.o_bias)
        gate, up = F.linear(layer.norm2(x), layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
        return x + F.linear(layer.act(gate) * up, layer.down, layer.down_bias)

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Write the K/V of each prompt into cache rows [0, len) of its slot.

        prompts: token ids, packed into one sequence for the linear layers; slots: one each.
        Returns the greedy next token of each prompt, int64 [len(prompts)]."""
        device = self.embed.weight.device
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        x = self.embed(ids)                                                   # [T, H]
        g = self.heads // self.kv_heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.norm1(x), positions)
            outs = []
            for slot, qs, ks, vs in zip(slots, q.split(lengths), k.split(lengths), v.split(lengths)):
                n = qs.shape[0]
                ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)                 # [Hkv, n, D]
                self.k[i][slot, :, :n] = ks
                self.v[i][slot, :, :n] = vs
                if g > 1:
                    ks, vs = ks.repeat_interleave(g, dim=0), vs.repeat_interleave(g, dim=0)
                out = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks[None], vs[None],
                                                     is_causal=True, scale=self.scaling)
                outs.append(out[0].transpose(0, 1).reshape(n, -1))
            x = self._finish(layer, x, torch.cat(outs))
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        return self.lm_head(self.norm(x[last])).float().argmax(-1)

    def move(self, source: list[int], target: list[int], rows: int) -> None:
        """Copy the first `rows` cache rows of slots `source` into slots `target`."""
        for k, v in zip(self.k, self.v):
            k[target, :, :rows] = k[source, :, :rows]
            v[target, :, :rows] = v[source, :, :rows]

    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One token for each of the first B slots: tokens int64 [B] at positions lengths [B]
        (each slot's cache holds rows 0 .. length-1). Writes row `length` and returns the greedy
        next tokens [B]."""
        slots = tokens.shape[0]
        span = int(lengths.max()) + 1
        rows = torch.arange(slots, device=tokens.device)
        # [B, 1, 1, span]: slot b sees rows 0 .. length[b]
        mask = (torch.arange(span, device=tokens.device) <= lengths[:, None])[:, None, None]
        g, d = self.heads // self.kv_heads, self.head_dim
        x = self.embed(tokens)                                                # [B, H]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.norm1(x), lengths)
            self.k[i][rows, :, lengths] = k
            self.v[i][rows, :, lengths] = v
            # the g query heads of kv head j are heads j*g .. j*g+g-1 (transformers' repeat_kv):
            # as query rows of that head they read its K/V once
            out = F.scaled_dot_product_attention(
                q.view(slots, self.kv_heads, g, d), self.k[i][:slots, :, :span], self.v[i][:slots, :, :span],
                attn_mask=mask, scale=self.scaling)
            x = self._finish(layer, x, out.reshape(slots, -1))
        # float: the same argmax (exact conversion, first index on ties), 3x faster than bf16's
        return self.lm_head(self.norm(x)).float().argmax(-1)


@torch.no_grad()
def greedy_answers(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   eos_token_id: int | None, slots: int = 64, max_len: int | None = None,
                   prefill_tokens: int = 4096) -> Iterator[tuple[int, list[int]]]:
    """Yield (index, answer) for every prompt, in the order the answers end.

    model:          a transformers Llama, Mistral (no sliding window), Qwen2 or Qwen3 causal LM,
                    in the dtype and on the device to run in
    prompts:        token ids of each prompt (non-empty)
    max_new_tokens: the most tokens an answer gets
    eos_token_id:   an answer stops after this token (kept as its last token); None: never
    slots:          prompts decoded at once (the batch of every step)
    max_len:        cache rows per slot (default: longest prompt + max_new_tokens); an answer
                    that would outgrow its row stops there
    prefill_tokens: refills due at once are prefilled together, up to this many prompt tokens
                    a call (a longer prompt goes alone)

    Each answer equals the model's greedy decoding of the prompt alone, up to the rounding of a
    batched product (the same bits in exact arithmetic; tests/test_answers.py)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    vocab = model.config.vocab_size
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {vocab})")
    if not prompts:
        return
    longest = max(len(p) for p in prompts)
    max_len = max_len or longest + max_new_tokens
    if longest >= max_len:
        raise ValueError(f"max_len must exceed the longest prompt ({longest} tokens), got {max_len}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max_len > limit:
        raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings {limit}")
    slots = min(slots, len(prompts))
    stack = _Stack(model, slots, max_len)
    device = stack.embed.weight.device

    lengths = torch.zeros(slots, dtype=torch.long, device=device)   # cache rows filled per slot
    tokens = torch.zeros(slots, dtype=torch.long, device=device)    # last token, not yet cached
    owner: list[int | None] = [None] * slots                         # prompt index per slot
    answers: list[list[int]] = [[] for _ in range(slots)]
    pending = collections.deque(range(len(prompts)))

    def ended(slot: int) -> bool:
        answer = answers[slot]
        return (answer[-1] == eos_token_id or len(answer) == max_new_tokens
                or int(lengths[slot]) >= max_len)  # no row left for its last token

    free = list(range(slots))
    while True:
        # refill every free slot; a prompt whose answer ends at its first token frees it again
        while free:
            picks, packed = [], 0
            for slot in free:  # up to `prefill_tokens` tokens per packed prefill (at least one)
                if not pending or (picks and packed + len(prompts[pending[0]]) > prefill_tokens):
                    break
                index = pending.popleft()
                picks.append((slot, index))
                packed += len(prompts[index])
            if not picks:
                break
            free = free[len(picks):]
            first = stack.prefill([list(prompts[i]) for _, i in picks], [s for s, _ in picks])
            for (slot, index), token in zip(picks, first.tolist()):
                owner[slot], answers[slot] = index, [token]
                lengths[slot], tokens[slot] = len(prompts[index]), token
                if ended(slot):
                    yield index, answers[slot]
                    owner[slot] = None
                    free.append(slot)
        active = [slot for slot, o in enumerate(owner) if o is not None]
        if not active:
            return
        if not pending and len(active) <= len(owner) // 2:
            # the tail: no prompt is left to refill a slot, so the answers still running move to
            # the first slots and a step decodes only them (at most log2(slots) moves)
            stack.move(active, list(range(len(active))), int(lengths[active].max()))
            owner, answers = [owner[s] for s in active], [answers[s] for s in active]
            lengths, tokens, free = lengths[active], tokens[active], []
        idle = torch.tensor([o is None for o in owner], device=device)
        lengths.masked_fill_(idle, 0)  # an idle slot decodes a dummy row 0, overwritten on refill
        new = stack.decode(tokens, lengths)
        lengths += 1
        tokens = new
        for slot, token in enumerate(new.tolist()):
            if owner[slot] is None:
                continue
            answers[slot].append(token)
            if ended(slot):
                yield owner[slot], answers[slot]
                owner[slot] = None
                free.append(slot)
