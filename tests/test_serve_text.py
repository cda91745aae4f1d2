"""dartree.serve.text.AnswerText: pieces that join to the whole decode, cut at stop strings."""

import pytest

from dartree.serve.text import AnswerText


class CharTokenizer:
    """Token i decodes to PIECES[i]; token 9 is half a character (U+FFFD until token 10 follows)."""

    PIECES = {0: "", 1: "a", 2: "b", 3: "c", 4: " ", 5: "EN", 6: "D", 7: "xy", 8: "\n"}

    def decode(self, tokens, skip_special_tokens=True):
        out = ""
        for i, t in enumerate(tokens):
            if t == 9:
                out += "é" if i + 1 < len(tokens) and tokens[i + 1] == 10 else "\ufffd"
            elif t != 10:
                out += self.PIECES[t]
        return out


def run(stop, rounds):
    text = AnswerText(CharTokenizer(), stop)
    pieces = []
    for tokens in rounds:
        pieces.append(text.add(tokens))
        if text.stopped:
            break
    pieces.append(text.finish())
    return text, pieces


def test_pieces_join_to_the_whole_decode_without_stop_strings():
    rounds = [[1, 2], [9], [10, 3], [4, 7, 8]]
    text, pieces = run([], rounds)
    assert "".join(pieces) == text.text == "abéc xy\n"
    assert pieces[1] == ""  # half a character is held until it is whole
    assert not text.stopped and text.tokens == [t for r in rounds for t in r]


def test_a_stop_string_across_rounds_cuts_the_text_and_the_tokens():
    # "END" arrives as "EN" then "D": "EN" is held back (it may begin the stop string)
    text, pieces = run(["END"], [[1, 2], [4, 5], [6, 3, 1], [2]])
    assert text.stopped
    assert text.text == "".join(pieces) == "ab "
    assert pieces[1] == " "  # "EN" held
    assert text.tokens == [1, 2, 4, 5, 6]  # up to the token that completed "END"; 3, 1 dropped


def test_held_text_is_released_when_the_stop_string_does_not_follow():
    text, pieces = run(["END"], [[1, 5], [3]])
    assert not text.stopped
    assert pieces == ["a", "ENc", ""]
    assert text.text == "aENc"


def test_the_earliest_stop_string_wins_and_finish_releases_the_rest():
    text, pieces = run(["c", "b"], [[1, 7, 2, 3]])
    assert text.text == "axy" and text.tokens == [1, 7, 2] and text.stopped
    text, pieces = run(["zz"], [[1, 2]])
    assert pieces == ["ab", ""] and text.text == "ab"


def test_add_after_a_stop_is_refused():
    text, _ = run(["a"], [[1]])
    with pytest.raises(RuntimeError, match="after a stop string"):
        text.add([2])
