"""Stop strings matched across token boundaries: a possible prefix of a stop is held back until it
cannot be one, and nothing from a stop string on is ever emitted.

The output stops where a stop string is first completed (of two that complete at the same character,
the longer), so the result is the same however the text arrives in pieces."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds stop strings in streamed text across token boundaries; holds back a possible prefix."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.held = ""
        #: The stop string that ended the output, once one has.
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was found (emission ends there)."""
        if not self.stops:
            return text, False
        buffer = self.held + text
        hits = [(i + len(s), i, s) for s, i in ((s, buffer.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            _, start, self.matched = min(hits)
            return buffer[:start], True
        keep = 0
        for stop in self.stops:  # the longest buffer suffix that could still grow into a stop string
            for size in range(min(len(stop) - 1, len(buffer)), 0, -1):
                if buffer.endswith(stop[:size]):
                    keep = max(keep, size)
                    break
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """What is held at the end of the output (it did not become a stop string)."""
        held, self.held = self.held, ""
        return held
