"""Tiny random-config targets and drafters shared by the engine tests (the fixtures bench/ also
uses live in dartree.testing)."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from dartree.testing import OracleDrafter, random_drafter  # noqa: F401  (OracleDrafter: re-exported)


def tiny_target(kind="qwen3", dtype=torch.float32, vocab=256, layers=4, seed=0):
    """A random-init Qwen3 or Llama causal LM: hidden 64, 4 heads / 2 KV heads."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    config = (Qwen3Config(head_dim=16, **common) if kind == "qwen3" else LlamaConfig(**common))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    # larger logits than the default init: greedy paths vary instead of repeating one token
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.to(dtype).eval()


def greedy_reference(model, prompt, max_new_tokens, eos_token_id=None):
    """transformers' own greedy decoding: the new tokens only."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         pad_token_id=0, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


def make_drafter(target, domino=True, block_size=8, seed=0, **cfg):
    return random_drafter(target, num_layers=1, block_size=block_size, domino=domino, seed=seed, **cfg)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's test of counts against probs; cells with expected count < 5 pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         stat.double() / 2))
