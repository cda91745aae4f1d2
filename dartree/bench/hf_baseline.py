"""The external baseline: transformers' own `generate` of the same model, dtype, threads and prompts.

At temperature 0 it is `model.generate(ids, do_sample=False, max_new_tokens=N)`, the reference every
method's output must equal (in float32); above 0 it samples (`do_sample=True`, no top-k or top-p) and
is reported for tokens/s only. Its clock follows the methods' rules: decode time = time of the
N-token call - time of a 1-token call on the same prompt (prefill + first token, the part the
methods' prefill covers), per output token counting the first.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..decoding import GenerationResult

HF_METHOD = "hf-generate"


def hf_generate(model, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                eos_token_id: int | list[int] | None = None, seed: int = 0) -> list[int]:
    """transformers' generate after `ids` (batch 1): the new tokens only, EOS included.

    eos_token_id: the only stop tokens (None: none, whatever the model's generation config says);
    seed: torch's global seed for the sampling at temperature > 0.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    sample = temperature > 0
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=sample,
                              temperature=float(temperature) if sample else None,
                              top_k=0 if sample else None, top_p=1.0 if sample else None,
                              eos_token_id=eos_token_id, pad_token_id=_pad_id(eos_token_id),
                              use_cache=True)
    if sample:
        torch.manual_seed(seed)
    with torch.inference_mode(), _only_these_eos(model, eos_token_id):
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return out[0, len(ids):].tolist()


def timed_hf_generate(model, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                      eos_token_id: int | list[int] | None = None, seed: int = 0) -> GenerationResult:
    """`hf_generate`, timed: a GenerationResult whose timings hold prefill (the 1-token call) and
    decode (the N-token call minus that, never below 0); one step per token after the first, so its
    acceptance lengths are all 1, as ar's. The 1-token call is timed before and after the N-token
    one and the faster kept: one slow outlier of it would otherwise eat a short decode whole."""
    device = next(model.parameters()).device
    def first() -> float:
        return _seconds(lambda: hf_generate(model, ids, 1, temperature, eos_token_id, seed), device)[1]

    before = first()
    tokens, total = _seconds(lambda: hf_generate(model, ids, max_new_tokens, temperature, eos_token_id, seed),
                             device)
    prefill = min(before, first())
    steps = len(tokens) - 1
    return GenerationResult(tokens=tokens, acceptance_lengths=[1] * steps, speculated=[False] * steps,
                            timings=dict(prefill=prefill, decode=max(0.0, total - prefill)))


def _seconds(call, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def _pad_id(eos_token_id) -> int:
    if eos_token_id is None:
        return 0
    return eos_token_id if isinstance(eos_token_id, int) else list(eos_token_id)[0]


@contextlib.contextmanager
def _only_these_eos(model, eos_token_id):
    """generate falls back to the model's own EOS when given none: clear it for the call."""
    config = model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = eos_token_id
    try:
        yield
    finally:
        config.eos_token_id = saved
