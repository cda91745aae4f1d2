"""Response bodies as OpenAI's API defines them, and their server-sent-event framing.

chat:  {"object": "chat.completion", "choices": [{"message": {"role", "content"}, ...}], ...}
       streamed: "chat.completion.chunk"s, the first with the assistant role, then content
       deltas, the last with finish_reason
text:  {"object": "text_completion", "choices": [{"text", ...}], ...}, streamed the same way
Every answer carries `usage` (streamed: in a last chunk with empty choices when the request asks
for stream_options.include_usage) and dartree's own figures under "dartree" (the final body, or
the chunk with finish_reason): tau, rounds, speculative_rounds, tokens_per_second, prefill_seconds,
queue_seconds.
"""

from __future__ import annotations

import json
import time
import uuid

from .worker import Outcome

DONE = "data: [DONE]\n\n"


class Answer:
    """The fixed parts of one answer (id, time, model) and its bodies.

    kind: "chat" or "text"; model: the served model id
    """

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def body(self, outcome: Outcome) -> dict:
        """The whole answer (not streamed)."""
        choice = {"index": 0, "finish_reason": outcome.finish_reason, "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": outcome.text}
        else:
            choice["text"] = outcome.text
        return {**self._head(streamed=False), "choices": [choice], "usage": usage(outcome),
                "dartree": outcome.stats}

    def first_chunk(self) -> str | None:
        """Chat streams open with the assistant's role (empty content); text streams do not."""
        if self.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": ""})

    def text_chunk(self, piece: str) -> str:
        return self._chunk({"content": piece} if self.kind == "chat" else piece)

    def last_chunks(self, outcome: Outcome, include_usage: bool) -> list[str]:
        """The chunk with finish_reason (and dartree's figures), the usage chunk if asked, and
        the closing [DONE]."""
        last = self._chunk_body({} if self.kind == "chat" else "", outcome.finish_reason)
        chunks = [sse({**last, "dartree": outcome.stats})]
        if include_usage:
            chunks.append(sse({**self._head(streamed=True), "choices": [],
                               "usage": usage(outcome)}))
        return chunks + [DONE]

    def _chunk(self, delta) -> str:
        return sse(self._chunk_body(delta))

    def _chunk_body(self, delta, finish_reason: str | None = None) -> dict:
        """A chunk's body: delta is the chat delta {"role"?, "content"?} or the text piece."""
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        choice["delta" if self.kind == "chat" else "text"] = delta
        return {**self._head(streamed=True), "choices": [choice]}

    def _head(self, streamed: bool) -> dict:
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind]
        if streamed and self.kind == "chat":
            obj += ".chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage(outcome: Outcome) -> dict:
    completion = len(outcome.tokens)
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": completion,
            "total_tokens": outcome.prompt_tokens + completion}


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
