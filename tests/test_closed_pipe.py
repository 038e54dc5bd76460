"""Commands that print stop quietly when their reader goes away (`... | head -1`)."""

import os
import subprocess
import sys

import pytest
from scenarios import synthetic
from scenarios.synthetic import Simulator, arrivals

pytestmark = pytest.mark.live

NUM_ENGINES = 40  # enough text (well over a pipe's 64 KiB buffer) that printing outlives head


def test_explain_into_head_exits_without_a_traceback(tmp_path):
    messages = []
    for engine_index in range(NUM_ENGINES):
        sim = Simulator(cost=synthetic.STORY_COST, engine_index=engine_index)
        sim.add_requests(arrivals(4, 3), num_prompt=64, num_output=20)
        messages += sim.run(4).messages
    sim.messages = messages
    path = sim.write(tmp_path / "many.jsonl")
    command = f"{sys.executable} -m engine.entrypoints.cli explain --all {path} | head -1"
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=120,
    )
    assert result.stdout.startswith("iterscope explain: 1 file,")
    assert result.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored"
    assert result.returncode == 1  # pipefail: explain's own status, not head's
