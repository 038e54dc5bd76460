"""Private run directories of the sidecars the engine commands start: those left behind when
the frontend and its sidecar were both SIGKILLed are swept at the next start; no directory a
process may still use is touched."""

import os
import subprocess
import sys

import pytest

from telemetry.sidecar import run_dirs
from telemetry.sidecar.process import start_sidecar
from telemetry.sidecar.run_dirs import PIDS_FILE, sweep_orphaned_run_dirs

pytestmark = pytest.mark.live


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def run_dir(parent, name, pids_text=None):
    path = parent / name
    path.mkdir(mode=0o700)
    (path / "telemetry.sock").write_text("")  # stands for the socket
    if pids_text is not None:
        (path / PIDS_FILE).write_text(pids_text)
    return path


def test_only_directories_whose_processes_are_all_gone_are_swept(tmp_path):
    gone = dead_pid()
    orphan = run_dir(tmp_path, "iterscope-orphan", f"{gone}\n")
    kept = [
        run_dir(tmp_path, "iterscope-live", f"{os.getpid()}\n"),
        run_dir(tmp_path, "iterscope-half", f"{gone}\n{os.getpid()}\n"),  # its sidecar lives
        run_dir(tmp_path, "iterscope-no-marker"),  # made before pids files, or by hand
        run_dir(tmp_path, "iterscope-empty", ""),
        run_dir(tmp_path, "iterscope-garbled", "not a pid\n"),
        run_dir(tmp_path, "iterscope-group", "0\n"),  # kill(0) would mean our own group
        run_dir(tmp_path, "other-prefix", f"{gone}\n"),
    ]
    (tmp_path / "iterscope-link").symlink_to(orphan)
    assert sweep_orphaned_run_dirs([str(tmp_path)]) == [str(orphan)]
    assert not orphan.exists()
    assert all(path.exists() for path in kept)
    assert (tmp_path / "iterscope-link").is_symlink()


def test_a_started_sidecar_names_both_processes_and_a_new_start_sweeps_orphans(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(run_dirs.tempfile, "tempdir", str(tmp_path))
    orphan = run_dir(tmp_path, "iterscope-orphan", f"{dead_pid()}\n")
    sidecar = start_sidecar(["--no-metrics", "--no-log"])
    try:
        assert not orphan.exists()
        assert os.path.dirname(sidecar.run_dir) == str(tmp_path)
        pids_path = os.path.join(sidecar.run_dir, PIDS_FILE)
        with open(pids_path) as file:
            assert file.read().split() == [str(os.getpid()), str(sidecar.pid)]
        assert sweep_orphaned_run_dirs([str(tmp_path)]) == []  # in use: kept
    finally:
        sidecar.stop()
    assert not os.path.exists(sidecar.run_dir)
