"""Fixtures shared by tests/ and bench/: randomly initialised drafters, a drafter that knows
the target's continuation, random GGUF blocks and small random GGUF files (`write_gguf`). Not used
by the engine itself."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import gguf_blocks
from .drafter import Drafter, config_for_target, target_io
from .drafter.config import module_dtype_device

# Byte offsets of each block type's float16 fields (scales, minimums): random_packed sets them to
# finite halves, as a random bit pattern there may be a NaN, whose payload no comparison defines.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def rerun_capped(test_file: str, selection: str, isa: str) -> None:
    """Run the tests of `test_file` chosen by `selection` (pytest -k) in a fresh process whose exact
    kernels are capped at `isa` (DARTREE_EXACT_ISA: the choice is made once per process), so a CPU
    checks the narrower paths it would not pick; they must pass (skips alone do not count)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dartree, installed or built in place
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, DARTREE_EXACT_ISA=isa, OMP_NUM_THREADS="2", PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file),
                           "-k", selection], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


def random_packed(qtype: str, N: int, K: int, seed: int) -> torch.Tensor:
    """uint8 [N, gguf_blocks.row_bytes(qtype, K)]: N rows of random `qtype` blocks, their quant
    bytes uniform, their float16 fields ~ N(0, 0.02²) (typical GGUF scales)."""
    t = gguf_blocks.block_type(qtype)
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, gguf_blocks.row_bytes(qtype, K)), generator=g,
                           dtype=torch.uint8)
    blocks = packed.view(-1, t.type_size)
    for offset in F16_FIELDS[t.name]:
        half = (torch.randn(blocks.shape[0], generator=g) * 0.02).to(torch.float16)
        blocks[:, offset:offset + 2] = half.view(torch.uint8).reshape(-1, 2)
    return packed


def random_drafter(target: Any, num_layers: int = 1, block_size: int = 16, domino: bool = True,
                   seed: int = 0, **cfg: Any) -> Drafter:
    """A randomly initialised drafter shaped for ``target`` (tests, benchmarks).

    Shape as :func:`dartree.drafter.config_for_target` gives it (``cfg`` overrides any
    DrafterConfig field); linear/GRU weights ~ N(0, 0.02²), norms 1, biases 0. On the target's
    device in its dtype, eval mode.
    """
    config = config_for_target(target, num_layers=num_layers, block_size=block_size,
                               domino=domino, **cfg)
    embed = target_io(target)[0]
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        drafter = Drafter(config, target)
    for name, param in drafter.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif name.endswith("weight") or "weight_" in name:
            nn.init.normal_(param, std=0.02, generator=generator)
        else:
            nn.init.zeros_(param)
    dtype, device = module_dtype_device(embed)
    drafter.to(device=device, dtype=dtype)
    drafter.refresh_input_table()
    return drafter.eval()


class OracleDrafter:
    """Wraps a drafter so its base logits rank the target's greedy continuation first.

    `continuation` is the target's greedy output after `prompt`; at position s the slot for depth d
    favours continuation token s + d (when known). The Domino head's W_2 is zeroed, so the
    correction is 0 and every method proposes the greedy branch: rounds accept whole branches.
    """

    def __init__(self, drafter: Drafter, prompt: list[int], continuation: list[int],
                 margin: float = 20.0):
        self.inner = drafter
        self.sequence = list(prompt) + list(continuation)
        self.margin = margin
        if drafter.head is not None:
            with torch.no_grad():
                drafter.head.W_2.zero_()
                if drafter.head.b_2 is not None:
                    drafter.head.b_2.zero_()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def draft(self, features: torch.Tensor, bonus: int | torch.Tensor, s: int,
              **kw: Any) -> torch.Tensor:
        self._position = s
        return self.inner.draft(features, bonus, s, **kw)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:  # the whole vocabulary: no draft one
        return self.base_logits(h)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.inner.base_logits(h).clone()
        for slot in range(logits.shape[0]):  # row i predicts the token at position s + 1 + i
            pos = self._position + 1 + slot
            if pos < len(self.sequence):
                logits[slot, self.sequence[pos]] = logits[slot].max() + self.margin
        return logits


# ----------------------------------------------------------------------------- small GGUF files

# A small transformer's shape for GGUF test files (head size 64; Qwen3 files use 128, the config
# default transformers applies to them)
GGUF_SHAPE = dict(hidden=256, ffn=96, heads=4, kv_heads=2, vocab=320, layers=2)
# llama.cpp's Q4_K_M: Q4_K, with Q6_K for attn_v, ffn_down and the output; a width that is not a
# multiple of 256 falls back to a 32-value type (ffn_down with K = 96: Q5_0, Q8_0 for Qwen2)
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q4_K",
          "output": "Q6_K"}
# chat templates written into the files: ChatML (Qwen2/Qwen3) and Llama 3's
CHAT_TEMPLATES = {
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
               "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "llama3": ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
               "'<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>"
               "\\n\\n' }}{% endif %}"),
}
_SPECIALS = {"chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"]}
_BPE_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
             "fibonacci(n - 2)\n\nThe quick brown fox jumps over the lazy dog. What is the "
             "capital of France? The capital of France is Paris.\n")


def gguf_head_dim(arch: str, shape: dict = GGUF_SHAPE) -> int:
    """Head size of `write_gguf`'s files: transformers reads none from a Qwen3 file and applies
    its config default, 128."""
    return 128 if arch == "qwen3" else shape["hidden"] // shape["heads"]


def gguf_block_types(arch: str, shape: dict = GGUF_SHAPE) -> dict[str, str]:
    """`write_gguf`'s block type per tensor kind: Q4_K_M, with ffn_down in a 32-value type when
    its width is not a multiple of 256 (as llama.cpp does)."""
    types = dict(Q4_K_M)
    if shape["ffn"] % 256:
        types["ffn_down"] = "Q8_0" if arch == "qwen2" else "Q5_0"
    return types


def _byte_level_vocab(size: int, specials: list[str]) -> tuple[list[str], list[str]]:
    """A GPT-2 byte-level BPE vocabulary of `size` tokens: the 256 byte symbols, merges learned
    greedily from a short text, then the special tokens (last)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbol = bytes_to_unicode()
    tokens = [symbol[b] for b in range(256)]
    words = [[symbol[b] for b in (" " + w).encode()] for w in _BPE_TEXT.split(" ")]
    merges = []
    while len(tokens) + len(specials) < size:
        pairs: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in zip(w, w[1:]):
                pairs[pair] = pairs.get(pair, 0) + 1
        a, b = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        for i, w in enumerate(words):
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == (a, b):
                    out.append(a + b)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
    return tokens + specials, merges


def write_gguf(path, arch: str, seed: int = 0, tied: bool = False, uniform: bool = False,
               shape: dict | None = None, tokenizer: bool = False) -> None:
    """A random GGUF file of a small Llama, Qwen2 or Qwen3 (`GGUF_SHAPE`, or `shape`), its
    weights random blocks of `gguf_block_types` (uniform: every projection Q4_K, so q/k/v and
    gate/up share one packed call), norms F32 around 1 (and Qwen2's q/k/v biases).

    tokenizer: also a byte-level BPE tokenizer in the metadata (its merges learned from a short
    text, the special tokens last) with a chat template: ChatML for Qwen, Llama 3's for Llama."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType

    s = dict(GGUF_SHAPE, **(shape or {}))
    w = GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s["vocab"])
    D = gguf_head_dim(arch, s)
    w.add_key_length(D)
    w.add_value_length(D)
    if arch == "llama":
        w.add_rope_dimension_count(D)
    if tokenizer:
        style = "llama3" if arch == "llama" else "chatml"
        specials = _SPECIALS[style]
        tokens, merges = _byte_level_vocab(s["vocab"], specials)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
        w.add_token_list(tokens)
        w.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index(specials[0]))
        w.add_eos_token_id(tokens.index(specials[-1]))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATES[style])
    types = gguf_block_types(arch, s)
    if uniform:
        types.update(attn_v="Q4_K", ffn_up="Q4_K")
    rng = np.random.default_rng(seed)
    counter = [seed]

    def quant(name, kind, N, K):
        counter[0] += 1
        rows = random_packed(types[kind], N, K, seed=counter[0]).numpy()
        w.add_tensor(name, rows, raw_dtype=GGMLQuantizationType[types[kind]])

    def f32(name, *dims, center=0.0):
        w.add_tensor(name, (center + 0.1 * rng.standard_normal(dims)).astype(np.float32))

    H, F = s["hidden"], s["ffn"]
    quant("token_embd.weight", "token_embd", s["vocab"], H)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        quant(b + "attn_q.weight", "attn_q", s["heads"] * D, H)
        quant(b + "attn_k.weight", "attn_k", s["kv_heads"] * D, H)
        quant(b + "attn_v.weight", "attn_v", s["kv_heads"] * D, H)
        quant(b + "attn_output.weight", "attn_output", H, s["heads"] * D)
        quant(b + "ffn_gate.weight", "ffn_gate", F, H)
        quant(b + "ffn_up.weight", "ffn_up", F, H)
        quant(b + "ffn_down.weight", "ffn_down", H, F)
        f32(b + "attn_norm.weight", H, center=1.0)
        f32(b + "ffn_norm.weight", H, center=1.0)
        if arch == "qwen3":
            f32(b + "attn_q_norm.weight", D, center=1.0)
            f32(b + "attn_k_norm.weight", D, center=1.0)
        if arch == "qwen2":
            f32(b + "attn_q.bias", s["heads"] * D)
            f32(b + "attn_k.bias", s["kv_heads"] * D)
            f32(b + "attn_v.bias", s["kv_heads"] * D)
    f32("output_norm.weight", H, center=1.0)
    if not tied:
        quant("output.weight", "output", s["vocab"], H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
