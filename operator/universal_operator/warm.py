"""Scheduled warm windows (``scaling.warmSchedule``, issue 23 item 6): when a model keeps at least one replica.

Pure: windows and a ``now`` in, ``(active, next_change)`` out. It imports only the standard library and pydantic,
so the operator (to render min-scale and requeue at the boundary) and the gateway's local mode (to keep the
predictor process up) share one definition, and tests step time by passing ``now``.

A window is the form a platform engineer reads at a glance: ``{days: "Mon-Fri", start: "08:00", end: "18:00",
timeZone: "Europe/Berlin"}``. An ``end`` at or before ``start`` crosses midnight and belongs to the day it
starts on (``Fri 22:00-06:00`` runs into Saturday morning). Daylight saving time is zoneinfo's: a window keeps
its wall-clock times, so it lasts an hour less or more on the days the clocks change; a start inside the
spring-forward gap begins when the gap ends.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_DAY_INDEX = {name.lower(): index for index, name in enumerate(DAY_NAMES)}
#: "HH:MM", 24-hour clock; "24:00" is not accepted (write "00:00", which ends the window at midnight).
CLOCK_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
#: A day, a range of days or a comma-separated list of either: "Mon-Fri", "Sat,Sun", "Mon,Wed-Fri", "*" (every day).
_DAY = "(Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_DAY_RANGE = f"{_DAY}(-{_DAY})?"
DAYS_PATTERN = rf"^(\*|{_DAY_RANGE}(,{_DAY_RANGE})*)$"


def parse_days(days: str) -> frozenset[int]:
    """The weekdays (0 = Monday) a ``days`` field names; a range may wrap the week ("Fri-Mon")."""
    if not re.fullmatch(DAYS_PATTERN, days):
        raise ValueError(
            f"warmSchedule days {days!r} is not a day list; write days as Mon..Sun, ranges and commas, "
            'e.g. "Mon-Fri", "Sat,Sun" or "*" for every day'
        )
    if days == "*":
        return frozenset(range(7))
    chosen: set[int] = set()
    for part in days.split(","):
        first, _, last = part.partition("-")
        start = _DAY_INDEX[first.lower()]
        stop = _DAY_INDEX[(last or first).lower()]
        chosen.update((start + offset) % 7 for offset in range((stop - start) % 7 + 1))
    return frozenset(chosen)


def _parse_clock(value: str, field: str) -> time:
    if not re.fullmatch(CLOCK_PATTERN, value):
        raise ValueError(
            f'warmSchedule {field} {value!r} is not a time of day; write HH:MM on a 24-hour clock, e.g. "08:00"'
        )
    hours, minutes = value.split(":")
    return time(int(hours), int(minutes))


class WarmWindow(BaseModel):
    """One recurring window during which the model keeps at least one replica."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    days: str = Field(
        default="*",
        pattern=DAYS_PATTERN,
        max_length=64,
        description='Days the window starts on: Mon..Sun, ranges and commas ("Mon-Fri", "Sat,Sun"); "*" is every day.',
    )
    start: str = Field(pattern=CLOCK_PATTERN, description='Start, HH:MM wall-clock time in timeZone, e.g. "08:00".')
    end: str = Field(
        pattern=CLOCK_PATTERN,
        description="End, HH:MM in timeZone; at or before start the window crosses midnight into the next day.",
    )
    time_zone: str = Field(
        default="UTC", max_length=64, description='IANA time zone, e.g. "Europe/Berlin". Default UTC.'
    )

    @field_validator("days")
    @classmethod
    def _days(cls, value: str) -> str:
        parse_days(value)
        return value

    @field_validator("start", "end")
    @classmethod
    def _clock(cls, value: str, info: object) -> str:
        _parse_clock(value, getattr(info, "field_name", "time"))
        return value

    @field_validator("time_zone")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError) as error:
            raise ValueError(
                f"warmSchedule timeZone {value!r} is not a known IANA time zone; write one such as "
                '"Europe/Berlin", "America/New_York" or "UTC"'
            ) from error
        return value

    def occurrences(self, around: datetime) -> list[tuple[datetime, datetime]]:
        """The window's UTC intervals starting from a day before ``around`` to eight days after it."""
        zone = ZoneInfo(self.time_zone)
        start_clock = _parse_clock(self.start, "start")
        end_clock = _parse_clock(self.end, "end")
        days = parse_days(self.days)
        today = around.astimezone(zone).date()
        intervals = []
        for offset in range(-1, 9):
            day: date = today + timedelta(days=offset)
            if day.weekday() not in days:
                continue
            end_day = day if end_clock > start_clock else day + timedelta(days=1)
            # zoneinfo resolves wall-clock times: fold=0 maps a time in the spring gap past the gap, and an
            # ambiguous autumn time to its first occurrence.
            begins = datetime.combine(day, start_clock, tzinfo=zone).astimezone(UTC)
            ends = datetime.combine(end_day, end_clock, tzinfo=zone).astimezone(UTC)
            if ends > begins:
                intervals.append((begins, ends))
        return intervals


def warm_at(schedule: list[WarmWindow], now: datetime) -> tuple[bool, datetime | None]:
    """Whether ``now`` lies in a window, and when that next changes (UTC; None when it never does).

    Overlapping or touching windows merge, so ``next_change`` is a real change, not a boundary between two windows.
    """
    if now.tzinfo is None:
        raise ValueError("warm_at needs an aware datetime; pass datetime.now(UTC) or a clock's aware time")
    now = now.astimezone(UTC)
    intervals = sorted(interval for window in schedule for interval in window.occurrences(now))
    merged: list[list[datetime]] = []
    for begins, ends in intervals:
        if merged and begins <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], ends)
        else:
            merged.append([begins, ends])
    for begins, ends in merged:
        if begins <= now < ends:
            return True, ends
        if begins > now:
            return False, begins
    return False, None
