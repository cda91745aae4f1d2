#!/usr/bin/env python3
"""End-to-end benchmark: τ and speedup over `ar` of every method, side by side (= `dartree bench`).

    python bench/e2e.py                                        # bundled models, default settings
    python bench/e2e.py --prompts humaneval --limit 20 --budgets 16,32,64,auto --out bench/results/e2e
    python bench/e2e.py --target DIR --drafter DIR --device cuda --prompts mine.jsonl

Writes results.json (settings, machine, per-response rows, aggregates), table.md and PNG plots to
--out and prints the table last. The protocol and the measures are described in
dartree/bench/; `python bench/e2e.py --help` lists every option.
"""

import sys

from dartree.bench import main

if __name__ == "__main__":
    sys.exit(main())
