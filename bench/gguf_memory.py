#!/usr/bin/env python3
"""Resident memory of a GGUF model loaded packed, against the file's size.

    python bench/gguf_memory.py                       # SmolLM2's GGUF file (the default target)
    python bench/gguf_memory.py --gguf FILE --out bench/results/gguf_memory.md

Imports everything loading needs first (transformers, gguf, dartree, a config read), then measures
this process's resident set (VmRSS in /proc/self/status) before and after `dartree.load_gguf(path)`,
and reports the difference beside the file's size and the bytes of the model's tensors (an untied
token table stays mapped in the file: only the rows looked up become resident); then the process's
whole resident set (the imports included) and its peak during the load (VmHWM).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path


def status_bytes(field: str) -> int:
    """A size from /proc/self/status (VmRSS: resident now; VmHWM: the peak so far)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Restart VmHWM from the current resident size (Linux: 5 into /proc/self/clear_refs), so the
    peak read after the load is the load's; where that is refused, it is the process's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: SmolLM2's)")
    parser.add_argument("--out", default=None, help="write the Markdown table here too")
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    import dartree
    from dartree.bench.machine import machine_info
    from dartree.defaults import smollm2_gguf

    path = Path(args.gguf) if args.gguf else smollm2_gguf()
    AutoConfig.from_pretrained(path.parent, gguf_file=path.name)  # imports and caches warmed
    gc.collect()
    reset_peak()
    before = status_bytes("VmRSS")
    model = dartree.load_gguf(path)
    gc.collect()
    after, peak = status_bytes("VmRSS"), status_bytes("VmHWM")
    delta = after - before
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    size = path.stat().st_size
    import torch

    cpu = machine_info(torch.device("cpu"), torch.float32)["cpu"]
    lines = [f"# Resident memory of `dartree.load_gguf`: {path.name}", "",
             f"Machine: {cpu}; command: `python bench/gguf_memory.py {' '.join(argv or sys.argv[1:])}`", "",
             "| file MB | tensors MB | resident MB (after - before load) | resident / file | "
             "process resident MB: before, after (/ file) | process peak MB during the load |",
             "|---|---|---|---|---|---|",
             f"| {size / 1e6:.1f} | {sum(tensors.values()) / 1e6:.1f} | {delta / 1e6:.1f} | "
             f"**{delta / size:.2f}×** | {before / 1e6:.0f}, {after / 1e6:.0f} ({after / size:.2f}×) | "
             f"{peak / 1e6:.0f} |"]
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
