"""One decoder, one thread, a bounded queue: requests decoded one at a time in arrival order.

The event loop submits a `Job` (`DecodeWorker.submit`, QueueFull when the queue holds
`max_queue` jobs); the worker thread runs `SpeculativeDecoder.generate` for it and sends the
answer's text back to the loop as it is decoded. The decoder's `streamer` is called once per round
(committed tokens), so that is where a job ends early: when its client went away (`Job.cancel`)
or a stop string appeared, the streamer raises and `generate` returns at once, freeing the
decoder within the round in flight. `generate` allocates its caches and restarts its lookup at
every call, so an aborted call leaves nothing behind for the next; what the decoder keeps from call
to call (the fallback's and the budget's measured costs, the lookup's earlier outputs) changes
which rounds speculate, never the tokens.

An exception inside decoding fails that job alone (500, logged with its traceback); the thread
goes on with the next.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

from .errors import APIError
from .schema import DecodeRequest
from .text import AnswerText

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds max_queue jobs; retry_after: seconds until one is likely free."""

    def __init__(self, max_queue: int, retry_after: int):
        super().__init__(f"the server is busy: {max_queue} requests are already waiting")
        self.retry_after = retry_after


class _Abort(Exception):
    """Raised from the streamer to end a generate call at a round boundary."""


@dataclass
class Outcome:
    """A finished job.

    text:          the answer (cut before a stop string)
    tokens:        its tokens (up to the one completing a stop string; EOS included when hit)
    finish_reason: "stop" (EOS or a stop string) or "length" (max_tokens)
    prompt_tokens: tokens of the prompt
    stats:         dartree's figures: tau (mean tokens per round, bonus counted), rounds,
                   speculative_rounds (None when a stop string ended the call: generate's own
                   count comes only with its result), tokens_per_second (completion tokens over
                   the rounds' time, prefill excluded), prefill_seconds, queue_seconds
    """

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    stats: dict


class Job:
    """One request on its way through the worker. Events, read on the event loop with
    `next_event()`: ("text", str) pieces of the answer, then ("done", Outcome) or
    ("error", APIError)."""

    def __init__(self, request: DecodeRequest, loop: asyncio.AbstractEventLoop):
        self.request, self._loop = request, loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.submitted = time.perf_counter()

    def cancel(self) -> None:
        """The client went away: the worker drops the job, or ends its call after this round."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def next_event(self) -> tuple[str, object]:
        return await self._events.get()

    def _emit(self, kind: str, value) -> None:
        """From the worker thread: hand an event to the loop (dropped once the loop is closed)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed: nobody is listening
            self.cancel()


class DecodeWorker:
    """The thread that owns the decoder.

    decoder:   a dartree.SpeculativeDecoder, used by this thread alone
    tokenizer: its target's tokenizer (EOS, decoding the answer)
    max_queue: jobs that may wait while one decodes (>= 1); one more is refused with QueueFull
    """

    def __init__(self, decoder, tokenizer, max_queue: int = 16):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
        self.decoder, self.tokenizer, self.max_queue = decoder, tokenizer, max_queue
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._running: Job | None = None
        self._closing = False
        self._seconds = 1.0  # running mean of a job's decode time (Retry-After)
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        self._thread = threading.Thread(target=self._loop, name="dartree-decoder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running job and every waiting one, then end the thread."""
        if not self._thread.is_alive():
            return
        with self._lock:
            self._closing = True
            if self._running is not None:
                self._running.cancel()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job._emit("error", APIError(503, "the server is shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)

    def submit(self, request: DecodeRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request; raises QueueFull when max_queue jobs wait already."""
        job = Job(request, loop)
        with self._lock:
            if self._closing:
                raise APIError(503, "the server is shutting down")
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                waiting = self._queue.qsize() + 1
                retry = max(1, math.ceil(waiting * self._seconds))
                raise QueueFull(self.max_queue, retry) from None
        return job

    def status(self) -> dict:
        """{"busy": a job is decoding, "queued": jobs waiting, "served", "cancelled", "failed"}."""
        with self._lock:
            return {"busy": self._running is not None, "queued": self._queue.qsize(),
                    **self.counts}

    # ------------------------------------------------------------------------- the thread

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if self._closing:
                    job.cancel()
                self._running = job
            start = time.perf_counter()
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running = None
                    self._seconds = 0.8 * self._seconds + 0.2 * (time.perf_counter() - start)

    def _run(self, job: Job) -> None:
        if job.cancelled:  # gone while it waited
            self._count("cancelled")
            return
        req, started = job.request, time.perf_counter()
        text = AnswerText(self.tokenizer, req.stop)
        lengths: list[int] = []  # tokens per streamer call: the prefill's, then each round's
        times: list[float] = []

        def streamer(tokens: list[int]) -> None:
            times.append(time.perf_counter())
            if job.cancelled:
                raise _Abort
            lengths.append(len(tokens))
            piece = text.add(tokens)
            if piece:
                job._emit("text", piece)
            if text.stopped:
                raise _Abort

        result = None
        try:
            result = self.decoder.generate(
                req.prompt_ids, max_new_tokens=req.max_tokens, temperature=req.temperature,
                eos_token_id=self.tokenizer.eos_token_id, seed=req.seed, streamer=streamer)
        except _Abort:
            if not text.stopped:
                log.info("request cancelled by its client after %d rounds",
                         max(len(lengths) - 1, 0))
                self._count("cancelled")
                return
        except Exception:
            log.exception("decoding failed (%d prompt tokens, max_tokens %d, temperature %g)",
                          len(req.prompt_ids), req.max_tokens, req.temperature)
            self._count("failed")
            job._emit("error", APIError(500, "decoding failed inside the server (logged with its "
                                             "traceback); the server goes on serving"))
            return
        tail = text.finish()
        if tail:
            job._emit("text", tail)
        eos = self.tokenizer.eos_token_id
        ended = text.stopped or (text.tokens and eos is not None and text.tokens[-1] == eos)
        outcome = Outcome(text=text.text, tokens=text.tokens,
                          finish_reason="stop" if ended else "length",
                          prompt_tokens=len(req.prompt_ids),
                          stats=_stats(result, lengths, times, len(text.tokens), started,
                                       job.submitted))
        self._count("served")
        log.info("served %d prompt + %d tokens (%s): tau %.2f, %.1f tokens/s",
                 outcome.prompt_tokens, len(outcome.tokens), outcome.finish_reason,
                 outcome.stats["tau"], outcome.stats["tokens_per_second"])
        job._emit("done", outcome)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


def _stats(result, lengths: list[int], times: list[float], tokens: int, started: float,
           submitted: float) -> dict:
    """dartree's figures of a job (Outcome.stats): from generate's result where the call ran to
    its end, else from the streamer's calls (one per round after the prefill's)."""
    if result is not None:
        rounds, speculative = result.acceptance_lengths, sum(result.speculated)
    else:
        rounds, speculative = lengths[1:], None
    decode = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"tau": sum(rounds) / len(rounds) if rounds else 0.0, "rounds": len(rounds),
            "speculative_rounds": speculative,
            "tokens_per_second": tokens / decode if decode > 0 else 0.0,
            "prefill_seconds": times[0] - started if times else 0.0,
            "queue_seconds": started - submitted}
