"""Any GGUF file from the command line: `dartree generate --target FILE.gguf` and `dartree bench
--target FILE.gguf` load it packed with the tokenizer and chat template of its metadata and, without
a drafter, decode with the drafter-free method ngram. The files are written here: a random tiny
Qwen2 and Llama in llama.cpp's Q4_K_M mix (Q4_K, Q6_K for attn_v, ffn_down and the output; F32
norms), each with a byte-level BPE tokenizer and a chat template."""

import json

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from dartree import cli  # noqa: E402
from dartree.gguf import PackedLinear, load_gguf  # noqa: E402
from dartree.model_files import gguf_tokenizer  # noqa: E402
from dartree.testing import write_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# ffn 256: ffn_down in Q6_K, as llama.cpp's Q4_K_M has it
SHAPE = dict(ffn=256)
PROMPT = "What is the capital of France? The capital of France is"


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def gguf_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.Q4_K_M.gguf"
    write_gguf(path, request.param, seed=11, shape=SHAPE, tokenizer=True)
    return path


def test_the_file_holds_a_q4_k_m_mix_and_a_chat_tokenizer(gguf_file):
    model = load_gguf(gguf_file)
    types = {n: m.qtype for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert set(types.values()) == {"Q4_K", "Q5_K", "Q6_K"}
    assert types["lm_head"] == "Q6_K" and types["model.layers.0.mlp.down_proj"] == "Q6_K"
    tokenizer = gguf_tokenizer(gguf_file)
    ids = tokenizer(PROMPT).input_ids
    assert tokenizer.decode(ids) == PROMPT and len(ids) < len(PROMPT)  # merges apply
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "hi" in chat and "assistant" in chat and tokenizer.eos_token in tokenizer.get_vocab()


def _greedy_text(path, max_new_tokens):
    """The packed model's own greedy answer (transformers' generate) to PROMPT as a chat."""
    model, tokenizer = load_gguf(path), gguf_tokenizer(path)
    ids = cli.prompt_ids(tokenizer, PROMPT)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_generate_answers_a_gguf_file_through_ngram(gguf_file, capsys):
    args = ["generate", "--target", str(gguf_file), "--device", "cpu", "--prompt", PROMPT,
            "--max-new-tokens", "24"]
    assert cli.main(args) == 0
    run = capsys.readouterr()
    assert "[ngram]" in run.err and "accepted: drafter 0," in run.err  # no drafter: ngram
    assert run.out.rstrip("\n") == _greedy_text(gguf_file, 24)
    assert cli.main(args + ["--budget", "4"]) == 0  # a fixed budget: the same answer
    assert capsys.readouterr().out == run.out


def test_generate_with_a_drafter_method_but_no_drafter_is_refused(gguf_file):
    with pytest.raises(SystemExit, match="method 'dartree' needs a drafter"):
        cli.main(["generate", "--target", str(gguf_file), "--device", "cpu", "--prompt", "x",
                  "--method", "dartree"])


def test_packed_weights_need_a_gguf_file(tmp_path, capsys):
    from dartree import bench

    for target in (["--model", "tiny"], ["--target", str(tmp_path)]):
        assert cli.main(["generate", *target, "--weights", "packed", "--device", "cpu",
                         "--prompt", "x"]) == 2
        assert "error: --weights packed needs a GGUF file" in capsys.readouterr().err
        assert bench.main([*target, "--weights", "packed", "--out", str(tmp_path / "out")]) == 2
        assert "error: --weights packed needs a GGUF file" in capsys.readouterr().err


def test_a_damaged_gguf_target_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "cut.gguf"
    write_gguf(tmp_path / "whole.gguf", "qwen2", shape=SHAPE, tokenizer=True)
    path.write_bytes((tmp_path / "whole.gguf").read_bytes()[:-100])
    assert cli.main(["generate", "--target", str(path), "--device", "cpu", "--prompt", "x"]) == 2
    assert "is truncated: tensor output.weight ends at byte" in capsys.readouterr().err


def test_bench_runs_ar_and_ngram_on_a_gguf_file(gguf_file, tmp_path):
    from dartree import bench

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
    out = tmp_path / "out"
    code = bench.main(["--target", str(gguf_file), "--prompts", str(tmp_path / "p.jsonl"),
                       "--budgets", "4,auto", "--temperatures", "0", "--max-new-tokens", "12",
                       "--llamacpp", "off", "--out", str(out), "--no-plots", "--threads", "1"])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    rows = [(r["method"], r["budget"]) for r in data["rows"]]
    assert rows == [("hf-generate", "-"), ("ar", "-"), ("ngram", "4"), ("ngram", "auto")]
    assert all(r["match_ar"] and r["match_hf"] for r in data["rows"][2:])  # checked in float32
    assert data["models"]["target_packed"] and data["settings"]["prompt_sets"]["p"]["chat_template"]
    model = load_gguf(gguf_file)
    floats = sum(p.numel() for p in model.parameters())  # norms and biases: the packed weights'
    assert data["models"]["target_params"] == model.num_parameters() > 100 * floats  # count too
