"""Kernel microbenchmarks: every dartree op checked against its plain-PyTorch reference, then timed.

    python bench/op_bench.py                  # CPU
    python bench/op_bench.py --threads 1      # CPU, one thread (bench/results/kernels_cpu.md)
    python bench/op_bench.py --device cuda    # GPU (also SDPA / FlexAttention for tree attention)

The cases sit beside this script, one module per op family of dartree.ops: op_bench_cache.py,
op_bench_attention.py, op_bench_tree.py, op_bench_sampling.py (run as a script, bench/ is first on
the path, so they import as plain modules). Each case first runs the kernel and the reference once
on the same inputs and compares the outputs (index outputs exactly, values within the dtype's
tolerance); a mismatch stops the run. Then both are timed in the same run (median of --iters after
--warmup calls, `dartree.bench.timing.call_seconds`) and one Markdown table is printed: times, the
reference/kernel ratio (> 1 means the kernel is faster) and, where a case states the bytes it must
read, the achieved bandwidth. On CPU the per-round breakdown of the DARTree tree build follows,
each stage checked the same way against its run on the reference ops.

A case is a dict: name; kernel and reference, zero-argument callables; optionally compare (returns
the kernel's and the reference's outputs, where the op works in place or they differ in layout),
bytes, extra (optional baselines: name -> callable, timed but not checked) and failed (baselines
that could not be set up: name -> why).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys

import torch

import op_bench_attention
import op_bench_cache
import op_bench_sampling
import op_bench_tree
from dartree import ops
from dartree.bench.timing import call_seconds

# |kernel - reference| <= atol + rtol * |reference| for float outputs: both round in the input
# dtype, the reference often in a different order
TOLERANCE = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3),
             torch.bfloat16: (5e-2, 5e-2)}


def _tensors(result) -> list[torch.Tensor]:
    """The tensors of an op's result in order: tuples, lists and dataclasses walked, None left out."""
    if result is None:
        return []
    if torch.is_tensor(result):
        return [result]
    if dataclasses.is_dataclass(result):
        result = [getattr(result, field.name) for field in dataclasses.fields(result)]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in _tensors(item)]
    raise TypeError(f"cannot compare a {type(result).__name__}")


def check(case: dict) -> None:
    """Raise AssertionError unless the case's kernel gives its reference's outputs."""
    if "compare" in case:
        kernel, reference = case["compare"]()
    else:
        kernel, reference = case["kernel"](), case["reference"]()
    got, want = _tensors(kernel), _tensors(reference)
    if len(got) != len(want):
        raise AssertionError(f"{case['name']}: the kernel gave {len(got)} outputs, the reference {len(want)}")
    for index, (a, b) in enumerate(zip(got, want)):
        where = f"{case['name']}: output {index}"
        if a.shape != b.shape:
            raise AssertionError(f"{where}: shape {tuple(a.shape)}, the reference's {tuple(b.shape)}")
        if a.is_floating_point():
            atol, rtol = TOLERANCE[a.dtype if a.dtype in TOLERANCE else torch.float32]
            torch.testing.assert_close(a.double().cpu(), b.double().cpu(), atol=atol, rtol=rtol,
                                       msg=lambda m, where=where: f"{where}: {m}")
        elif not torch.equal(a.cpu(), b.cpu().to(a.dtype)):
            raise AssertionError(f"{where}: index outputs differ from the reference's")


def all_cases(device, flex):
    return (op_bench_cache.cases(device) + op_bench_tree.cases(device)
            + op_bench_attention.cases(device, flex=flex) + op_bench_sampling.cases(device))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--filter", default="", help="only cases (and CPU breakdown stages) whose name contains this")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-flex", action="store_true", help="leave out the FlexAttention baseline")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if not ops.HAS_EXTENSION:
        sys.exit("dartree._C is not built: nothing to compare with the reference")

    def seconds(fn):
        return statistics.median(call_seconds(fn, args.iters, args.warmup, device))

    rows = []
    with torch.inference_mode():
        for case in all_cases(device, flex=not args.no_flex):
            if args.filter not in case["name"]:
                continue
            check(case)
            kernel, reference = seconds(case["kernel"]), seconds(case["reference"])
            extra = {}
            for name, fn in case.get("extra", {}).items():
                try:  # baselines are optional: a failure is noted in the table, not fatal
                    extra[name] = f"{seconds(fn) * 1e6:.1f}"
                except Exception as exc:  # noqa: BLE001
                    case.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            for name, why in case.get("failed", {}).items():
                extra[name] = "failed"
                print(f"  {case['name']}: baseline {name} failed: {why[:300]}", file=sys.stderr)
            rows.append((case, kernel, reference, extra))
            print(f"  {case['name']}: kernel {kernel * 1e6:.1f} us, reference "
                  f"{reference * 1e6:.1f} us", file=sys.stderr)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"\n### dartree kernels on {device.type} ({name}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.iters}\n")
    print("| op | kernel (us) | reference (us) | ref / kernel | other baselines (us) | GB/s |")
    print("|---|---:|---:|---:|---|---:|")
    for case, kernel, reference, extra in rows:
        others = ", ".join(f"{k} {v}" for k, v in extra.items()) or "-"
        bandwidth = f"{case['bytes'] / kernel / 1e9:.0f}" if case.get("bytes") else "-"
        print(f"| {case['name']} | {kernel * 1e6:.1f} | {reference * 1e6:.1f} | "
              f"{reference / kernel:.2f} | {others} | {bandwidth} |")
    if device.type == "cpu":
        stages = [s for s in op_bench_tree.round_stages(device) if args.filter in s["name"]]
        if stages:
            print(f"\n{op_bench_tree.ROUND} on {device}, {torch.get_num_threads()} threads; "
                  f"median of {args.iters}")
        with torch.inference_mode():
            for stage in stages:
                if stage["reference"] is not None:
                    check(stage)
                print(f"  {stage['name']:<52s} {seconds(stage['kernel']) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
