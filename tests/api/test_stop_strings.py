"""StopStringMatcher against a brute-force reference, over random texts split at random points.

The reference reads the whole text left to right and stops at the first
position where some stop string ends (the longest one on ties); the matcher
sees the same text in random pieces and must give the same final text and
stop string, never release text that is later cut, and hold back only a
suffix that could still grow into a stop string.
"""

from __future__ import annotations

import random

import pytest

from jaxserve.api.stop_strings import StopStringMatcher


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """(final text, matched stop) by trying every end position in order."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[:end] if include else text[:end - len(stop)], stop
    return text, None


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(0, 8))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run(matcher: StopStringMatcher, pieces: list[str], stops: list[str], include: bool,
        check_hold: bool = True) -> tuple[str, str | None]:
    released, pushed = "", ""
    for piece in pieces:
        pushed += piece
        out, stop = matcher.push(piece)
        released += out
        if stop is not None:
            return released, stop
        held = pushed[len(released):]
        if check_hold:
            max_hold = 0 if include else max(len(s) for s in stops) - 1
            assert len(held) <= max_hold
            # Held text could still grow into a stop string (and is the longest such suffix).
            assert not held or any(s.startswith(held) and s != held for s in stops)
            longer = pushed[len(released) - 1:] if released and not include else None
            if longer and len(longer) < max(len(s) for s in stops):
                assert not any(s.startswith(longer) for s in stops)
    return released + matcher.flush(), None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("include", [False, True])
def test_matches_reference_on_random_pieces(seed, include):
    rng = random.Random(seed * 2 + include)
    alphabet = "ab c\n界😀"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
                      for _ in range(rng.randrange(1, 4))})
        if rng.random() < 0.5:  # make a match likely: a substring of the text
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randrange(1, 6)])
        expected = reference(text, stops, include)
        matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
        got = run(matcher, random_split(rng, text), stops, include)
        assert got == expected, (text, stops)
        assert matcher.text == expected[0] and matcher.matched == expected[1]


def test_stop_spanning_pieces_and_starting_inside_one():
    matcher = StopStringMatcher(["STOP here"])
    pieces = ["Let's ST", "OP", " he", "re now"]
    outs = [matcher.push(p) for p in pieces]
    assert [o.text for o in outs] == ["Let's ", "", "", ""]
    assert outs[-1].stop == "STOP here" and matcher.text == "Let's "
    assert matcher.push("more") == ("", None)  # finished: later text is dropped
    assert matcher.flush() == ""


def test_hold_back_only_possible_beginnings():
    matcher = StopStringMatcher(["abcd", "xyz"])
    assert matcher.push("hello a") == ("hello ", None)  # "a" could begin "abcd"
    assert matcher.push("bx") == ("ab", None)  # "abx" cannot begin a stop; "x" can: held
    assert matcher.push("q") == ("xq", None)
    assert matcher.flush() == ""
    assert matcher.text == "hello abxq"


def test_include_stop_str_in_output_keeps_it_and_holds_nothing():
    matcher = StopStringMatcher(["</s>", "\n\n"], include_stop_str_in_output=True)
    assert matcher.push("one </") == ("one </", None)
    assert matcher.push("s> two") == ("s>", "</s>")
    assert matcher.text == "one </s>"


def test_first_to_complete_wins_then_longest():
    # "b" completes before "abc" does, whatever the pieces.
    for pieces in (["abc"], ["a", "b", "c"], ["ab", "c"]):
        matcher = StopStringMatcher(["abc", "b"])
        assert run(matcher, pieces, ["abc", "b"], False) == ("a", "b")
    # "xab" and "ab" end at the same character: the longer one cuts more.
    matcher = StopStringMatcher(["ab", "xab"])
    assert run(matcher, ["zx", "ab"], ["ab", "xab"], False) == ("z", "xab")


def test_unarmed_text_is_not_matched_but_can_start_a_match():
    matcher = StopStringMatcher(["ab"])
    assert matcher.push("xab", armed=False) == ("xab", None)  # min_tokens not reached
    assert matcher.push("a", armed=False) == ("", None)  # held back all the same
    assert matcher.push("bc") == ("", "ab")  # completes in armed text, starts in unarmed
    assert matcher.text == "xab"


def test_long_text_keeps_a_short_window():
    matcher = StopStringMatcher(["END!"])
    rng = random.Random(7)
    words = ["EN", "D", "E", "lorem ", "ipsum ", "N", "!"]
    text = ""
    while "END!" not in text:
        piece = rng.choice(words)
        text += piece
        out = matcher.push(piece)
        assert len(matcher._buf) <= len("END!") + len(piece) + 3  # bounded, not the whole text
    assert out.stop == "END!" and matcher.text == text[:text.index("END!")]


def test_no_stops_releases_everything():
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == ("abc", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize("bad", [[""], ["ok", ""]])
def test_empty_stop_string_rejected(bad):
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(bad)
