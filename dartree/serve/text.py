"""The answer's text as tokens arrive: released in pieces, cut where a stop string first appears.

The text is always `tokenizer.decode(tokens, skip_special_tokens=True)` of all tokens so far
(what `dartree generate` prints), never a join of per-token pieces, so it cannot differ from a
whole decode. A piece is released once it is final: not while the text ends in a character split
across tokens (U+FFFD), nor while its end could still become the start of a stop string.
"""

from __future__ import annotations


class AnswerText:
    """Text of a growing token list, with stop strings.

    add(tokens) -> str:  the text released by these tokens (maybe ""); after a stop string
                         appears, `stopped` is True, `tokens` ends with the token that completed
                         it and the text is cut before it
    finish() -> str:     the rest of the text, held back so far (at the end of the answer)
    text:                the text released so far
    tokens:              the answer's tokens (past a stop string: none of the tokens after it)
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, tokens: list[int]) -> str:
        if self.stopped:
            raise RuntimeError("AnswerText.add after a stop string: the answer has ended")
        start = len(self.tokens)
        self.tokens.extend(tokens)
        full = self._decode(self.tokens)
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            self.tokens = self.tokens[:self._tokens_to(cut, start)]
            return self._release(full[:cut])
        if full.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return ""
        return self._release(full[:len(full) - self._held(full)])

    def finish(self) -> str:
        """The text not released yet (the end of the answer: nothing more can complete a stop
        string or a character)."""
        return "" if self.stopped else self._release(self._decode(self.tokens))

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _release(self, upto: str) -> str:
        piece = upto[len(self.text):]
        self.text = upto
        return piece

    def _stop_at(self, full: str) -> int | None:
        """Where the first stop string begins in the text (searching what is new), or None."""
        since = max(0, len(self.text) - self._hold)
        found = [i for i in (full.find(s, since) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held(self, full: str) -> int:
        """Characters at the text's end that could begin a stop string."""
        for n in range(min(self._hold, len(full)), 0, -1):
            if any(s.startswith(full[-n:]) for s in self.stop):
                return n
        return 0

    def _tokens_to(self, cut: int, start: int) -> int:
        """The fewest tokens whose text holds a stop string beginning at `cut` (at least those
        before `start`: the earlier rounds' text had none)."""
        for n in range(start + 1, len(self.tokens) + 1):
            if self._stop_at(self._decode(self.tokens[:n])) is not None:
                return n
        return len(self.tokens)
