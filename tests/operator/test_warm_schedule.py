"""Scheduled warm windows (issue 23 item 6): parsing, validation and ``warm_at`` across days, midnight and DST."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import yaml
from pydantic import ValidationError

from tests.conftest import embedded_operator, eventually
from tests.factories import CONFIG
from universal_operator.config import OperatorConfig
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.reconcile.status import status_from_inference_service
from universal_operator.spec import UniversalModel, UniversalModelStatus
from universal_operator.warm import WarmWindow, parse_days, warm_at
from universal_simcluster.apiserver import ServedEmulator

BERLIN = ZoneInfo("Europe/Berlin")


def window(**fields: str) -> WarmWindow:
    return WarmWindow.model_validate(fields)


def test_days_ranges_lists_and_wrapping() -> None:
    assert parse_days("Mon-Fri") == {0, 1, 2, 3, 4}
    assert parse_days("Sat,Sun") == {5, 6}
    assert parse_days("Fri-Mon") == {4, 5, 6, 0}
    assert parse_days("Mon,Wed-Thu") == {0, 2, 3}
    assert parse_days("*") == set(range(7))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"days": "Monday", "start": "08:00", "end": "18:00"}, "days"),
        ({"start": "8:00", "end": "18:00"}, "start"),
        ({"start": "08:00", "end": "24:00"}, "end"),
        ({"start": "08:00", "end": "18:00", "timeZone": "Europe/Berln"}, "timeZone"),
        ({"start": "08:00", "end": "18:00", "cron": "* * * * *"}, "cron"),
    ],
)
def test_bad_windows_are_refused_naming_the_field(fields: dict[str, str], named: str) -> None:
    with pytest.raises(ValidationError) as raised:
        window(**fields)
    assert named in str(raised.value)


def test_weekday_window_in_berlin() -> None:
    schedule = [window(days="Mon-Fri", start="08:00", end="18:00", timeZone="Europe/Berlin")]
    # Thursday 2026-12-03 07:59 Berlin (UTC+1): not yet warm; warm from 08:00 Berlin = 07:00 UTC.
    assert warm_at(schedule, datetime(2026, 12, 3, 7, 59, tzinfo=BERLIN)) == (
        False,
        datetime(2026, 12, 3, 7, tzinfo=UTC),
    )
    assert warm_at(schedule, datetime(2026, 12, 3, 12, tzinfo=BERLIN)) == (True, datetime(2026, 12, 3, 17, tzinfo=UTC))
    # Friday evening: the next start is Monday morning, not Saturday.
    assert warm_at(schedule, datetime(2026, 12, 4, 18, tzinfo=BERLIN)) == (False, datetime(2026, 12, 7, 7, tzinfo=UTC))


def test_window_crossing_midnight_belongs_to_its_start_day() -> None:
    schedule = [window(days="Fri", start="22:00", end="06:00")]
    assert warm_at(schedule, datetime(2026, 12, 5, 3, tzinfo=UTC)) == (True, datetime(2026, 12, 5, 6, tzinfo=UTC))
    # Saturday 22:00 is not in the window: Saturday is not listed.
    assert warm_at(schedule, datetime(2026, 12, 5, 23, tzinfo=UTC)) == (False, datetime(2026, 12, 11, 22, tzinfo=UTC))


def test_spring_forward_shortens_the_window_by_an_hour() -> None:
    # Sunday 2026-03-29: Berlin jumps from 02:00 CET to 03:00 CEST.
    schedule = [window(days="Sat", start="20:00", end="08:00", timeZone="Europe/Berlin")]
    active, ends = warm_at(schedule, datetime(2026, 3, 28, 23, tzinfo=UTC))
    assert active
    assert ends == datetime(2026, 3, 29, 6, tzinfo=UTC)  # 08:00 CEST
    assert ends - datetime(2026, 3, 28, 19, tzinfo=UTC) == datetime(2026, 1, 1, 11) - datetime(2026, 1, 1)


def test_autumn_back_keeps_wall_clock_times() -> None:
    # Sunday 2026-10-25: Berlin goes back from 03:00 CEST to 02:00 CET.
    schedule = [window(days="Sun", start="08:00", end="18:00", timeZone="Europe/Berlin")]
    assert warm_at(schedule, datetime(2026, 10, 25, 1, tzinfo=UTC)) == (False, datetime(2026, 10, 25, 7, tzinfo=UTC))
    assert warm_at(schedule, datetime(2026, 10, 18, 1, tzinfo=UTC)) == (False, datetime(2026, 10, 18, 6, tzinfo=UTC))


def test_touching_windows_merge_into_one_change() -> None:
    schedule = [window(start="08:00", end="12:00"), window(start="12:00", end="18:00")]
    assert warm_at(schedule, datetime(2026, 12, 3, 9, tzinfo=UTC)) == (True, datetime(2026, 12, 3, 18, tzinfo=UTC))


def test_no_windows_never_warm_and_naive_time_refused() -> None:
    assert warm_at([], datetime(2026, 12, 3, tzinfo=UTC)) == (False, None)
    with pytest.raises(ValueError, match="aware datetime"):
        warm_at([], datetime(2026, 12, 3))


MINILM = {
    "apiVersion": "serving.universal-runtime.dev/v1alpha1",
    "kind": "UniversalModel",
    "metadata": {"name": "minilm", "namespace": "models"},
    "spec": {"task": "embed", "source": {"uri": "hf://sentence-transformers/all-MiniLM-L6-v2"}},
}


def test_the_model_spec_carries_the_schedule_and_names_a_bad_field() -> None:
    weekdays = {"days": "Mon-Fri", "start": "08:00", "end": "18:00"}
    body = {**MINILM, "spec": {**MINILM["spec"], "scaling": {"warmSchedule": [weekdays]}}}
    assert UniversalModel.model_validate(body).spec.scaling.warm_schedule[0].days == "Mon-Fri"
    mars = {"start": "08:00", "end": "18:00", "timeZone": "Mars/Olympus"}
    body = {**MINILM, "spec": {**MINILM["spec"], "scaling": {"warmSchedule": [mars]}}}
    with pytest.raises(ValidationError, match="timeZone"):
        UniversalModel.model_validate(body)


def test_render_holds_a_replica_inside_the_window_and_none_outside() -> None:
    weekdays = {"days": "Mon-Fri", "start": "08:00", "end": "18:00", "timeZone": "Europe/Berlin"}
    body = {**MINILM, "metadata": {**MINILM["metadata"], "uid": "uid-1", "generation": 1}}
    body["spec"] = {**MINILM["spec"], "scaling": {"minReplicas": 0, "warmSchedule": [weekdays]}}
    model = UniversalModel.model_validate(body)
    inside = desired_inference_service(model, CONFIG, now=datetime(2026, 12, 3, 12, tzinfo=BERLIN))
    outside = desired_inference_service(model, CONFIG, now=datetime(2026, 12, 5, 12, tzinfo=BERLIN))
    assert inside["spec"]["predictor"]["minReplicas"] == 1
    assert outside["spec"]["predictor"]["minReplicas"] == 0


def test_status_says_whether_a_window_is_on_and_when_that_changes() -> None:
    weekdays = {"days": "Mon-Fri", "start": "08:00", "end": "18:00", "timeZone": "Europe/Berlin"}
    body = {**MINILM, "metadata": {**MINILM["metadata"], "uid": "uid-1", "generation": 1}}
    body["spec"] = {**MINILM["spec"], "scaling": {"minReplicas": 0, "warmSchedule": [weekdays]}}
    model = UniversalModel.model_validate(body)
    # Thursday 12:00 in Berlin (11:00 UTC): on, until 18:00 Berlin (17:00 UTC).
    inside = status_from_inference_service(None, model, datetime(2026, 12, 3, 12, tzinfo=BERLIN), config=CONFIG)
    assert inside["warmSchedule"] == {"active": True, "nextChange": "2026-12-03T17:00:00Z"}
    # Saturday: off, until Monday 08:00 Berlin (07:00 UTC).
    weekend = status_from_inference_service(None, model, datetime(2026, 12, 5, 12, tzinfo=BERLIN), config=CONFIG)
    assert weekend["warmSchedule"] == {"active": False, "nextChange": "2026-12-07T07:00:00Z"}
    # The status validates against the model's status schema (what the CRD is generated from).
    UniversalModelStatus.model_validate(inside)
    plain = UniversalModel.model_validate({**body, "spec": MINILM["spec"]})
    assert "warmSchedule" not in status_from_inference_service(None, plain, config=CONFIG)


# -- the boundary itself, through the real operator -------------------------------------------------------------


async def test_the_operator_applies_a_window_at_its_start_not_a_repair_interval_later(
    cluster: ServedEmulator, operator_config: OperatorConfig, tmp_path: Path
) -> None:
    """The operator's clock is two seconds before 08:00 UTC and its repair timer an hour: the child's minReplicas
    goes to 1 when the window opens because the model's boundary daemon reconciles it then."""
    opening = datetime(2026, 12, 7, 8, 0, tzinfo=UTC)
    offset = opening - timedelta(seconds=2) - datetime.now(UTC)
    slow_repairs = operator_config.model_copy(update={"repair_interval_seconds": 3600.0})
    body = {**MINILM, "metadata": {"name": "minilm", "namespace": "default"}}
    window = {"days": "*", "start": "08:00", "end": "09:00", "timeZone": "UTC"}
    body["spec"] = {**MINILM["spec"], "scaling": {"minReplicas": 0, "warmSchedule": [window]}}
    manifest = tmp_path / "minilm.yaml"
    manifest.write_text(yaml.safe_dump(body))
    async with embedded_operator(slow_repairs, clock=lambda: datetime.now(UTC) + offset):
        applied = await cluster.kubectl("apply", "--validate=false", "-f", str(manifest))
        assert applied.returncode == 0, applied.stderr

        def min_replicas() -> int | None:
            child = cluster.emulator.get_object("inferenceservices", "default", "minilm")
            return None if child is None else int(child["spec"]["predictor"].get("minReplicas", 0))

        await eventually(lambda: min_replicas() == 0, within=10)  # before the window
        await eventually(lambda: min_replicas() == 1, within=20)  # at 08:00, not at the next repair (in an hour)

        def warm_status() -> dict[str, Any]:
            model = cluster.emulator.get_object("universalmodels", "default", "minilm") or {}
            return dict((model.get("status") or {}).get("warmSchedule") or {})

        await eventually(lambda: warm_status() == {"active": True, "nextChange": "2026-12-07T09:00:00Z"}, within=20)
