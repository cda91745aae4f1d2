#!/usr/bin/env python3
"""Resident memory of a GGUF model loaded packed, against the file's size.

    python bench/gguf_memory.py                       # SmolLM2's GGUF file (the default target)
    python bench/gguf_memory.py --gguf FILE --out bench/results/gguf_memory.md

Imports everything loading needs first (transformers, gguf, dartree, a config read), then measures
this process's resident set (/proc/self/statm) before and after `dartree.load_gguf(path)`, and
reports the difference beside the file's size and the bytes of the model's tensors.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    before = resident_bytes()
    model = dartree.load_gguf(path)
    gc.collect()
    delta = resident_bytes() - before
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    size = path.stat().st_size
    import torch

    cpu = machine_info(torch.device("cpu"), torch.float32)["cpu"]
    lines = [f"# Resident memory of `dartree.load_gguf`: {path.name}", "",
             f"Machine: {cpu}; command: `python bench/gguf_memory.py {' '.join(argv or sys.argv[1:])}`", "",
             "| file MB | tensors MB | resident MB (after - before load) | resident / file |",
             "|---|---|---|---|",
             f"| {size / 1e6:.1f} | {sum(tensors.values()) / 1e6:.1f} | {delta / 1e6:.1f} | **{delta / size:.2f}×** |"]
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
