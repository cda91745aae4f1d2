"""dartree serve's ASGI app in-process (the bundled tiny model): OpenAI's bodies and errors, the
queue, cancellation, injected failures, the API key. tests/test_serve_server.py runs the real
server and the official client."""

import argparse
import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("starlette", reason="dartree serve needs the serve extra (scripts/install.sh)")

from starlette.testclient import TestClient  # noqa: E402

from dartree import cli  # noqa: E402
from dartree.serve.app import create_app  # noqa: E402
from dartree.serve.schema import DecodeRequest  # noqa: E402
from dartree.serve.worker import DecodeWorker  # noqa: E402

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def tiny(one_thread):
    """(decoder, tokenizer) of the tiny pair, built as `dartree serve --model tiny` builds them."""
    parser = argparse.ArgumentParser()
    cli.add_model_options(parser)
    cli.add_decoder_options(parser)
    return cli.build_decoder(parser.parse_args(["--model", "tiny", "--device", "cpu"]))


@pytest.fixture
def client(tiny):
    with TestClient(create_app(*tiny, "tiny")) as c:
        yield c


def complete(client, **body):
    return client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12,
                                                "temperature": 0, **body})


def reference(tiny, max_tokens=12, temperature=0.0, seed=0, prompt=PROMPT):
    """The decoder's own answer to the prompt (plain tokens): (text, tokens)."""
    dec, tok = tiny
    ids = tok(prompt).input_ids
    res = dec.generate(ids, max_new_tokens=max_tokens, temperature=temperature, seed=seed,
                       eos_token_id=tok.eos_token_id)
    return tok.decode(res.tokens, skip_special_tokens=True), res.tokens


def sse_events(text):
    """The JSON payloads of a server-sent-event body, and whether it ended with [DONE]."""
    data = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert data, text
    return [json.loads(d) for d in data if d != "[DONE]"], data[-1] == "[DONE]"


def assert_error(response, status, param=None):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_completion_and_chat_bodies_carry_the_decoders_tokens_usage_and_figures(client, tiny):
    text, tokens = reference(tiny)
    body = complete(client).json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_len = len(tiny[1](PROMPT).input_ids)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(tokens),
                             "total_tokens": prompt_len + len(tokens)}
    figures = body["dartree"]
    assert figures["rounds"] >= 1 and figures["tau"] == pytest.approx(len(tokens) / figures["rounds"], abs=1)
    assert 0 <= figures["speculative_rounds"] <= figures["rounds"] and figures["tokens_per_second"] > 0
    # no chat template (the tiny model): one user message is the prompt, as `dartree generate`
    chat = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
        "temperature": 0}).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": text}


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_stream_joins_to_the_unstreamed_answer_and_ends_with_done(client, tiny, kind):
    text, tokens = reference(tiny, max_tokens=20)
    url, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}) \
        if kind == "chat" else ("/v1/completions", {"prompt": PROMPT})
    r = client.post(url, json={**body, "max_tokens": 20, "temperature": 0, "stream": True,
                               "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, done = sse_events(r.text)
    assert done
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens)
    chunks = events[:-1]
    pieces = [c["choices"][0]["delta"].get("content", "") if kind == "chat"
              else c["choices"][0]["text"] for c in chunks]
    assert "".join(pieces) == text
    assert len([p for p in pieces if p]) > 2  # streamed as rounds commit, not at the end
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "dartree" in chunks[-1]
    if kind == "chat":
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_stop_strings_cut_the_answer_streamed_or_not(client, tiny):
    text, _ = reference(tiny, max_tokens=20)
    stop = text.lstrip()[2:5]  # inside the answer's first word
    cut = text[:text.index(stop)]
    assert cut.strip() and len(stop) == 3
    body = complete(client, max_tokens=20, stop=[stop, "never appears"]).json()
    assert body["choices"][0]["text"] == cut and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 20
    events, _ = sse_events(complete(client, max_tokens=20, stop=stop, stream=True).text)
    assert "".join(e["choices"][0]["text"] for e in events) == cut
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_eos_ends_with_stop_streamed_or_not(client, tiny):
    prompt = 'if __name__ == "__main__":\n    main()\n'  # the tiny model ends the file here
    text, tokens = reference(tiny, max_tokens=50, prompt=prompt)
    assert tokens[-1] == tiny[1].eos_token_id  # EOS, included in the tokens
    body = complete(client, prompt=prompt, max_tokens=50).json()
    assert body["choices"][0] == {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
    assert body["usage"]["completion_tokens"] == len(tokens)
    events, done = sse_events(complete(client, prompt=prompt, max_tokens=50, stream=True).text)
    assert done and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in events) == text


def test_sampling_uses_the_seed_and_the_servers_default_seed(tiny):
    text7, _ = reference(tiny, temperature=0.9, seed=7, max_tokens=16)
    text0, _ = reference(tiny, temperature=0.9, seed=0, max_tokens=16)
    assert text7 != text0  # the check below can tell the seeds apart
    with TestClient(create_app(*tiny, "tiny", default_seed=7)) as c:
        assert complete(c, temperature=0.9, max_tokens=16).json()["choices"][0]["text"] == text7
        assert complete(c, temperature=0.9, max_tokens=16, seed=0).json()["choices"][0]["text"] == text0


def test_a_requests_tokens_do_not_depend_on_what_ran_before(client, tiny):
    first = complete(client, max_tokens=16, temperature=0.8, seed=3).json()["choices"][0]["text"]
    for i in range(3):  # other prompts, settings and a stop in between
        complete(client, prompt=f"class C{i}:", max_tokens=10, temperature=i * 0.5, stop="_")
    again = complete(client, max_tokens=16, temperature=0.8, seed=3).json()["choices"][0]["text"]
    assert again == first == reference(tiny, max_tokens=16, temperature=0.8, seed=3)[0]


BAD = [  # (description, endpoint, raw body or JSON body, status, param)
    ("malformed JSON", "text", b'{"prompt": "x",', 400, None),
    ("not an object", "text", [1, 2], 400, None),
    ("missing messages", "chat", {"max_tokens": 2}, 422, "messages"),
    ("empty messages", "chat", {"messages": []}, 422, "messages"),
    ("messages not a list", "chat", {"messages": "hi"}, 422, "messages"),
    ("unknown role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 422, "messages[0].role"),
    ("content not text", "chat", {"messages": [{"role": "user", "content": 5}]}, 422, "messages[0].content"),
    ("missing prompt", "text", {"max_tokens": 2}, 422, "prompt"),
    ("empty prompt", "text", {"prompt": ""}, 422, "prompt"),
    ("token id outside the vocabulary", "text", {"prompt": [1, 10 ** 9]}, 422, "prompt"),
    ("prompt longer than the context", "text", {"prompt": [5] * 2100}, 413, "prompt"),
    ("max_tokens 0", "text", {"prompt": "x", "max_tokens": 0}, 422, "max_tokens"),
    ("max_tokens negative", "text", {"prompt": "x", "max_tokens": -3}, 422, "max_tokens"),
    ("max_tokens not an int", "text", {"prompt": "x", "max_tokens": "5"}, 422, "max_tokens"),
    ("max_tokens past the context", "text", {"prompt": "x", "max_tokens": 5000}, 422, "max_tokens"),
    ("max_completion_tokens 0", "chat", {"messages": [{"role": "user", "content": "x"}],
                                         "max_completion_tokens": 0}, 422, "max_completion_tokens"),
    ("temperature negative", "text", {"prompt": "x", "temperature": -0.5}, 422, "temperature"),
    ("temperature NaN", "text", b'{"prompt": "x", "temperature": NaN}', 422, "temperature"),
    ("temperature a string", "text", {"prompt": "x", "temperature": "hot"}, 422, "temperature"),
    ("unknown model", "chat", {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("seed negative", "text", {"prompt": "x", "seed": -1}, 422, "seed"),
    ("five stop strings", "text", {"prompt": "x", "stop": list("abcde")}, 422, "stop"),
    ("top_p when sampling", "text", {"prompt": "x", "temperature": 0.7, "top_p": 0.9}, 400, "top_p"),
    ("top_k when sampling", "text", {"prompt": "x", "temperature": 1, "top_k": 40}, 400, "top_k"),
    ("n > 1", "chat", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ("two prompts", "text", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("a system turn without a chat template", "chat",
     {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]}, 400, "messages"),
    ("stream not a boolean", "text", {"prompt": "x", "stream": "yes"}, 422, "stream"),
]


@pytest.mark.parametrize("what,kind,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_and_a_json_error_then_the_server_serves(
        client, tiny, what, kind, body, status, param):
    url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    sent = client.post(url, content=body) if isinstance(body, bytes) else client.post(url, json=body)
    assert_error(sent, status, param)
    assert client.app.state.worker.status()["served"] == 0  # refused before the queue
    ok = complete(client, max_tokens=3)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == reference(tiny, 3)[0]


def test_a_body_over_the_size_limit_gets_413_then_the_server_serves(tiny):
    with TestClient(create_app(*tiny, "tiny", max_body_bytes=2000)) as c:
        assert_error(c.post("/v1/completions", json={"prompt": "x" * 3000}), 413)
        assert complete(c, max_tokens=2).status_code == 200


def test_paths_methods_models_and_health(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["object"] == "list"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_error(client.get("/v1/models/other"), 404, "model")
    assert client.get("/health").json()["status"] == "ok"


def test_top_p_and_top_k_are_accepted_where_they_change_nothing(client, tiny):
    text = reference(tiny, 6)[0]
    for extra in ({"top_p": 0.5, "top_k": 3}, {"temperature": 0.7, "top_p": 1, "top_k": 0}):
        r = complete(client, max_tokens=6, **extra)
        assert r.status_code == 200, r.text
    assert complete(client, max_tokens=6, top_p=0.5).json()["choices"][0]["text"] == text


def test_api_key_missing_or_wrong_gets_401_and_nothing_is_decoded(tiny, monkeypatch):
    dec, _ = tiny
    calls = []
    real = dec.generate
    monkeypatch.setattr(dec, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    with TestClient(create_app(*tiny, "tiny", api_key="s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            for url in ("/v1/completions", "/health", "/v1/models"):
                err = assert_error(c.post(url, json={"prompt": PROMPT, "max_tokens": 4},
                                          headers=headers) if url == "/v1/completions"
                                   else c.get(url, headers=headers), 401)
                assert err["code"] == "invalid_api_key"
        assert calls == [] and c.app.state.worker.status()["served"] == 0
        ok = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
                    headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and calls == [1]


def test_a_decoding_failure_answers_500_for_that_request_only(client, tiny, monkeypatch, caplog):
    dec, _ = tiny
    expected = complete(client).json()["choices"][0]["text"]
    real = dec.target.verify

    def broken(*a, **k):
        raise RuntimeError("injected verify failure")

    monkeypatch.setattr(dec.target, "verify", broken)
    with caplog.at_level("ERROR", logger="dartree.serve.worker"):
        err = assert_error(complete(client), 500)
    assert err["type"] == "server_error"
    assert any(r.exc_info and "injected verify failure" in str(r.exc_info[1]) for r in caplog.records)
    # streamed: the prefill's text went out with the headers, so the failure is an error event
    events, done = sse_events(complete(client, stream=True).text)
    assert events[-1]["error"]["type"] == "server_error" and done
    monkeypatch.setattr(dec.target, "verify", real)
    # streamed, failing before any text: the status is 500 as well
    prefill = dec.target.prefill
    monkeypatch.setattr(dec.target, "prefill", broken)
    assert_error(complete(client, stream=True), 500)
    monkeypatch.setattr(dec.target, "prefill", prefill)
    assert complete(client).json()["choices"][0]["text"] == expected
    assert client.app.state.worker.status()["failed"] == 3


def test_a_full_queue_answers_429_with_retry_after(tiny, monkeypatch):
    dec, _ = tiny
    release = threading.Event()
    real = dec.generate

    def held(*a, **k):  # the first call waits until the test lets it go
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(dec, "generate", held)
    with TestClient(create_app(*tiny, "tiny", max_queue=2)) as c:
        worker = c.app.state.worker
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(complete(c, max_tokens=4)))
                   for _ in range(3)]
        threads[0].start()
        deadline = time.monotonic() + 30
        while not worker.status()["busy"] and time.monotonic() < deadline:
            time.sleep(0.01)
        for t in threads[1:]:
            t.start()
        while worker.status()["queued"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        full = complete(c, max_tokens=4)
        err = assert_error(full, 429)
        assert err["type"] == "rate_limit_error" and int(full.headers["Retry-After"]) >= 1
        release.set()
        for t in threads:
            t.join(60)
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert complete(c, max_tokens=4).status_code == 200


def test_a_cancelled_job_frees_the_decoder_within_one_round(tiny, monkeypatch):
    """The worker as the app drives it: a long job is cancelled mid-answer (what a client's
    disconnect does); at most the round in flight runs after that, and the next job starts."""
    dec, tok = tiny
    expected = reference(tiny, 8, prompt="x = [")[0]
    marks = []  # ("round" | "end", job prompt length, time)
    real = dec.generate

    def timed(ids, *a, streamer, **k):
        def counted(tokens):
            marks.append(("round", len(ids), time.perf_counter()))
            streamer(tokens)
        try:
            return real(ids, *a, streamer=counted, **k)
        finally:
            marks.append(("end", len(ids), time.perf_counter()))

    monkeypatch.setattr(dec, "generate", timed)
    long_ids, short_ids = tok("def long(x):").input_ids, tok("x = [").input_ids
    assert len(long_ids) != len(short_ids)  # marks tell the jobs apart by prompt length

    async def run():
        worker = DecodeWorker(dec, tok, max_queue=4)
        worker.start()
        loop = asyncio.get_running_loop()
        try:
            long = worker.submit(DecodeRequest("text", long_ids, 1500, 0.0, 0), loop)
            short = worker.submit(DecodeRequest("text", short_ids, 8, 0.0, 0), loop)
            for _ in range(3):  # a few rounds of text, then the client "goes away"
                assert (await asyncio.wait_for(long.next_event(), 30))[0] == "text"
            long.cancel()
            cancelled_at = time.perf_counter()
            event = ("text", None)
            while event[0] == "text":
                event = await asyncio.wait_for(short.next_event(), 30)
            return cancelled_at, event, worker.status()
        finally:
            await asyncio.to_thread(worker.stop)

    cancelled_at, (kind, outcome), status = asyncio.run(run())
    assert kind == "done" and outcome.text == expected
    assert status["cancelled"] == 1 and status["served"] == 1
    long_marks = [(k, t) for k, n, t in marks if n == len(long_ids)]
    rounds = [t for k, t in long_marks if k == "round"]
    ended = long_marks[-1][1]
    assert long_marks[-1][0] == "end" and len(rounds) < 1500 / 2
    after = [t for t in rounds if t > cancelled_at]
    assert len(after) <= 1, f"{len(after)} rounds ran after the cancel"  # the one in flight
    longest = max(b - a for a, b in zip(rounds, rounds[1:]))
    assert ended - cancelled_at <= longest + 0.5, (ended - cancelled_at, longest)
    start = next(t for k, n, t in marks if n == len(short_ids))
    assert start >= ended  # one at a time: the next job ran after the cancelled one ended
