"""Answer shards (dartree.train.answer_shards): rows round-trip, keys are stable and tell sources
and turns apart, ShareGPT prompt ids are refused, ids that do not fit uint16 are refused."""

import pytest

from dartree.train.answer_shards import (AnswerRow, prompt_crc, prompt_key, read_shard,
                                         read_shards, write_shard)


def _row(turns, source, answer, prompt=None):
    ids = prompt or [5, 6, 7]
    return AnswerRow(prompt_key(turns, source), source, len(turns), len(ids), prompt_crc(ids),
                     answer, prompt)


def test_rows_round_trip(tmp_path):
    rows = [_row(["Hi"], "sharegpt", [1, 65535, 2]),
            _row(["Hi", "More?"], "sharegpt", []),
            _row(["def f():"], "code", [9] * 300, prompt=[3, 4, 65000])]
    write_shard(tmp_path / "turn1-00000.npz", rows[:2])
    write_shard(tmp_path / "turn2-00000.npz", rows[2:])
    assert read_shard(tmp_path / "turn1-00000.npz") == rows[:2]
    assert read_shards(tmp_path) == {r.key: r for r in rows}
    assert not list(tmp_path.glob("*.tmp"))
    assert read_shards(tmp_path / "missing") == {}


def test_keys_are_stable_and_distinct():
    key = prompt_key(["Write a poem.", "Shorter."], "sharegpt")
    assert key == prompt_key(["Write a poem.", "Shorter."], "sharegpt") and len(key) == 40
    assert len({key, prompt_key(["Write a poem.", "Shorter."], "magpie"),
                prompt_key(["Write a poem."], "sharegpt"),
                prompt_key(["Write a poem.Shorter."], "sharegpt")}) == 4
    assert prompt_crc([1, 2]) != prompt_crc([2, 1])


def test_bad_rows_are_refused(tmp_path):
    with pytest.raises(ValueError, match="prompts from 'sharegpt' must not be stored"):
        write_shard(tmp_path / "a.npz", [_row(["Hi"], "sharegpt", [1], prompt=[1, 2])])
    with pytest.raises(ValueError, match=r"answers must be token ids in \[0, 65535\]"):
        write_shard(tmp_path / "a.npz", [_row(["Hi"], "code", [65536])])
    with pytest.raises(ValueError, match="file must end in .npz"):
        write_shard(tmp_path / "a.pt", [_row(["Hi"], "code", [1])])
    with pytest.raises(ValueError, match="turns must be a non-empty list of strings"):
        prompt_key([], "code")
    assert not list(tmp_path.iterdir())
