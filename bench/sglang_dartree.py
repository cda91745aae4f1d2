"""SGLang with DARTREE against SGLang alone, on a small random Llama (a GPU machine with SGLang).

    python bench/sglang_dartree.py [--out report.md]

Saves a random-init Llama (head_dim 64) and a random dartree drafter for it in a temporary folder,
then decodes the same prompts greedily with `sglang.Engine` twice: without speculation, and with
``speculative_algorithm="DARTREE"`` (dartree.integrations.sglang). The tokens must be equal
(exit 1 when not). DARTREE reaches SGLang's processes through its plug-in entry point: when dartree
is not installed (only on PYTHONPATH), a minimal dist-info declaring that entry point is put on
PYTHONPATH for the run. Exit 3, having printed why, when SGLang or a GPU is missing: the step is
then reported as not run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

NOT_RUN = 3


def _entry_point_dist(folder: Path) -> None:
    """A dist-info on PYTHONPATH that declares dartree's SGLang entry point."""
    info = folder / "dartree_entry_points-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dartree-entry-points\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\ndartree = dartree.integrations.sglang:register\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder),
                                                             os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(folder))


def _models(folder: Path) -> tuple[Path, Path]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dartree import save_drafter
    from dartree.testing import random_drafter

    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # varied greedy paths
    target_dir, drafter_dir = folder / "target", folder / "drafter"
    target.save_pretrained(target_dir)
    save_drafter(random_drafter(target, block_size=8, target_layer_ids=[0, 2]), drafter_dir)
    return target_dir, drafter_dir


def _decode(target_dir: Path, prompts: list[list[int]], max_new_tokens: int, **spec) -> list[list[int]]:
    import sglang

    engine = sglang.Engine(model_path=str(target_dir), skip_tokenizer_init=True, dtype="float32",
                           disable_radix_cache=True, page_size=1, mem_fraction_static=0.3, **spec)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True})
        return [list(out["output_ids"]) for out in outs]
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the report (markdown) here")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    if importlib.util.find_spec("sglang") is None:
        print("sglang_dartree: SGLang is not installed: the DARTREE engine check did not run")
        return NOT_RUN
    import torch

    if not torch.cuda.is_available():
        print("sglang_dartree: no CUDA GPU (SGLang does not serve on a CPU): not run")
        return NOT_RUN
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not any(ep.value == "dartree.integrations.sglang:register"
                   for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")):
            _entry_point_dist(tmp)
        target_dir, drafter_dir = _models(tmp)
        os.environ["DARTREE_DRAFTER"] = str(drafter_dir)
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 4096, (n,), generator=generator).tolist() for n in (5, 17, 40, 9)]
        plain = _decode(target_dir, prompts, args.max_new_tokens)
        tree = _decode(target_dir, prompts, args.max_new_tokens, speculative_algorithm="DARTREE",
                       speculative_num_draft_tokens=8, disable_overlap_schedule=True)
    equal = plain == tree
    report = (f"### SGLang + DARTREE (bench/sglang_dartree.py)\n\n{len(prompts)} prompts x "
              f"{args.max_new_tokens} greedy tokens, random Llama (4 layers, hidden 256, head_dim 64),"
              f" 8-node trees: outputs {'equal' if equal else 'DIFFERENT'}\n")
    print(report)
    print("sglang_dartree " + json.dumps({"equal": equal, "requests": len(prompts)}))
    if args.out:
        Path(args.out).write_text(report)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
