"""What the sidecar knows of one engine: the checks a new message of it must pass, and the
evidence its status is judged on.

A lane can be written by anyone who can reach it (docs/architecture.md, "Who can write to
the lane"), so a message's ``msg_seq`` is trusted only as far as it can be checked against what
the engine said before:

    forward   the gap before the message must be explained by the engine's own count of
              the sends it dropped (``num_dropped``), give or take what the lane can lose
              in transit: num_dropped <= gap <= num_dropped + MAX_IN_TRANSIT
    back      the engine restarted (seq counts from 1 again): what it lost before this
              message is what it says it dropped
    anything  no message may claim more drops than MAX_SEQ_JUMP, or more than the messages
              numbered before it (num_dropped < seq)

A message that fails is a suspect frame: counted, never passed on, and the engine's state
stays as it was. One forged frame therefore moves no counter by more than MAX_SEQ_JUMP, and
cannot make the real engine's next messages look like billions of drops.

Stalled is judged on progress (an iteration that scheduled work, seen in a record or in a
heartbeat's ``last_iteration``) while work is in flight, by the rule `explain` applies to a
recording too (telemetry/analysis/stall_rule.py): each tracker holds its engine's StallRule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from telemetry.analysis.live_findings import EngineFindings
from telemetry.analysis.stall_rule import StallRule
from telemetry.lane.record import Message
from telemetry.sidecar.engine_view import SILENT_STATUSES, EngineView

# A single message may account for at most this many lost messages: about 4.6 hours of an
# engine iterating a thousand times a second with no sidecar listening.
MAX_SEQ_JUMP = 1 << 24
# Messages an engine sent that a connected sidecar never received: only when a connection
# breaks, at most what the lane buffers (the engine's 8192-frame send queue, the kernel's
# socket buffers) at default high-water marks.
MAX_IN_TRANSIT = 1 << 17


def drops_are_plausible(message: Message, max_seq_jump: int = MAX_SEQ_JUMP) -> bool:
    """No message reports more drops than were numbered before it, or than MAX_SEQ_JUMP."""
    return message.num_dropped < message.msg_seq and message.num_dropped <= max_seq_jump


@dataclass
class EngineTracker:
    """What the sidecar knows of one engine: ``view``, what sinks read (engine_view.py), and
    the checks and status evidence that are Ingest's alone. Times are the ingest clock."""

    engine_index: int
    last_seq: int = 0
    last_message_ns: int = 0
    stall: StallRule = field(default_factory=StallRule)  # progress, the stall threshold
    previous_pid: int = 0  # the pid before the latest change
    restarted_ns: int = 0  # when a new process of this engine was last seen (seq or pid)
    view: EngineView = field(init=False)
    findings: EngineFindings | None = None  # live findings (None: turned off)
    remember: Callable[[Message], None] | None = None  # adds a message to their window

    def __post_init__(self) -> None:
        self.view = EngineView(self.engine_index)

    def start_findings(self, window_messages: int) -> None:
        """Search this engine's newest ``window_messages`` messages at most for findings live
        (telemetry/analysis/live_findings)."""
        self.findings = EngineFindings(self.engine_index, window_messages=window_messages)
        self.view.findings = self.findings
        self.remember = self.findings.messages.append

    def note_restart(self, now_ns: int) -> None:
        """A new process: its progress is counted from now."""
        self.view.last_iteration = 0
        self.stall.restart(now_ns)
        self.restarted_ns = now_ns

    def gap_before(self, message: Message, is_heartbeat: bool) -> int | None:
        """Messages of this engine lost right before ``message``; None: its seq is suspect.

        A dead engine that heartbeats again is met anew (its own drop count is the loss), so
        a suspect frame that moved ``last_seq`` before the checks existed, or a connection
        that lost more than MAX_IN_TRANSIT, keeps the engine out for a few seconds at most.
        """
        seq = message.msg_seq
        if seq <= self.last_seq:  # restarted: seq counts from 1 again
            return message.num_dropped
        gap = seq - self.last_seq - 1
        if message.num_dropped <= gap <= message.num_dropped + MAX_IN_TRANSIT:
            return gap
        if is_heartbeat and self.view.status in SILENT_STATUSES:
            return message.num_dropped
        return None
