"""The offline training prompts: deterministic per seed, every template filled, evaluation
prompts filtered out."""

import json
import re

from dartree import instructions


def test_general_prompts_are_deterministic():
    assert instructions.general_prompts(60, seed=1) == instructions.general_prompts(60, seed=1)
    assert not [p for p in instructions.general_prompts(60) if re.search(r"\{[a-z]+\}", p)]


def test_holdout_filter_drops_equal_containing_and_contained_prompts():
    evaluation = ["Write a haiku about the Moon landing.",
                  "Compose an engaging travel blog post about a recent trip to Hawaii, "
                  "highlighting cultural experiences and must-see attractions."]
    prompts = ["write a  HAIKU about the moon landing.",                  # equal, normalised
               "Please: Write a haiku about the Moon landing. Thanks",    # contains one
               "an engaging travel blog post about a recent trip to Hawaii",  # contained, > 40
               "Hawaii",                                                  # contained but short
               "Explain volcanoes in simple terms."]
    kept, dropped = instructions.holdout_filter(prompts, evaluation)
    assert kept == ["Hawaii", "Explain volcanoes in simple terms."] and dropped == 3


def test_holdout_filter_drops_shared_word_runs():
    evaluation = ["Write a persuasive essay to convince your friend to volunteer as a guest "
                  "speaker at a local event."]
    prompts = ["Hi! Could you write a persuasive essay to convince your friend to volunteer as a "
               "guest speaker, please?",                      # 13 words in a row shared
               "Write a persuasive essay about volunteering."]  # fewer shared in a row
    assert instructions.holdout_filter(prompts, evaluation)[1] == 0
    kept, dropped = instructions.holdout_filter(prompts, evaluation, ngram=13)
    assert kept == prompts[1:] and dropped == 1


def test_sharegpt_turns_reads_whole_records_of_a_cut_file(tmp_path):
    def chat(*turns):
        return {"id": "x", "conversations": [
            {"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]}

    records = [chat("Explain how a hash map works.", "ASSISTANT TEXT", "Now show it in Python.",
                    "...", "A third turn, past max_turns."),
               chat("Explain how a hash map works.", "other"),            # duplicate turn
               chat("Erkläre mir bitte, wie Bäume wachsen, Ähre für Ähre.", "..."),  # not English
               chat("hi", "...", "What is the capital of France?"),         # first turn too short
               chat("What does this error mean: KeyError 'x'?", "...")]
    text = json.dumps(records, indent=2)
    cut = text[:text.rindex('"What does this')]  # the file ends inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    turns, counts = instructions.sharegpt_turns(path, max_turns=2)
    assert turns == [["Explain how a hash map works."],
                     ["Explain how a hash map works.", "Now show it in Python."]]
    assert counts == {"conversations": 4, "human_turns": 5, "not_english": 1, "length": 1,
                      "duplicate": 1, "kept": 2}
    assert all("ASSISTANT" not in t for chat_ in turns for t in chat_)
