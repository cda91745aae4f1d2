"""`dartree generate`: streams the answer as rounds commit it, then prints the stats line."""

import io

import pytest

import torch

from dartree import cli
from dartree.defaults import default_models


class _Recorder(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_generate_streams_then_prints_stats(monkeypatch, capsys):
    out = _Recorder()
    monkeypatch.setattr(cli.sys, "stdout", out)
    code = cli.main(["generate", "--model", "tiny", "--device", "cpu", "--prompt", "def add(a, b):",
                     "--max-new-tokens", "24", "--budget", "8"])
    assert code == 0
    text = out.getvalue()
    target, drafter, tokenizer = default_models("tiny", device="cpu")
    ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
    expected = "def add(a, b):" + tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.rstrip("\n") == expected
    assert len([w for w in out.writes if w.strip()]) > 2  # streamed in pieces, not at the end
    assert "tokens in" in capsys.readouterr().err


def test_generate_compiled_gives_the_same_text(capsys):
    base = ["generate", "--model", "tiny", "--device", "cpu", "--prompt", "def add(a, b):",
            "--max-new-tokens", "16", "--budget", "8"]
    texts = []
    for flag in ("off", "on"):
        assert cli.main(base + ["--compile", flag]) == 0
        out = capsys.readouterr()
        texts.append(out.out)
    assert texts[0] == texts[1]
    assert "compiling" in out.err  # the compiled run reports its compile time


def test_generate_default_auto_budget_and_the_other_modes_give_the_same_text(capsys):
    """By default each round's budget is chosen (--budget auto) with lookup branches (--ngram);
    a fixed budget with and without the fallback, --no-ngram and --method ngram give the same
    text; the stats line splits the rounds and counts accepted tokens by source."""
    base = ["generate", "--model", "tiny", "--device", "cpu", "--prompt", "def add(a, b):",
            "--max-new-tokens", "32"]
    runs = {}
    for name, extra in [("auto", []), ("fixed", ["--budget", "8"]),
                        ("no-fallback", ["--budget", "8", "--no-fallback"]),
                        ("no-ngram", ["--no-ngram"]), ("ngram", ["--method", "ngram"])]:
        assert cli.main(base + extra) == 0
        runs[name] = capsys.readouterr()
    assert len({r.out for r in runs.values()}) == 1
    for name, run in runs.items():
        assert "one-token; accepted: drafter" in run.err and "lookup" in run.err, name
    assert "[ngram]" in runs["ngram"].err and "accepted: drafter 0," in runs["ngram"].err


@pytest.mark.parametrize("budget", ["0x", "best", "1.5"])
def test_generate_refuses_a_bad_budget(budget, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", "tiny", "--prompt", "x", "--budget", budget])
    assert "must be an int >= 1 or auto" in capsys.readouterr().err


def test_prompt_ids_uses_the_chat_template_unless_raw():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, return_tensors):
            assert messages == [{"role": "user", "content": "hi"}] and add_generation_prompt
            return {"input_ids": torch.tensor([[1, 2, 3]])}

        def __call__(self, text, return_tensors):
            class Enc:
                input_ids = torch.tensor([[9]])
            return Enc()

    assert cli.prompt_ids(Tok(), "hi").tolist() == [[1, 2, 3]]
    assert cli.prompt_ids(Tok(), "hi", raw=True).tolist() == [[9]]


@pytest.mark.parametrize("weights,packed", [("auto", True), ("packed", True), ("dequantized", False)])
def test_generate_answers_through_the_gguf_file_packed_by_default_on_a_cpu(capsys, monkeypatch, weights, packed):
    pytest.importorskip("gguf")
    from dartree import defaults

    loaded = []
    real = defaults.default_models
    monkeypatch.setattr(defaults, "default_models", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    code = cli.main(["generate", "--weights", weights, "--device", "cpu", "--prompt", "What is 2+3?",
                     "--max-new-tokens", "6", "--method", "dartree", "--budget", "2"])
    out = capsys.readouterr()
    assert code == 0 and "tokens in" in out.err + out.out
    target = loaded[0][0]
    assert any(type(m).__name__ == "PackedLinear" for m in target.modules()) == packed
