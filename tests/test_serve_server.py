"""`dartree serve` as a real process on a free loopback port (127.0.0.1 only), driven by the official
`openai` client: the tokens of `dartree generate`, 32 concurrent clients, a disconnect mid-stream,
resident memory over 200 requests; one slower test on the default model (SmolLM2).

Every server is started and stopped by the test (terminate, then kill); every loop is bounded.
Tiny models run on one thread here and in the server (conftest.one_thread): on a shared CPU that
is both the fastest and the same arithmetic on both sides.
"""

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (scripts/install.sh)")
pytest.importorskip("uvicorn", reason="dartree serve needs the serve extra (scripts/install.sh)")

import dartree  # noqa: E402
from dartree import cli  # noqa: E402

ROOT = Path(dartree.__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--device", "cpu"]


class Server:
    """`python -m dartree.cli serve ARGS` on a free 127.0.0.1 port, its output in a log file."""

    def __init__(self, args: list[str], log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        env.pop(  # a key from the environment would make every request here a 401
            "DARTREE_API_KEY", None)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dartree.cli", "-v", "serve", *args, "--host", "127.0.0.1",
                 "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=ROOT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"dartree serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        pytest.fail(f"dartree serve did not answer /health within {timeout} s:\n{self.output()}")

    def health(self) -> dict:
        import json

        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read())

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=60, **kw)

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1))

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)


@pytest.fixture(scope="module")
def tiny_server(one_thread, tmp_path_factory):
    server = Server(TINY + ["--threads", "1", "--max-queue", "8"],
                    tmp_path_factory.mktemp("serve") / "tiny.log")
    try:
        server.wait_ready(120)
        yield server
    finally:
        server.stop()


def generated(capsys, args: list[str], prompt: str, chat: bool) -> tuple[str, int]:
    """`dartree generate ARGS --prompt PROMPT` in this process (--raw unless `chat`): (the
    answer's text, its tokens). Generate prints the prompt first where it continues it (--raw, or
    a model without a chat template), and a newline last."""
    assert cli.main(["generate", *args, "--prompt", prompt] + ([] if chat else ["--raw"])) == 0
    out = capsys.readouterr()
    printed = out.out[:-1]
    if not chat or "tiny" in args:
        assert printed.startswith(prompt)
        printed = printed[len(prompt):]
    return printed, int(re.search(r"\] (\d+) tokens in", out.err).group(1))


def ask(client, model: str, kind: str, prompt: str, stream: bool, **settings) -> tuple[str, int, str]:
    """(text, completion tokens, finish_reason) of one request through the openai client."""
    if kind == "chat":
        call = client.chat.completions.create
        body = dict(messages=[{"role": "user", "content": prompt}])
    else:
        call = client.completions.create
        body = dict(prompt=prompt)
    if not stream:
        res = call(model=model, **body, **settings)
        choice = res.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return text, res.usage.completion_tokens, choice.finish_reason
    pieces, usage, finish = [], None, None
    for chunk in call(model=model, **body, **settings, stream=True,
                      stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            pieces.append((choice.delta.content if kind == "chat" else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), usage, finish


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 11)])
def test_the_openai_client_gets_the_tokens_of_dartree_generate(tiny_server, capsys, temperature, seed):
    prompt, n = "def add(a, b):", 24
    settings = ["--max-new-tokens", str(n), "--temperature", str(temperature), "--seed", str(seed)]
    text, tokens = generated(capsys, TINY + settings, prompt, chat=False)
    assert text.strip() and tokens == n
    client = tiny_server.client()
    for kind in ("text", "chat"):  # no chat template: a user message is the plain prompt
        for stream in (False, True):
            got = ask(client, "tiny", kind, prompt, stream, max_tokens=n, temperature=temperature,
                      seed=seed)
            assert got == (text, tokens, "length"), (kind, stream)


def test_32_concurrent_clients_get_their_own_answers_or_429(tiny_server, one_thread):
    parser = __import__("argparse").ArgumentParser()
    cli.add_model_options(parser)
    cli.add_decoder_options(parser)
    dec, tok = cli.build_decoder(parser.parse_args(TINY))
    prompts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(32)]
    expected = []
    for p in prompts:
        res = dec.generate(tok(p).input_ids, max_new_tokens=16, eos_token_id=tok.eos_token_id)
        expected.append(tok.decode(res.tokens, skip_special_tokens=True))
    assert len(set(expected)) > 8  # the answers tell the clients apart

    results: dict[int, list] = {}
    barrier = threading.Barrier(32, timeout=60)

    def client_loop(i: int) -> None:
        client, seen = tiny_server.client(), []
        barrier.wait()
        for _ in range(4):  # bounded: a 429 is retried after its Retry-After, at most 3 times
            try:
                seen.append(("ok", ask(client, "tiny", "text", prompts[i], stream=i % 2 == 1,
                                       max_tokens=16, temperature=0)[0]))
                break
            except openai.RateLimitError as err:
                seen.append(("429", err.response.headers.get("retry-after")))
                time.sleep(min(float(err.response.headers["retry-after"]), 1.0))
        results[i] = seen

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(32)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 150
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a client hung past its timeout"
    assert sorted(results) == list(range(32))
    refused = 0
    for i, seen in results.items():
        for outcome, value in seen:
            if outcome == "ok":
                assert value == expected[i], f"client {i} got another answer"
            else:
                refused += 1
                assert value is not None and int(value) >= 1  # Retry-After
    assert refused >= 1  # 32 at once against a queue of 8: some were turned away
    assert sum(seen[-1][0] == "ok" for seen in results.values()) >= 9


def test_a_client_that_disconnects_mid_stream_frees_the_decoder(tiny_server):
    client = tiny_server.client()
    before = tiny_server.health()
    stream = client.completions.create(model="tiny", prompt="def long(x):", max_tokens=1500,
                                       temperature=0, stream=True)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    stream.close()
    closed = time.monotonic()
    while time.monotonic() - closed < 20:
        health = tiny_server.health()
        if health["cancelled"] > before["cancelled"] and not health["busy"]:
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the decoder was not freed 20 s after the client left: {health}")
    assert health["served"] == before["served"]  # it did not decode the 1500 tokens
    text, tokens, finish = ask(client, "tiny", "text", "x = 1", False, max_tokens=4, temperature=0)
    assert tokens == 4 and finish == "length"


def test_resident_memory_after_200_requests_is_within_5_percent_of_after_10(tiny_server):
    client = tiny_server.client()
    rss = {}
    for i in range(1, 201):
        kind = "chat" if i % 3 == 0 else "text"
        text, tokens, _ = ask(client, "tiny", kind, f"def g{i % 23}(y, z={i}):", i % 2 == 0,
                              max_tokens=8, temperature=0.5 * (i % 3), seed=i)
        assert tokens >= 1
        if i in (10, 200):
            rss[i] = tiny_server.rss_kib()
    assert rss[200] <= 1.05 * rss[10], f"VmRSS {rss[10]} kB after 10 requests, {rss[200]} kB after 200"


@pytest.mark.slow
def test_the_default_model_serves_the_tokens_of_dartree_generate(one_thread, capsys, tmp_path,
                                                                monkeypatch):
    """SmolLM2-135M-Instruct and its drafter (packed GGUF on a CPU), as `dartree serve` starts by
    default: chat (through its chat template) and raw completions, greedy and sampled. The
    in-process `dartree generate` runs load the models once (loading takes most of the time)."""
    pytest.importorskip("gguf")
    from dartree import defaults

    server = Server(["--device", "cpu", "--threads", "1"], tmp_path / "smollm2.log")
    loaded, load = {}, defaults.default_models

    def load_once(*a, **k):
        key = repr((a, k))
        if key not in loaded:
            loaded[key] = load(*a, **k)
        return loaded[key]

    monkeypatch.setattr(defaults, "default_models", load_once)
    try:
        cases = [("chat", "What is the capital of France?", 12, 0.0, 0),
                 ("chat", "What is the capital of France?", 12, 0.7, 5),
                 ("text", "The capital of France is", 8, 0.0, 0)]
        expected = [generated(capsys, ["--device", "cpu", "--max-new-tokens", str(n), "--temperature",
                                       str(temperature), "--seed", str(seed)], prompt, kind == "chat")
                    for kind, prompt, n, temperature, seed in cases]
        server.wait_ready(300)
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        for (kind, prompt, n, temperature, seed), (text, tokens) in zip(cases, expected):
            assert text.strip()
            for stream in (False, True):
                got = ask(client, "smollm2", kind, prompt, stream, max_tokens=n,
                          temperature=temperature, seed=seed)
                assert got[:2] == (text, tokens), (kind, temperature, stream)
    finally:
        server.stop()
