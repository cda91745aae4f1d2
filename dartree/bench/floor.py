"""The machine's floor: how fast each stage of a round could run here, against how fast it runs.

    rates = measure_rates([torch.float32])             # copy GB/s and GEMM FLOP/s at this thread count
    stages = measure_stages(target, drafter)            # ar step, verify at each tree size, drafter pass
    for s in stages: s.floor_s(rates, dtype), s.seconds / s.floor_s(rates, dtype)

A stage's floor is max(bytes moved / copy bandwidth, FLOPs / GEMM rate): the time it would take if it
only streamed its bytes once at the measured copy rate, or only did its matrix products at the
measured large-GEMM rate. Bytes moved = weights read once (an LM head tied to the embedding counted
once; the embedding rows gathered) + KV cache read and written + logits written; activations left
out. FLOPs = 2 x rows x each linear's weight elements + the attention products (2 x 2 x Hq x rows x
keys x D per layer). Times are medians over repeats after warm-up calls; `bench/floor.py` is the
command.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from torch import nn

from ..decoding import SpeculativeDecoder
from ..gguf import PackedEmbedding, PackedLinear
from ..linear_routing import gemv_linears
from ..target import TargetModel
from .budget import measure_verify_latency
from .timing import call_seconds

TREE_SIZES = (1, 16, 32, 64, 128)

# SmolLM2-135M-Instruct (LlamaForCausalLM): the shapes the floor is measured at without its weights.
SMOLLM2_SHAPES = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)


# ------------------------------------------------------------------------------ machine rates


@dataclass
class MachineRates:
    """copy_bytes_per_s: (bytes read + bytes written) / s of a large tensor copy;
    gemm_flops_per_s: {dtype name: FLOP/s of a large square matmul}."""

    copy_bytes_per_s: float
    gemm_flops_per_s: dict[str, float]
    copy_bytes: int
    gemm_size: int


def _median_seconds(call, repeats: int, warmup: int) -> float:
    return statistics.median(call_seconds(call, repeats, warmup))


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, warmup: int = 2) -> float:
    """(bytes read + bytes written) per second of `dst.copy_(src)` over `nbytes` (CPU)."""
    if nbytes < 4:
        raise ValueError(f"nbytes must be >= 4, got {nbytes}")
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_seconds(lambda: dst.copy_(src), repeats, warmup)


def gemm_rate(dtype: torch.dtype, size: int = 2048, repeats: int = 5, warmup: int = 2) -> float:
    """FLOP/s (2 n^3 per product) of an n x n by n x n matmul in `dtype` (CPU)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    return 2 * size ** 3 / _median_seconds(lambda: torch.mm(a, b, out=out), repeats, warmup)


def measure_rates(dtypes: Sequence[torch.dtype], copy_bytes: int = 256 << 20, gemm_size: int = 2048,
                  repeats: int = 5) -> MachineRates:
    """This machine's copy bandwidth and GEMM rate per dtype at torch's current thread count."""
    return MachineRates(copy_bandwidth(copy_bytes, repeats),
                        {_name(d): gemm_rate(d, gemm_size, repeats) for d in dtypes}, copy_bytes, gemm_size)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------ stage costs


@dataclass
class StageCost:
    """One stage: measured median seconds, bytes moved, FLOPs."""

    name: str
    rows: int
    seconds: float
    bytes: int
    flops: int

    def floor_s(self, rates: MachineRates, dtype: torch.dtype | str) -> float:
        dtype = dtype if isinstance(dtype, str) else _name(dtype)
        return max(self.bytes / rates.copy_bytes_per_s, self.flops / rates.gemm_flops_per_s[dtype])

    def bound(self, rates: MachineRates, dtype: torch.dtype | str) -> str:
        """Which term sets the floor: "memory" or "compute"."""
        dtype = dtype if isinstance(dtype, str) else _name(dtype)
        return ("memory" if self.bytes / rates.copy_bytes_per_s >= self.flops / rates.gemm_flops_per_s[dtype]
                else "compute")

    def to_dict(self) -> dict:
        return asdict(self)


def _linear_weights(module: nn.Module) -> int:
    """Weight elements of every linear layer in `module`, dense or packed (each is a matmul of
    rows x in x out)."""
    return sum(_weight_elements(m) for m in module.modules() if isinstance(m, (nn.Linear, PackedLinear)))


def _weight_elements(linear: nn.Module) -> int:
    return linear.in_features * linear.out_features


def _read_tensor(linear: nn.Module) -> torch.Tensor:
    """The tensor a linear layer (or a tied head) reads: its weight, or its packed GGUF rows."""
    return linear.packed if isinstance(linear, (PackedLinear, PackedEmbedding)) else linear.weight


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for p in tensors:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def target_cost(model, rows: int, prefix_len: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one target forward over `rows` new tokens after `prefix_len` cached ones.

    model: a transformers causal LM (decoder layers at model.model.layers), its weights dense or
    packed (`dartree.load_gguf`: the packed rows are what a step reads)."""
    cfg = model.config
    layers = model.model.layers
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    lm_head, table = _read_tensor(head), _read_tensor(embed)
    esize = model.model.norm.weight.element_size()  # activations, KV cache and logits
    keys = prefix_len + rows
    layer_bytes = _bytes(t for layer in layers for t in [*layer.parameters(), *layer.buffers()])
    weights = layer_bytes + _bytes([model.model.norm.weight, lm_head])
    if table.data_ptr() != lm_head.data_ptr():
        weights += rows * table[0].numel() * table.element_size()  # only the gathered rows
    kv = len(layers) * 2 * kv_heads * head_dim * esize * (keys + rows)  # read keys rows, write rows
    logits = rows * head.out_features * esize
    flops = 2 * rows * (_linear_weights(layers) + _weight_elements(head))
    flops += len(layers) * 4 * heads * rows * keys * head_dim
    return weights + kv + logits, flops


def drafter_cost(drafter, context_rows: int, position: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one drafter pass with base logits: `context_rows` new target features,
    the block of B tokens at `position` (attending to position + B keys), k slots through the LM head.
    The Domino head is not part of the pass (the tree builders use it)."""
    cfg = drafter.config
    block, slots = drafter.block_size, drafter.num_slots
    head = drafter._target_io[1]
    lm_head = _read_tensor(head)
    own = [p for name, p in drafter.named_parameters() if not name.startswith("head.")]
    esize = drafter.fc.weight.element_size()
    keys = position + block
    weights = _bytes(own + [lm_head])
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * esize * (keys + context_rows + block)
    logits = slots * head.out_features * esize
    flops = 2 * context_rows * _linear_weights(drafter.fc)
    for layer in drafter.layers:
        attn = layer.self_attn
        kv_weights = attn.k_proj.weight.numel() + attn.v_proj.weight.numel()
        flops += 2 * block * (_linear_weights(layer) - kv_weights) + 2 * (context_rows + block) * kv_weights
        flops += 4 * cfg.num_heads * block * keys * cfg.head_dim
    flops += 2 * slots * _weight_elements(head)
    return weights + kv + logits, flops


# ------------------------------------------------------------------------------ stage times


@torch.inference_mode()
def time_ar_step(model, prefix_len: int, steps: int = 32, repeats: int = 5, warmup: int = 1,
                 seed: int = 0, exact: bool = False) -> float:
    """Median over `repeats` generate calls (method ar, `steps` rounds after a random prompt of
    `prefix_len` tokens) of decode seconds per round: the whole engine step (exact: on the
    batch-invariant kernels)."""
    dec = SpeculativeDecoder(model, method="ar", exact=exact)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().out_features
    prompt = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
    per_round = []
    for rep in range(warmup + repeats):
        res = dec.generate(prompt, max_new_tokens=steps + 1)
        if rep >= warmup:
            per_round.append(res.timings["decode"] / len(res.acceptance_lengths))
    return statistics.median(per_round)


@torch.inference_mode()
def time_drafter_pass(drafter, feature_dim: int, prefix_len: int, context_rows: int = 4, repeats: int = 5,
                      warmup: int = 2, seed: int = 0) -> float:
    """Median seconds of `drafter.draft` + `drafter.draft_logits` (the GEMV routing on, as in the
    engine) with `context_rows` new feature rows per pass, after a context of `prefix_len`
    positions; each pass moves the block on by `context_rows` positions, as rounds do."""
    gen = torch.Generator().manual_seed(seed)
    passes = warmup + repeats
    drafter.reset(prefix_len + (passes + 1) * context_rows + drafter.block_size)
    features = torch.randn(prefix_len + passes * context_rows, feature_dim, generator=gen).to(
        device=drafter.device, dtype=drafter.dtype)
    bonus = torch.zeros(1, dtype=torch.long, device=drafter.device)
    drafter.draft(features[:prefix_len], bonus, prefix_len)
    times = []
    for i in range(passes):
        s = prefix_len + (i + 1) * context_rows
        start = time.perf_counter()
        with gemv_linears(drafter.dtype, drafter.device):  # as the engine's draft stage runs it
            drafter.draft_logits(drafter.draft(features[s - context_rows:s], bonus, s))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_llamacpp_step(gguf_path, vocab: int, prefix_len: int, threads: int, steps: int = 32, repeats: int = 5,
                       seed: int = 0) -> float:
    """Median over `repeats` llama.cpp calls (greedy, `steps` new tokens after the same kind of random
    prompt as time_ar_step's, one child process each: dartree.bench.llamacpp_baseline) of its own
    decode time per token after the first. No warm-up call: each call is a fresh process anyway,
    and the file is in the page cache from the first on (the median leaves that one out)."""
    from .llamacpp_baseline import LlamaCpp

    llama = LlamaCpp(gguf_path, threads=threads, context=prefix_len + steps + 16)
    prompt = torch.randint(0, vocab, (prefix_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    per_token = []
    for _ in range(repeats):
        res = llama.generate(prompt, max_new_tokens=steps + 1)
        per_token.append(res.timings["decode"] / max(len(res.tokens) - 1, 1))
    return statistics.median(per_token)


def measure_stages(model, drafter, prefix_len: int = 256, tree_sizes: Sequence[int] = TREE_SIZES,
                   context_rows: int = 4, repeats: int = 5, ar_steps: int = 32,
                   exact: bool = False, llamacpp: str | None = None) -> list[StageCost]:
    """Time and cost every stage: the ar step (and llama.cpp's on `llamacpp`, the model's GGUF
    file), the verify at each tree size, the drafter pass.

    model: a transformers causal LM on the CPU; drafter: a Drafter for it (its target layers are
    captured in the verify, as in a real round), or None (no drafter pass); exact: the target's
    stages on the batch-invariant kernels (`SpeculativeDecoder(exact=True)`)."""
    if isinstance(model, TargetModel):
        model = model.model
    stages = []
    ar_s = time_ar_step(model, prefix_len, steps=ar_steps, repeats=repeats, exact=exact)
    ar_cost = target_cost(model, 1, prefix_len + ar_steps // 2)
    stages.append(StageCost("ar step", 1, ar_s, *ar_cost))
    if llamacpp is not None:
        vocab = model.get_output_embeddings().out_features
        stages.append(StageCost("llama.cpp step", 1, time_llamacpp_step(
            llamacpp, vocab, prefix_len, torch.get_num_threads(), steps=ar_steps, repeats=repeats), *ar_cost))
    layers = drafter.target_layer_ids if drafter is not None else ()
    profile = measure_verify_latency(model, sizes=tree_sizes, prefix_len=prefix_len, repeats=repeats,
                                     warmup=2, feature_layers=layers, exact=exact)
    for size, seconds in zip(profile.sizes, profile.seconds):
        stages.append(StageCost(f"verify {size}", size, seconds, *target_cost(model, size, profile.prefix_len)))
    if drafter is None:
        return stages
    feature_dim = len(drafter.target_layer_ids) * model.config.hidden_size
    warmup = 2
    draft_s = time_drafter_pass(drafter, feature_dim, prefix_len, context_rows, repeats, warmup)
    # the timed passes sit at positions prefix_len + context_rows * (warmup + 1 .. warmup + repeats)
    position = prefix_len + context_rows * (warmup + 1 + repeats // 2)
    stages.append(StageCost("drafter pass", drafter.num_slots, draft_s,
                            *drafter_cost(drafter, context_rows, position)))
    return stages


# ------------------------------------------------------------------------------ report


def format_floor_table(stages: Sequence[StageCost], rates: MachineRates, dtype: torch.dtype | str) -> str:
    """Markdown: one row per stage with measured time, bytes, FLOPs, floor, its bound and the ratio."""
    dtype = dtype if isinstance(dtype, str) else _name(dtype)
    lines = ["| stage | rows | measured ms | MB moved | GFLOP | floor ms | bound | measured / floor |",
             "|---|---|---|---|---|---|---|---|"]
    for s in stages:
        floor = s.floor_s(rates, dtype)
        lines.append(f"| {s.name} | {s.rows} | {1e3 * s.seconds:.2f} | {s.bytes / 1e6:.1f} | {s.flops / 1e9:.3f} "
                     f"| {1e3 * floor:.2f} | {s.bound(rates, dtype)} | **{s.seconds / floor:.2f}×** |")
    return "\n".join(lines) + "\n"
