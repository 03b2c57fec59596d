"""Stop strings in streamed text (:class:`StopMatcher`): whatever pieces the text arrives in, what is
emitted is the text up to where the first completed stop string starts, nothing of or after a stop is
emitted, and text is held back only while it could still be the start of a stop."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from universal_predictors.generation.stops import StopMatcher

#: A small alphabet, so that stops overlap, repeat and share prefixes with the text often.
TEXT = st.text(alphabet="ab c\n", max_size=40)
STOPS = st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=5), min_size=1, max_size=4)


@st.composite
def pieces(draw: st.DrawFn) -> list[str]:
    """A text split at arbitrary places (empty pieces included, as an engine may yield them)."""
    text = draw(TEXT)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def expected(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text up to the start of the stop string completed first (the longer one on a tie)."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(found)[1]], True) if found else (text, False)


def run(chunks: list[str], stops: list[str]) -> tuple[str, bool, list[tuple[str, str]]]:
    """Push ``chunks`` as ``run_choice`` does: stop at a hit, flush at the end. Returns the emitted text,
    whether a stop was hit, and (text seen so far, text emitted so far) after each push."""
    matcher = StopMatcher(stops)
    seen = emitted = ""
    progress = []
    for chunk in chunks:
        seen += chunk
        text, stopped = matcher.push(chunk)
        emitted += text
        progress.append((seen, emitted))
        if stopped:
            return emitted, True, progress
    return emitted + matcher.flush(), False, progress


@given(pieces(), STOPS)
def test_the_emitted_text_is_the_text_up_to_the_first_completed_stop_however_it_is_split(
    chunks: list[str], stops: list[str]
) -> None:
    assert run(chunks, stops)[:2] == expected("".join(chunks), stops)


@given(pieces(), STOPS)
def test_nothing_of_a_stop_string_or_after_it_is_ever_emitted(chunks: list[str], stops: list[str]) -> None:
    for seen, emitted in run(chunks, stops)[2]:
        assert seen.startswith(emitted)
        assert not any(s in emitted for s in stops)


@given(pieces(), STOPS)
def test_text_is_held_back_at_most_the_longest_stop_minus_one_character(chunks: list[str], stops: list[str]) -> None:
    longest = max(len(s) for s in stops)
    _, stopped, progress = run(chunks, stops)
    for seen, emitted_so_far in progress[:-1] if stopped else progress:
        assert len(seen) - len(emitted_so_far) <= longest - 1


@given(pieces(), STOPS)
def test_held_text_is_only_a_possible_start_of_a_stop(chunks: list[str], stops: list[str]) -> None:
    _, stopped, progress = run(chunks, stops)
    for seen, emitted_so_far in progress[:-1] if stopped else progress:
        held = seen[len(emitted_so_far) :]
        assert not held or any(s.startswith(held) for s in stops)


def test_without_stops_everything_passes_through_at_once() -> None:
    matcher = StopMatcher([])
    assert matcher.push("Hello") == ("Hello", False)
    assert matcher.flush() == ""


def test_a_stop_split_across_pieces_is_found_and_its_start_never_emitted() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("Oslo</ans") == ("Oslo", False)
    assert matcher.push("wer> and more") == ("", True)
