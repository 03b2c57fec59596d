"""A transcript's segments as subtitles: SubRip (``srt``) and WebVTT (``vtt``), as OpenAI's audio API writes them."""

from __future__ import annotations

from collections.abc import Sequence

from universal_predictors.speech.whisper import Segment


def _clock(seconds: float, separator: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    whole, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{whole:02d}{separator}{millis:03d}"


def srt(segments: Sequence[Segment]) -> str:
    """SubRip: numbered cues from 1, ``HH:MM:SS,mmm`` times, a blank line after each cue."""
    cues = [
        f"{number}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
        for number, s in enumerate(segments, start=1)
    ]
    return "\n".join(cues) + ("\n" if cues else "")


def vtt(segments: Sequence[Segment]) -> str:
    """WebVTT: the ``WEBVTT`` header, then cues with ``HH:MM:SS.mmm`` times, a blank line after each."""
    cues = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n" for s in segments]
    return "WEBVTT\n\n" + "".join(cues)
