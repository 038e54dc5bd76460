"""The README's by-hand commands work as written in a fresh shell after `make demo`.

The test reads the sh block after "Then, by hand:" in README.md and runs its lines, each in a
new `bash --noprofile --norc` with a bare environment (no activated virtual environment, a
PATH of the system's directories only), from a directory laid out like the repository root
(its `.venv`). The serve line runs in the background, as in its own terminal; the others run
in order while it serves, then serve is stopped. Three changes keep the run bounded and free
of clashes with other servers on the machine, and leave the commands otherwise as written:
port 8000 becomes a free port, serve's sidecar gets `--metrics-port 0`, and bench gets fewer
and shorter prompts (flags appended: the last of a repeated flag wins).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from bench.vllm_server import wait_healthy
from engine.model.kernels import cpu_build
from tests.helpers.net import free_port

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[1]
README_PORT = "8000"
BENCH_BOUNDS = " --num-prompts 4 --random-input-len 32 --random-output-len 8"
SERVE_READY_S = 240
COMMAND_TIMEOUT_S = 240


def by_hand_commands(readme: str) -> list[str]:
    """The command lines of the sh block after "Then, by hand:", trailing comments cut."""
    match = re.search(r"Then, by hand:\n\n```sh\n(.*?)```", readme, re.S)
    assert match, "README.md has no sh block after 'Then, by hand:'"
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in match[1].splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def fresh_shell(command: str, cwd: Path, **popen_args) -> subprocess.Popen:
    """``command`` in a new non-login, non-interactive bash with a bare environment."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(cwd),
        # Where this checkout's code is; in CI it is also what .venv's editable install names.
        "PYTHONPATH": str(REPO),
        # The CPU kernels `make demo` built, which a user's own home keeps (~10 s of gcc).
        "ITERSCOPE_KERNEL_CACHE": str(cpu_build.kernel_cache_dir()),
    }
    return subprocess.Popen(
        ["bash", "--noprofile", "--norc", "-c", command], cwd=cwd, env=env, text=True, **popen_args
    )


def run(command: str, cwd: Path) -> str:
    shell = fresh_shell(command, cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output, _ = shell.communicate(timeout=COMMAND_TIMEOUT_S)
    assert shell.returncode == 0, f"{command!r} exited {shell.returncode}:\n{output}"
    return output


def test_readme_commands_run_in_a_fresh_shell(tmp_path):
    commands = by_hand_commands((REPO / "README.md").read_text())
    serve_line, *client_lines = commands
    assert " serve " in serve_line and client_lines, commands
    (tmp_path / ".venv").symlink_to(REPO / ".venv")  # what `make demo` leaves in the root
    port = free_port()
    serve_command = serve_line.replace(README_PORT, str(port)) + " --metrics-port 0"
    serve_log = (tmp_path / "serve.log").open("w")
    serve = fresh_shell(
        f"exec {serve_command}",
        tmp_path,
        stdout=serve_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    outputs = {}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", serve, tmp_path / "serve.log", SERVE_READY_S)
        for line in client_lines:
            command = line.replace(README_PORT, str(port))
            if " bench " in command:
                command += BENCH_BOUNDS
            outputs[line] = run(command, tmp_path)
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        serve_log.close()
    bench_output = next(out for line, out in outputs.items() if " bench " in line)
    assert re.search(r"Successful requests:\s+4\n", bench_output), bench_output
    explain_output = next(out for line, out in outputs.items() if " explain " in line)
    assert "smollm2" in explain_output, explain_output  # it read the recording of serve


def test_the_fresh_shell_has_no_iterscope_on_its_path():
    """What makes the test above meaningful: its shells do not inherit an activated
    environment, so a bare `iterscope` line in the README would fail there."""
    shell = fresh_shell("command -v iterscope", REPO, stdout=subprocess.PIPE)
    shell.communicate(timeout=10)
    assert shell.returncode != 0, "iterscope is on the bare PATH: the test proves nothing"
