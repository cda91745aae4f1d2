#!/usr/bin/env python3
"""The floor, measured: each stage of a round against what this machine could do at best.

    python bench/floor.py --threads 2                          # float32 and bfloat16, SmolLM2 shapes
    python bench/floor.py --threads 2 --dtypes bfloat16 --target DIR --out bench/results/floor.md
    python bench/floor.py --threads 2 --dtypes float32 --packed   # the GGUF file, weights packed
    python bench/floor.py --threads 2 --model coder --exact --sizes 1,2,4,8,16,32,64

Measures this machine's copy bandwidth (a large tensor copy) and matrix rate (a large square GEMM,
per dtype) at the given thread count, then for the target times the `ar` step (a whole engine step),
the verify at each tree size (--sizes: 1, 16, 32, 64, 128 rows by default) and the drafter pass (draft + base logits for
every slot), and reports each against its floor = max(bytes moved / bandwidth, FLOPs / rate)
(dartree/bench/floor.py says what is counted). Target: --target DIR, else `dartree.default_models()`
when it is SmolLM2-135M-Instruct, else a random-init Llama of SmolLM2-135M's shapes (timings do not
depend on the weights); --packed: SmolLM2's GGUF file read packed, whose bytes per step are its
packed rows; --model coder: Qwen2.5-Coder-1.5B-Instruct from its GGUF file, packed (no drafter, no
drafter pass). Drafter: the default drafter with that target, else a random one (1 layer,
block 16). With a GGUF file (--packed, --model coder) and xllamacpp installed, llama.cpp's step on
the same file, threads and kind of prompt sits beside `ar` (--llamacpp off: not). Writes the
Markdown table to --out and the numbers beside it as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

from dartree.bench.floor import (SMOLLM2_SHAPES, TREE_SIZES, format_floor_table, measure_rates,
                                 measure_stages)
from dartree.bench.machine import machine_info
from dartree.testing import random_drafter

log = logging.getLogger("floor")


def _is_smollm2(model) -> bool:
    cfg = model.config
    return all(getattr(cfg, key, None) == value for key, value in SMOLLM2_SHAPES.items())


def load_models(target_dir: str | None, dtype: torch.dtype, packed: bool = False, model: str = "smollm2"):
    """(target, drafter, description of both) on the CPU in `dtype` (packed: SmolLM2's GGUF file
    with its weights packed, `dtype` that of the activations; model "coder": Qwen2.5-Coder-1.5B
    packed, drafter None)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if model == "coder":
        from dartree import default_models

        target, _, _ = default_models("coder", device="cpu", dtype=dtype)
        return target, None, "Qwen2.5-Coder-1.5B-Instruct, its GGUF file packed (dartree.default_models('coder'))"
    drafter = None
    if target_dir:
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
        what = f"{target_dir}"
    else:
        try:
            from dartree import default_models

            target, drafter, _ = default_models(device="cpu", dtype=dtype, packed=packed)
            reason = None if _is_smollm2(target) else "dartree.default_models() is not SmolLM2-135M here"
        except Exception as exc:  # a missing package or cache: fall back to the shapes alone
            if packed:
                raise
            reason = f"dartree.default_models() failed: {exc}"
        if reason is None:
            what = ("SmolLM2-135M-Instruct, its GGUF file packed (dartree.default_models(packed=True))"
                    if packed else "SmolLM2-135M-Instruct (dartree.default_models())")
        else:
            torch.manual_seed(0)
            config = LlamaConfig(**SMOLLM2_SHAPES, max_position_embeddings=8192, rms_norm_eps=1e-5)
            target = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
            drafter = None
            what = f"random-init Llama with SmolLM2-135M's shapes ({reason})"
    if drafter is None:
        drafter = random_drafter(target, block_size=16)
        what += "; random drafter (1 layer, block 16)"
    else:
        what += f"; drafter {getattr(drafter, 'path', None) or 'from default_models()'}"
    return target, drafter, what


def _llamacpp_file(args) -> str | None:
    """The GGUF file whose llama.cpp step sits beside ar, or None."""
    from dartree import defaults
    from dartree.bench import llamacpp_baseline

    if args.llamacpp == "off" or not llamacpp_baseline.available():
        return None
    if args.model == "coder":
        return str(defaults.coder_folder() / defaults.CODER_GGUF)
    return str(defaults.smollm2_gguf()) if args.packed else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma list of float32, bfloat16, float16")
    parser.add_argument("--target", default=None, help="a transformers model folder")
    parser.add_argument("--exact", action="store_true",
                        help="the target's stages on the batch-invariant kernels (exact=True)")
    parser.add_argument("--packed", action="store_true",
                        help="SmolLM2's GGUF file with its weights packed (bytes: the packed rows)")
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "coder"],
                        help="coder: Qwen2.5-Coder-1.5B-Instruct packed (bash scripts/install.sh --coder)")
    parser.add_argument("--llamacpp", default="auto", choices=["auto", "off"],
                        help="llama.cpp's step on the same GGUF file beside ar (auto: with a GGUF target "
                             "and xllamacpp installed)")
    parser.add_argument("--sizes", default=",".join(map(str, TREE_SIZES)),
                        help="rows of the timed verifies, a comma list (e.g. 1,2,4,8,16,32,64)")
    parser.add_argument("--prefix", type=int, default=256, help="cached context before each timed stage")
    parser.add_argument("--context-rows", type=int, default=4, help="new target features per drafter pass")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per stage (the median is kept)")
    parser.add_argument("--ar-steps", type=int, default=16, help="rounds of each timed ar generate call")
    parser.add_argument("--out", default="bench/results/floor.md")
    args = parser.parse_args(argv)
    if args.packed and args.target:
        parser.error("--packed loads SmolLM2's GGUF file: give it without --target")
    if args.model == "coder" and args.target:
        parser.error("--model coder loads the coder's GGUF file: give it without --target")
    gguf = _llamacpp_file(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    try:
        sizes = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
    except ValueError:
        parser.error(f"--sizes must be a comma list of row counts, got {args.sizes!r}")
    if not sizes or sizes[0] < 1:
        parser.error(f"--sizes must hold row counts >= 1, got {args.sizes!r}")
    log.info("measuring copy bandwidth and GEMM rates (%d threads)", torch.get_num_threads())
    rates = measure_rates(dtypes)
    machine = machine_info(torch.device("cpu"), dtypes[0])
    isa = os.environ.get("DARTREE_EXACT_ISA")  # the exact kernels capped (an AVX2 laptop's paths, say)
    cap = f"DARTREE_EXACT_ISA={isa} " if isa else ""
    lines = ["# The floor: each stage of a round against this machine's copy and GEMM rates", "",
             f"Machine: {machine['cpu']} ({machine['torch_threads']} threads), torch {machine['torch']}, "
             f"transformers {machine.get('transformers')}; load average {machine.get('load_average')}",
             f"Command: `{cap}python bench/floor.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"Copy bandwidth: **{rates.copy_bytes_per_s / 1e9:.1f} GB/s** (bytes read + written per second "
             f"of a {rates.copy_bytes >> 20} MiB float32 copy)  ",
             "GEMM rate: " + ", ".join(f"**{r / 1e9:.0f} GFLOP/s** {d}" for d, r in rates.gemm_flops_per_s.items())
             + f" ({rates.gemm_size}² x {rates.gemm_size}² matmul)"]
    results = dict(machine=machine, rates=dict(copy_bytes_per_s=rates.copy_bytes_per_s,
                                               gemm_flops_per_s=rates.gemm_flops_per_s),
                   settings=vars(args), tables={})
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        log.info("%s: loading the models", name)
        target, drafter, what = load_models(args.target, dtype, args.packed, args.model)
        log.info("%s: timing the stages", name)
        stages = measure_stages(target, drafter, prefix_len=args.prefix, tree_sizes=sizes,
                                context_rows=args.context_rows, repeats=args.repeats, ar_steps=args.ar_steps,
                                exact=args.exact, llamacpp=gguf)
        drafter_pass = ("no drafter" if drafter is None else f"drafter pass with {args.context_rows} new feature "
                        f"rows, base logits for {drafter.num_slots} slots")
        lines += ["", f"## {name}", "", f"Target: {what}; prefix {args.prefix} tokens; {drafter_pass}", "",
                  format_floor_table(stages, rates, dtype).rstrip("\n")]
        times = {s.name: s.seconds for s in stages}
        if "llama.cpp step" in times:
            lines += ["", f"dartree's `ar` runs at **{times['llama.cpp step'] / times['ar step']:.2f}×** llama.cpp's "
                      "speed on this file (its step time / `ar`'s)."]
        results["tables"][name] = dict(models=what, stages=[dict(s.to_dict(), floor_s=s.floor_s(rates, dtype))
                                                            for s in stages])
        del target, drafter
    lines += ["", "Floor = max(bytes moved / copy bandwidth, FLOPs / GEMM rate). Bytes moved: weights read "
              "once (a tied LM head counted once), KV cache read and written, logits written; activations "
              "left out. FLOPs: 2 x rows x linear weights + attention products. `ar step`: one whole "
              "engine round of method ar (verify 1 + accept + commit), median of decode time per round; "
              "`verify T`: `TargetModel.verify` of a T-node tree; `drafter pass`: `draft` + `base_logits`; "
              "`llama.cpp step`: llama.cpp (xllamacpp, a child process per call) decoding the same GGUF file "
              "greedily after the same kind of random prompt, its own decode time per token (its bytes and "
              "FLOPs counted as dartree's step; its median over calls without a warm-up call). Medians over the "
              "repeats after warm-up calls."]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
