"""The predictor's start-up clock: the weights phase reads only what the page cache lacks; the first answer once."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from universal_predictors import wake_phases


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_weights_on_disk_are_read_once_and_weights_in_the_page_cache_are_not(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(4 << 20))
    (tmp_path / "config.json").write_text("{}")
    assert wake_phases.weight_files(str(tmp_path)) == [weights]
    assert wake_phases.weight_files(str(weights)) == [weights]
    assert wake_phases.weight_files("org/a-hub-name") == []

    _evict(weights)
    clock = wake_phases.WakePhases()
    assert clock.read_weights(str(tmp_path)) == 4 << 20
    assert wake_phases.resident_fraction(weights) == 1.0
    assert clock.read_weights(str(tmp_path)) == 0  # now the kernel holds it: nothing to read
    _evict(weights)
    assert wake_phases.resident_fraction(weights) == 0.0  # (a probe may start the kernel's readahead)
    assert clock.seconds["weights"] > 0


def test_the_engine_phase_is_what_imports_and_weights_leave_and_the_first_answer_counts_once() -> None:
    clock = wake_phases.WakePhases()
    clock.start(count_process=False)
    clock.seconds["weights"] = 0.0
    phases = clock.ready()
    assert set(phases) == {"process", "imports", "weights", "engine"}
    assert phases["engine"] >= 0
    assert clock.first_answer(0.25) is True
    assert clock.first_answer(0.5) is False
    assert clock.seconds["first_inference"] == 0.25


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read as another user")
def test_a_pods_user_reading_a_read_only_volume_sees_an_evicted_file_as_not_cached() -> None:
    # mincore(2) would say "resident" for every page here (Linux 5.0+, a file the caller may not write).
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        folder.chmod(0o755)
        weights = folder / "model.safetensors"
        weights.write_bytes(os.urandom(4 << 20))
        weights.chmod(0o444)
        _evict(weights)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the pod's user: not the file's owner, no write permission
            try:
                os.setgid(1000)
                os.setuid(1000)
                os.write(write, str(wake_phases.resident_fraction(weights)).encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(child, 0)
        with os.fdopen(read) as seen:
            assert float(seen.read()) < 0.5
    finally:
        shutil.rmtree(folder)
