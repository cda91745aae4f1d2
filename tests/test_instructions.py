"""The offline training prompts: deterministic per seed, every template filled, evaluation
prompts filtered out."""

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
