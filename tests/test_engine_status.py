"""Stalled vs dead from evidence: heartbeats keep coming while the engine loop is stuck (our
engine and its publisher thread), long iterations teach the stall threshold, and a whole
process that is stopped sends nothing at all, so it reads as dead until it resumes."""

import os
import random
import signal
import threading
import time

import pytest

from engine.request import Request, SamplingParams
from telemetry.analysis.stall_rule import STALL_FACTOR, STALL_FLOOR_S
from telemetry.lane.publisher import ZmqPublisher
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.lane_loop import LaneLoop
from tests.helpers.fake_engine import start_engine, stop_engine
from tests.helpers.fake_runner import FakeRunner, make_core
from tests.helpers.lane import RecordingSink, heartbeat, record
from tests.helpers.wait import wait_until

SECOND = 1_000_000_000
IDLE, RUNNING, STALLED, DEAD, CLOSED = (
    EngineStatus.IDLE,
    EngineStatus.RUNNING,
    EngineStatus.STALLED,
    EngineStatus.DEAD,
    EngineStatus.CLOSED,
)


class ScriptedEngine:
    """An engine that heartbeats every second on the ingest clock, and iterates when told."""

    def __init__(self, ingest):
        self.ingest = ingest
        self.now_ns = 0
        self.msg_seq = 0
        self.iteration = 0

    def message(self, make, **fields):
        self.msg_seq += 1
        self.ingest.on_message(make(self.msg_seq, **fields), self.now_ns)

    def run_for(self, seconds, finish_iteration=True):
        """``seconds`` of heartbeats (work in flight, no progress), then one iteration ends."""
        for _ in range(round(seconds * 10)):
            self.now_ns += SECOND // 10
            if self.now_ns % SECOND == 0:
                self.message(heartbeat, last_iteration=self.iteration, waiting=1, running=1)
            self.ingest.tick(self.now_ns)
        if finish_iteration:
            self.iteration += 1
            self.message(record, iteration=self.iteration, num_running_reqs=1, num_waiting_reqs=1)


def statuses(sink):
    return [(status, now_ns) for _, status, now_ns in sink.of("status")]


def test_long_iterations_teach_the_threshold_and_a_real_hang_is_still_stalled():
    """Prefill chunks of 8-13 s on a CPU: after the first, none is called stalled; a hang is,
    once no progress came for STALL_FACTOR x the longest iteration seen."""
    sink = RecordingSink()
    engine = ScriptedEngine(Ingest([sink]))
    engine.message(heartbeat, waiting=1, running=1)
    rng = random.Random(7)
    lengths = [rng.randint(80, 130) / 10 for _ in range(20)]
    engine.run_for(lengths[0])  # nothing learnt yet: stalled after the floor, once
    assert [status for status, _ in statuses(sink)] == [RUNNING, STALLED, RUNNING]
    first_stall_ns = statuses(sink)[1][1]
    assert STALL_FLOOR_S * SECOND < first_stall_ns <= STALL_FLOOR_S * SECOND + SECOND // 10
    for length in lengths[1:]:
        engine.run_for(length)
    assert len(statuses(sink)) == 3  # no flapping
    hang_start_ns = engine.now_ns
    engine.run_for(100, finish_iteration=False)
    stalled_at = statuses(sink)[3]
    longest_ns = max(lengths) * SECOND
    assert stalled_at[0] is STALLED
    assert STALL_FACTOR * longest_ns < stalled_at[1] - hang_start_ns
    assert stalled_at[1] - hang_start_ns <= STALL_FACTOR * longest_ns + 2 * SECOND // 10


def test_a_fixed_stall_after_does_not_adapt():
    sink = RecordingSink()
    engine = ScriptedEngine(Ingest([sink], stall_after_s=5))
    engine.message(heartbeat, waiting=1, running=1)
    for _ in range(3):
        engine.run_for(8)
    assert [status for status, _ in statuses(sink)] == [RUNNING] + [STALLED, RUNNING] * 3


def test_a_silent_pause_is_no_iteration_to_learn_from():
    """A frozen process (SIGSTOP) is dead meanwhile; its pause does not raise the threshold."""
    sink = RecordingSink()
    ingest = Ingest([sink])
    engine = ScriptedEngine(ingest)
    engine.message(heartbeat, waiting=1, running=1)
    engine.run_for(1)
    for _ in range(300):  # 30 s without any message
        engine.now_ns += SECOND // 10
        ingest.tick(engine.now_ns)
    engine.iteration += 1
    engine.message(record, iteration=engine.iteration, num_running_reqs=1, num_waiting_reqs=1)
    assert [status for status, _ in statuses(sink)] == [RUNNING, DEAD, RUNNING]
    state = ingest.engines[0]
    assert state.stall.threshold_ns(engine.now_ns) == STALL_FLOOR_S * SECOND


@pytest.mark.parametrize(
    ("silent_s", "engine_silent_s", "dead"),
    [(2.45, 2.45, False), (2.55, 2.55, True), (2.55, 0.1, False)],
    ids=["shorter", "no-tick-in-it", "the-sidecar-held-up"],
)
def test_a_silence_longer_than_dead_after_is_dead_though_no_tick_fell_in_it(
    silent_s, engine_silent_s, dead
):
    """Ticks come every 0.1 s: one 2.55 s after the last message may miss the 50 ms when the
    engine was dead. The next message says so, where the engine's own clock shows the silence
    too: dead until it came (as explain calls every silence over --dead-after), then running.
    2.45 s is no silence; nor are messages that waited while the sidecar itself was held up
    (their engine times 0.1 s apart)."""
    sink = RecordingSink()
    ingest = Ingest([sink], dead_after_s=2.5)
    engine = ScriptedEngine(ingest)
    engine.message(heartbeat, waiting=1, running=1)
    engine.run_for(1)  # its last message: the iteration's record, ending at the engine's 3100 ns
    ingest.tick(engine.now_ns + 2_400_000_000)  # the last tick before the next message
    engine.now_ns += int(silent_s * SECOND)
    engine.msg_seq += 1
    message = record(engine.msg_seq, iteration=2, num_running_reqs=1, num_waiting_reqs=1)
    message.start_ns = 3100 + int(engine_silent_s * SECOND) - message.elapsed_ns
    ingest.on_message(message, engine.now_ns)
    if not dead:
        assert [status for status, _ in statuses(sink)] == [RUNNING]
        assert list(ingest.engines[0].findings.closed) == []
    else:
        assert statuses(sink)[1:] == [(DEAD, engine.now_ns), (RUNNING, engine.now_ns)]
        # and its live finding, opened and closed (as explain's silence)
        (finding,) = ingest.engines[0].findings.closed
        assert finding.kind == "dead" and finding.duration_s == pytest.approx(silent_s)


def closed_then(
    in_flight: int, restart: bool, stop_requested: bool = False
) -> tuple[RecordingSink, Ingest]:
    """An engine that idles, closes its lane (its last heartbeat says so, with ``in_flight``
    requests running, and whether it was told to stop), stays silent for 10 s (ticks every
    0.1 s), then, if ``restart``, starts again (its seq from 1, a new pid)."""
    sink = RecordingSink()
    ingest = Ingest([sink], dead_after_s=2.5)
    engine = ScriptedEngine(ingest)
    engine.message(heartbeat, pid=10)
    engine.message(
        heartbeat, pid=10, running=in_flight, closing=True, stop_requested=stop_requested
    )
    for _ in range(100):
        engine.now_ns += SECOND // 10
        ingest.tick(engine.now_ns)
    if restart:
        engine.msg_seq = 0
        engine.message(heartbeat, pid=11)
    return sink, ingest


def test_an_engine_that_closes_its_lane_with_nothing_in_flight_is_closed_never_dead():
    """A clean shutdown (the publisher's closing heartbeat, nothing in flight) was "Engine
    down" after 2.5 s, with a finding and an alert: it is closed, and a restart opens it."""
    sink, ingest = closed_then(in_flight=0, restart=True)
    assert [status for status, _ in statuses(sink)] == [IDLE, CLOSED, IDLE]
    assert statuses(sink)[1][1] == 0  # at the closing heartbeat itself
    assert sink.of("finding") == [] and list(ingest.engines[0].findings.closed) == []


def test_an_engine_that_closes_its_lane_with_requests_in_flight_untold_is_dead():
    """An engine loop that failed closes its lane with requests in flight, not told to stop:
    they got no token after it, judged as any silence."""
    sink, ingest = closed_then(in_flight=2, restart=False)
    assert [status for status, _ in statuses(sink)] == [IDLE, RUNNING, DEAD]
    (finding,) = ingest.engines[0].findings.open
    assert finding.kind == "dead"


def test_an_engine_told_to_stop_with_requests_in_flight_is_closed():
    """vLLM stopped by SIGTERM under load (its default abort) closes the scheduler source's
    lane with requests in flight: "Engine down" with a finding and an alert, where its
    operator stopped it. Told to stop, it is closed, and the log says what was cut off."""
    sink, ingest = closed_then(in_flight=2, restart=False, stop_requested=True)
    assert [status for status, _ in statuses(sink)] == [IDLE, CLOSED]
    assert sink.of("finding") == [] and list(ingest.engines[0].findings.open) == []


class StuckRunner(FakeRunner):
    """A fake forward pass of 5 ms that, once ``hold`` is set, does not return until
    ``release`` is: waiting (as torch does, without the GIL) or spinning in Python."""

    spin = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hold, self.release = threading.Event(), threading.Event()

    def execute(self, scheduled):
        time.sleep(0.005)
        if self.hold.is_set():
            while not self.release.is_set():
                if not self.spin:
                    self.release.wait()
        return super().execute(scheduled)


def last_seq_seen(sink: RecordingSink) -> int:
    """The highest seq of the messages ``sink`` has been given."""
    return max((call[2] for call in sink.calls if call[0] in ("iteration", "heartbeat")), default=0)


class StatusSink(RecordingSink):
    def on_status(self, engine_index, status, now_ns):
        super().on_status(engine_index, status, now_ns)
        self.last_status = status


@pytest.mark.parametrize("spin", [False, True], ids=["waiting", "spinning-in-python"])
def test_a_stuck_engine_loop_is_stalled_never_dead(tmp_path, spin):
    """The loop of a real EngineCore hangs in its forward pass for longer than dead-after;
    its publisher's thread keeps sending heartbeats, so the sidecar says stalled."""
    address = f"ipc://{tmp_path}/lane.sock"
    sink = StatusSink()
    sidecar = LaneLoop(address, Ingest([sink], stall_after_s=1.0))
    sidecar_thread = threading.Thread(target=sidecar.run)
    sidecar_thread.start()
    core = make_core(num_blocks=512)
    core.runner = runner = StuckRunner(None, 512, 4)
    runner.spin = spin
    core.publisher = publisher = ZmqPublisher(address, 0, facts=core.facts("fake"))
    core.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True)))
    stop = threading.Event()

    def loop():
        while not stop.is_set() and core.has_work:
            core.step()

    engine_thread = threading.Thread(target=loop)
    engine_thread.start()
    try:
        wait_until(lambda: getattr(sink, "last_status", None) is RUNNING, 20, "running")
        runner.hold.set()
        time.sleep(4.0)  # longer than dead-after (2.5 s) plus a heartbeat interval
        runner.release.set()
        wait_until(
            lambda: (
                [s for _, s, _ in sink.of("status")][-1] is RUNNING
                and STALLED in [s for _, s, _ in sink.of("status")]
            ),
            20,
            lambda: f"stalled, then running again: {sink.of('status')}",
        )
    finally:
        runner.release.set()
        stop.set()
        engine_thread.join(timeout=10)
        publisher.close()
        sidecar.stop()
        sidecar_thread.join(timeout=10)
    seen = [status for _, status, _ in sink.of("status")]
    assert seen[seen.index(RUNNING) :] == [RUNNING, STALLED, RUNNING]


@pytest.mark.live
def test_a_stopped_engine_process_is_dead_then_back_without_restart_or_loss(tmp_path):
    """SIGSTOP stops every thread, the publisher's too: no heartbeat, so the truthful status
    is dead (the lane cannot tell frozen from gone); SIGCONT brings the same process back."""
    address = f"ipc://{tmp_path}/lane.sock"
    sink = StatusSink()
    sidecar = LaneLoop(address, Ingest([sink]))
    sidecar_thread = threading.Thread(target=sidecar.run)
    sidecar_thread.start()
    engine = start_engine(address, tmp_path / "engine.json", "--iteration-time", "0.005")
    try:
        wait_until(lambda: getattr(sink, "last_status", None) is RUNNING, 20, "running")
        os.kill(engine.pid, signal.SIGSTOP)
        stopped_ns = time.monotonic_ns()
        wait_until(lambda: sink.last_status is DEAD, 20, "dead while stopped")
        dead_after_stop_ns = time.monotonic_ns() - stopped_ns
        os.kill(engine.pid, signal.SIGCONT)
        wait_until(lambda: sink.last_status is RUNNING, 20, "running again")
        report = stop_engine(engine, tmp_path / "engine.json")
        wait_until(
            lambda: last_seq_seen(sink) >= report["last_seq"],
            10,
            lambda: f"seq {report['last_seq']}, the engine's last, at the sidecar",
        )
    finally:
        if engine.poll() is None:
            os.kill(engine.pid, signal.SIGCONT)
            engine.kill()
        sidecar.stop()
        sidecar_thread.join(timeout=10)
    seen = [status for _, status, _ in sink.of("status")]
    assert seen[seen.index(RUNNING) :] == [RUNNING, DEAD, RUNNING]
    assert dead_after_stop_ns <= 3.5 * SECOND
    assert report["num_dropped_total"] == 0 and sink.of("dropped") == []
    assert sink.of("conflict") == []
