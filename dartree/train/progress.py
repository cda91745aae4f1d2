"""The progress line of training and of FeatureCache.build, on stderr."""

from __future__ import annotations

import sys


class Progress:
    """One stderr line, rewritten in place on a terminal, else printed every ``every`` steps."""

    def __init__(self, total: int, enabled: bool, every: int = 10):
        self.total, self.enabled, self.every = total, enabled, every
        self.tty = enabled and sys.stderr.isatty()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        filled = int(30 * step / self.total)
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total} {text}"
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif step % self.every == 0 or step == self.total:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)
