"""The private run directories of the sidecars the engine commands start
(telemetry/sidecar/process.py): making one, and sweeping those left by killed runs.

Each sidecar gets a fresh 0700 directory holding its ipc socket, so two engines started side
by side never share a lane by accident. Whoever stops the sidecar removes it: ``stop()``, or
the sidecar itself when the process that started it goes away. When both are killed
(SIGKILL) nobody can: the directory's ``pids`` file names the processes that use it (the
starting process and its current sidecar), and the next start of a sidecar removes such
directories once none of those processes lives.

Invariant: a sweep removes only what is surely ours and unused (a real directory of this
uid, named RUN_DIR_PREFIX..., whose ``pids`` file names only processes that are gone);
anything unreadable or unexpected is left alone, since leaking a directory is harmless and
removing a live sidecar's socket is not.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable

MAX_IPC_PATH = 100  # sockaddr_un holds 107 bytes
SOCKET_FILE = "telemetry.sock"  # in the run directory: the lane's ipc socket
RUN_DIR_PREFIX = "iterscope-"
# In the run directory: the pids of the processes using it, one a line. The standalone
# sidecar's default lane directory shares the prefix but has no such file: never swept.
PIDS_FILE = "pids"

logger = logging.getLogger("iterscope.telemetry")


def make_private_run_dir() -> str:
    """A fresh 0700 directory for the ipc socket, its ``pids`` file naming this process;
    orphaned ones left by killed runs are swept first."""
    sweep_orphaned_run_dirs()
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    if len(run_dir) + len(SOCKET_FILE) + 1 > MAX_IPC_PATH:  # a long TMPDIR
        os.rmdir(run_dir)
        run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir="/tmp")
    write_pids(run_dir, [os.getpid()])
    return run_dir


def write_pids(run_dir: str, pids: Iterable[int]) -> None:
    """Replace the run directory's ``pids`` file at once: a sweep never reads half of it."""
    path = os.path.join(run_dir, PIDS_FILE)
    with open(path + ".new", "w") as file:
        file.write("".join(f"{pid}\n" for pid in pids))
    os.replace(path + ".new", path)


def sweep_orphaned_run_dirs(parents: Iterable[str] | None = None) -> list[str]:
    """Remove the private run directories in ``parents`` (default: where
    ``make_private_run_dir`` makes them) that no living process uses; the paths removed."""
    if parents is None:
        parents = dict.fromkeys([tempfile.gettempdir(), "/tmp"])
    removed = []
    for parent in parents:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            path = os.path.join(parent, name)
            if name.startswith(RUN_DIR_PREFIX) and is_orphaned_run_dir(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if removed:
        logger.info(
            "removed %d sidecar run directories left by killed processes: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed


def is_orphaned_run_dir(path: str) -> bool:
    """True only when the directory is surely one of ours and unused: a real directory of
    this uid whose ``pids`` file names at least one pid and no process that may live.
    Anything unreadable or unexpected counts as in use: leaking a directory is harmless,
    removing a live sidecar's socket is not."""
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        with open(os.path.join(path, PIDS_FILE)) as file:
            pids = [int(line) for line in file.read().split()]
    except (OSError, ValueError):
        return False
    return bool(pids) and all(pid > 0 and not _may_be_alive(pid) for pid in pids)


def _may_be_alive(pid: int) -> bool:
    """A process with this pid exists (another user's, a zombie, or a reused pid count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
