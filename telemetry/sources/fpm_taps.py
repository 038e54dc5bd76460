"""Dynamo's FPM recordings read as iterscope messages, for `iterscope explain` and `tune`.

NVIDIA Dynamo records forward-pass metrics (telemetry/sources/fpm.py) two ways, each a line
of JSON per message:

    recv_forward_pass_metrics --output F.jsonl   (python -m dynamo.common.recv_forward_pass_metrics)
        {"received_at_ns": <unix ns, the receiver's clock>, "metrics": <FPM map>}
        every message the receiver got; gaps in counter_id are messages it did not get

    --fpm-trace (DYN_FPM_TRACE=1, DYN_FPM_OUTPUT_PATH=P, DYN_FPM_MODE=full|sampled)
        P.<producer id>.000000.jsonl.gz, .000001, ... (gzip members; rotated, oldest pruned)
        {"timestamp": <ms since the writer started>,
         "event": {"schema": "dynamo.fpm.trace.v1",
                   "source": {"namespace", "component", "producer_id"},
                   "capture_mode": "full" | "sampled",
                   "observed_at_unix_ms": <unix ms>, "fpm": <FPM map>}}
        full: every message (gaps in counter_id: the trace's queue overwrote them);
        sampled: per (worker_id, dp_rank), the latest message of each sample interval
        (DYN_FPM_SAMPLE_INTERVAL_MS), a message not written twice

(the formats of ai-dynamo 1.6.1: its recv_forward_pass_metrics module, and the Rust sink
lib/llm/src/fpm_trace/sink.rs with lib/llm/src/telemetry/jsonl_gz.rs.)

Each FPM map is mapped and numbered as the live sidecar does (telemetry/sources/fpm.py,
fpm_streams.py): one engine per (worker_id, dp_rank), its all-zero messages heartbeats, a
counter_id going back a restart; a trace of several components puts the component into the
worker id, as Dynamo keys its streams. Times are the recorder's unix clock (monotonic = wall). In a
sampled trace the skipped counter_ids are iterations not sampled, not losses, so a stream's
samples are numbered one after another; elsewhere a gap in counter_id counts as lost messages.
"""

from __future__ import annotations

import gzip
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import msgspec

from telemetry.lane.record import Heartbeat, Message
from telemetry.lane.recording import GZIP_MAGIC, is_gzipped_recording
from telemetry.sources.fpm import FPM_VERSION, ForwardPassMetrics
from telemetry.sources.fpm_streams import FpmStreams

TRACE_SCHEMA = "dynamo.fpm.trace.v1"
RECEIVED = "received"  # recv_forward_pass_metrics --output: what one receiver got
FULL, SAMPLED = "full", "sampled"  # the trace's capture modes
NS_PER_MS = 1_000_000
NO_SEQ_JUMP_LIMIT = 1 << 62  # a file is read whole: no forged jump to fend off


class _Received(msgspec.Struct):
    """A line of recv_forward_pass_metrics --output."""

    received_at_ns: int
    metrics: ForwardPassMetrics


class _TraceSource(msgspec.Struct, frozen=True):
    namespace: str = ""
    component: str = ""


class _TraceEvent(msgspec.Struct):
    schema: str
    capture_mode: str
    observed_at_unix_ms: int
    fpm: ForwardPassMetrics
    source: _TraceSource = _TraceSource()


class _TraceLine(msgspec.Struct):
    """A line of a dynamo.fpm.trace.v1 segment (the gzip writer's envelope)."""

    event: _TraceEvent


@dataclass
class TapCapture:
    """How a Dynamo FPM recording was captured."""

    format: str  # "recv_forward_pass_metrics --output" or TRACE_SCHEMA
    mode: str  # RECEIVED, FULL or SAMPLED
    sample_interval_s: float | None = None  # sampled: median time between a stream's samples


@dataclass
class Tap:
    """A Dynamo FPM recording as iterscope messages."""

    capture: TapCapture
    messages: list[Message] = field(default_factory=list)
    num_fpm_messages: int = 0
    num_bad_lines: int = 0


def is_tap(path: str | Path) -> bool:
    """Whether ``path`` is one of Dynamo's FPM recordings (else an iterscope recording, whose
    lines are JSON arrays, gzipped or not): a gzip file that holds no iterscope recording, or
    a first line that is a JSON object."""
    head = _head(path)
    if head == GZIP_MAGIC:
        return not is_gzipped_recording(path)
    return head[:1] == b"{"


def read_tap(paths: Iterable[str | Path], producer: str = "unknown") -> Tap:
    """One recording of either format, in one or more files (a trace's segments, several
    producers' prefixes); ``producer`` says what wall_time means (fpm.PRODUCERS)."""
    paths = sorted(Path(p) for p in paths)  # a prefix's segments in index order
    gzipped = {_is_gzip(path) for path in paths}
    if len(gzipped) > 1:
        raise ValueError("give the .jsonl.gz trace segments or the --output JSONL, not both")
    entries, num_bad, modes = [], 0, set()
    for path in paths:
        for item in _entries(path):
            if isinstance(item, str):
                num_bad += 1
            else:
                entries.append(item)
                modes.add(item.mode)
    entries.sort(key=lambda entry: entry.time_ns)  # stable: a stream keeps its order
    _scope_worker_ids(entries)
    capture = TapCapture(
        TRACE_SCHEMA if gzipped == {True} else "recv_forward_pass_metrics --output", _mode(modes)
    )
    tap = Tap(capture, num_fpm_messages=len(entries), num_bad_lines=num_bad)
    _number(tap, entries, producer)
    return tap


def _head(path: str | Path) -> bytes:
    with open(path, "rb") as file:
        return file.read(len(GZIP_MAGIC))


def _is_gzip(path: Path) -> bool:
    return _head(path) == GZIP_MAGIC


def _mode(modes: set[str]) -> str:
    if len(modes) > 1:
        raise ValueError(f"the trace mixes capture modes ({', '.join(sorted(modes))})")
    return modes.pop() if modes else RECEIVED


class Entry(NamedTuple):
    """One FPM message of a recording."""

    time_ns: int  # unix
    message: ForwardPassMetrics
    mode: str  # RECEIVED, FULL or SAMPLED
    scope: str = ""  # a trace's namespace.component, which Dynamo keys a stream by too


def _entries(path: Path) -> Iterator[Entry | str]:
    """Each line's entry, or why it is not one ('malformed', 'version', 'truncated')."""
    if _is_gzip(path):
        decoder = msgspec.json.Decoder(_TraceLine)
        yield from (_trace_entry(decoder, line) for line in _gzip_lines(path))
        return
    decoder = msgspec.json.Decoder(_Received)
    with open(path, "rb") as file:
        yield from (_received_entry(decoder, line) for line in file)


def _gzip_lines(path: Path) -> Iterator[bytes | str]:
    """A segment's lines; 'truncated' once where a writer killed mid-member cut it short."""
    try:
        with gzip.open(path, "rb") as file:
            yield from file
    except (EOFError, gzip.BadGzipFile):
        yield "truncated"


def _received_entry(decoder: msgspec.json.Decoder, line: bytes) -> Entry | str:
    try:
        item = decoder.decode(line)
    except msgspec.DecodeError:
        return "malformed"
    return _checked(Entry(item.received_at_ns, item.metrics, RECEIVED))


def _trace_entry(decoder: msgspec.json.Decoder, line: bytes | str) -> Entry | str:
    if isinstance(line, str):
        return line
    try:
        event = decoder.decode(line).event
    except msgspec.DecodeError:
        return "malformed"
    if event.schema != TRACE_SCHEMA or event.capture_mode not in (FULL, SAMPLED):
        return "version"
    scope = f"{event.source.namespace}.{event.source.component}"
    return _checked(
        Entry(event.observed_at_unix_ms * NS_PER_MS, event.fpm, event.capture_mode, scope)
    )


def _checked(entry: Entry) -> Entry | str:
    if entry.message.version != FPM_VERSION:
        return "version"
    return entry if entry.time_ns > 0 else "malformed"


def _scope_worker_ids(entries: list[Entry]) -> None:
    """Where a trace holds several components, Dynamo keys a stream by (component,
    worker_id, dp_rank): the component goes into the worker id so their streams stay apart
    (two components of one process may share a worker id)."""
    if len({entry.scope for entry in entries}) > 1:
        for entry in entries:
            entry.message.worker_id = f"{entry.scope}/{entry.message.worker_id}"


class _Collected:
    """The receiving end of FpmStreams offline: every engine it meets is admitted."""

    def __init__(self) -> None:
        self.engines: set[int] = set()
        self.messages: list[Message] = []
        self.now_ns = 0  # the entry being numbered: the heartbeats' wall clock

    def send(self, message: Message, now_ns: int) -> None:
        if type(message) is Heartbeat:
            self.engines.add(message.engine_index)
        self.messages.append(message)


def _number(tap: Tap, entries: list[Entry], producer: str) -> None:
    """Map and number the entries as the live sidecar does (see the module doc)."""
    collected = _Collected()
    streams = FpmStreams(
        collected.engines,
        collected.send,
        NO_SEQ_JUMP_LIMIT,
        producer=producer,
        wall_clock=lambda: collected.now_ns,
    )
    seqs = _SampleSeqs() if tap.capture.mode == SAMPLED else None
    for time_ns, message, _, _ in entries:
        collected.now_ns = time_ns
        seq = message.counter_id if seqs is None else seqs.next(message)
        streams.on_message(seq, message, time_ns)
    tap.messages = collected.messages
    if seqs is not None:
        tap.capture.sample_interval_s = seqs.median_interval_s(entries)


class _SampleSeqs:
    """A sampled stream's samples numbered one after another (skipped counter_ids are
    iterations not sampled); a counter_id that goes back starts again from 0 (a restart)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], tuple[int, int]] = {}  # key -> (counter_id, seq)

    def next(self, message: ForwardPassMetrics) -> int:
        key = (message.worker_id, message.dp_rank)
        counter_id, seq = self._last.get(key, (-1, -1))
        seq = 0 if message.counter_id < counter_id else seq + 1
        self._last[key] = (message.counter_id, seq)
        return seq

    @staticmethod
    def median_interval_s(entries: list[Entry]) -> float | None:
        """The median time between consecutive samples of one stream."""
        last: dict[tuple[str, int], int] = {}
        intervals = []
        for time_ns, message, _, _ in entries:
            key = (message.worker_id, message.dp_rank)
            if key in last:
                intervals.append((time_ns - last[key]) / 1e9)
            last[key] = time_ns
        return statistics.median(intervals) if intervals else None
