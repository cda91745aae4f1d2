"""Kernel microbenchmarks: every dartree op against its plain-PyTorch reference, side by side.

    python bench/kernels.py                  # CPU
    python bench/kernels.py --threads 1      # CPU, one thread (the issue's measurements)
    python bench/kernels.py --device cuda    # GPU (also SDPA / FlexAttention for tree attention)

Each case times the compiled kernel and the reference on the same inputs in the same run (median
of --iters after --warmup calls) and prints one Markdown table: times, the reference/kernel ratio
(> 1 means the kernel is faster) and, where a case states the bytes it must read, the achieved
bandwidth. The per-round CPU breakdown of the DARTree tree build follows on CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dartree.ops as ops  # noqa: E402


def kv_commit_cases(device):
    """One verify pass of a 36-layer, 8-KV-head target: 17 accepted rows of a 64-node tree."""
    kv = torch.randn(36, 2, 1, 8, 4096 + 80, 128, device=device, dtype=torch.bfloat16)
    accepted = torch.tensor([0, 1, 3, 6, 9, 13, 17, 20, 24, 29, 33, 38, 44, 50, 55, 59, 63],
                            device=device)
    moved = 2 * 36 * 8 * (accepted.numel() - 2) * 128 * 2 * 2  # read + write of moved rows
    return [dict(name="kv_commit L36 Hkv8 D128 A17", bytes=moved,
                 kernel=lambda: ops.kv_commit(kv, 4000, accepted, check=False),
                 reference=lambda: ops.reference.kv_commit(kv, 4000, accepted))]


def _all_cases(device, flex):
    cases = kv_commit_cases(device)
    for module, options in (("kernels_tree", {}), ("kernels_attention", dict(flex=flex)),
                            ("kernels_sampling", {})):
        try:
            cases += __import__(module).cases(device, **options)
        except ImportError:
            pass
    return cases


def _timer(device, fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--filter", default="", help="only cases whose name contains this")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-flex", action="store_true", help="leave out the FlexAttention baseline")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if not ops.HAS_EXTENSION:
        sys.exit("dartree._C is not built: nothing to compare with the reference")
    rows = []
    with torch.inference_mode():
        for case in _all_cases(device, flex=not args.no_flex):
            if args.filter not in case["name"]:
                continue
            kernel = _timer(device, case["kernel"], args.warmup, args.iters)
            reference = _timer(device, case["reference"], args.warmup, args.iters)
            extra = {}
            for name, fn in case.get("extra", {}).items():
                try:  # baselines are optional: a failure is noted in the table, not fatal
                    extra[name] = f"{_timer(device, fn, args.warmup, args.iters) * 1e6:.1f}"
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
        try:
            __import__("kernels_tree").round_breakdown(device)
        except (ImportError, AttributeError):
            pass


if __name__ == "__main__":
    main()
