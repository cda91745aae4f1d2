"""The progress line of training and of FeatureCache.build, on stderr, with an ETA."""

from __future__ import annotations

import sys
import time


class Progress:
    """One stderr line, rewritten in place on a terminal, else printed every ``every`` steps.

    ``start``: steps already done before this run (a resumed stage); the rate and the ETA count
    only the steps of this run."""

    def __init__(self, total: int, enabled: bool, every: int = 10, start: int = 0):
        self.total, self.enabled, self.every, self.start = total, enabled, every, start
        self.tty = enabled and sys.stderr.isatty()
        self.began = time.perf_counter()

    def eta(self, step: int) -> str:
        done, left = step - self.start, self.total - step
        if done <= 0:
            return "ETA ?"
        seconds = (time.perf_counter() - self.began) / done * left
        return f"ETA {seconds / 60:.1f} min"

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        filled = int(30 * step / self.total)
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total} {text} {self.eta(step)}"
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif step % self.every == 0 or step == self.total:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)
