"""The timeline of one engine: its records and heartbeats from a recording, as numpy columns.

Everything ``explain``, ``tune`` and the episode detectors read goes through EngineTimeline:
record columns under the record's own field names (RECORD_FIELDS), static facts from
heartbeats (FACT_FIELDS), record time to wall time through heartbeat anchors, and the reasons
requests wait (WAIT_REASONS). ``build_timelines`` splits a recording's messages by engine;
``read_timelines`` reads a recording's files into them: iterscope's JSONL, or Dynamo's FPM
recordings (telemetry/sources/fpm_taps.py), whose timelines say how they were captured.
"""

from __future__ import annotations

import bisect
import copy
import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from telemetry.lane.record import (
    EVENT_FINISHED,
    UNKNOWN_ELAPSED,
    UNKNOWN_WAITING_REASONS,
    Heartbeat,
    IterationRecord,
)
from telemetry.lane.recording import (
    DEAD,
    Line,
    SidecarNote,
    message_time_ns,
    read_file,
    recording_groups,
)
from telemetry.sources.fpm_taps import TapCapture, is_tap, read_tap

NS_PER_S = 1_000_000_000


class EngineTimeline:
    """One engine's records and heartbeats, ordered by record time, with numpy columns.

    Records are sorted by ``start_ns`` and heartbeats by ``ts_ns``; both clocks are the
    engine's monotonic clock, which keeps running across engine restarts on one host.
    Static facts (block size, limits, model) come from the latest heartbeat that has them.
    """

    def __init__(
        self,
        engine_index: int,
        records: list[IterationRecord],
        heartbeats: list[Heartbeat],
        columns: dict[str, np.ndarray] | None = None,
    ) -> None:
        """``columns``: the records' columns already built (record_columns), the records then
        already in start order (the live window's, telemetry/analysis/window_timeline.py)."""
        self.engine_index = engine_index
        self.records = records if columns else sorted(records, key=lambda r: r.start_ns)
        self.heartbeats = sorted(heartbeats, key=lambda h: h.ts_ns)
        self._anchor_ts_ns = [h.ts_ns for h in self.heartbeats]
        self._anchor_offset_ns = [h.wall_ns - h.ts_ns for h in self.heartbeats]
        self.columns = columns or record_columns(self.records)
        self.facts = _latest_facts(self.heartbeats)
        self.capture: TapCapture | None = None  # a Dynamo FPM recording's; None: iterscope's
        # the sidecar's notes of this engine in its recording (its death, the recording's
        # close), by wall time; none for a live window or a recording made before them
        self.notes: list[SidecarNote] = []
        # what two detectors read of these records, computed once (slow_decode.judged_pace)
        self.memo: dict = {}

    @property
    def num_iterations(self) -> int:
        return len(self.records)

    def col(self, name: str) -> np.ndarray:
        return self.columns[name]

    def stretch(self, first: int, stop: int) -> EngineTimeline:
        """Rows ``first`` to ``stop`` - 1 as a timeline of their own, with the heartbeats up to
        the last one's end and the facts they said: the engine as it stood over that stretch."""
        end_ns = int(self.col("end_ns")[first:stop].max()) if stop > first else 0
        heartbeats = self.heartbeats[: bisect.bisect_right(self._anchor_ts_ns, end_ns)]
        columns = {name: column[first:stop] for name, column in self.columns.items()}
        stretch = EngineTimeline(self.engine_index, self.records[first:stop], heartbeats, columns)
        stretch.capture = self.capture
        return stretch

    def part(self, first: int, stop: int) -> EngineTimeline:
        """The records of rows ``first`` to ``stop`` - 1 (views of these columns), with every
        heartbeat and fact: what a fit over a stretch of the timeline reads."""
        part = copy.copy(self)
        part.records = self.records[first:stop]
        part.columns = {name: column[first:stop] for name, column in self.columns.items()}
        return part

    def known(self, unknown_bits: int) -> np.ndarray:
        """Rows whose source gave every field of ``unknown_bits`` (record.UNKNOWN_*)."""
        return (self.col("unknown") & unknown_bits) == 0

    @property
    def timed(self) -> np.ndarray:
        """Rows with a measured iteration time (a vLLM server without
        --enable-logging-iteration-details reports none)."""
        return self.known(UNKNOWN_ELAPSED)

    @property
    def waiting_reasons_known(self) -> bool:
        """Whether every record says why requests waited (vLLM does not)."""
        return bool(self.known(UNKNOWN_WAITING_REASONS).all())

    @property
    def num_computed_tokens(self) -> np.ndarray:
        """Tokens each iteration computed, what the token budget holds: its prefill tokens,
        one per decoding request (the decode tokens produced less the accepted draft tokens)
        and every draft token scored; prefill + decode tokens where no draft was scored."""
        return (
            self.col("num_prefill_tokens")
            + self.col("num_decode_tokens")
            - self.col("num_accepted_tokens")
            + self.col("num_draft_tokens")
        )

    @property
    def kv_usage(self) -> np.ndarray:
        total = self.col("num_kv_blocks_used") + self.col("num_kv_blocks_free")
        return np.where(total > 0, self.col("num_kv_blocks_used") / np.maximum(total, 1), 0.0)

    @property
    def num_kv_blocks_total(self) -> int:
        if self.records:
            return int((self.col("num_kv_blocks_used") + self.col("num_kv_blocks_free")).max())
        return int(self.facts.get("num_kv_blocks_total", 0))

    @property
    def first_ns(self) -> int:
        times = [t for t in (self._first_record_ns(), self._first_heartbeat_ns()) if t >= 0]
        return min(times) if times else 0

    @property
    def last_ns(self) -> int:
        times = []
        if self.records:
            times.append(int(self.col("end_ns").max()))
        if self.heartbeats:
            times.append(self.heartbeats[-1].ts_ns)
        return max(times) if times else 0

    def _first_record_ns(self) -> int:
        return int(self.col("start_ns")[0]) if self.records else -1

    def _first_heartbeat_ns(self) -> int:
        return self.heartbeats[0].ts_ns if self.heartbeats else -1

    def has_clock_anchor(self) -> bool:
        return bool(self.heartbeats)

    def notes_after(self, ts_ns: int) -> list[SidecarNote]:
        """The sidecar's notes of this engine written after its record time ``ts_ns``, by
        wall time (the notes carry the sidecar's); none without a clock anchor."""
        if not self.notes or not self.heartbeats:
            return []
        wall_ns = self.to_wall_ns(ts_ns)
        return [note for note in self.notes if note.wall_ns > wall_ns]

    def death_at_end(self) -> tuple[SidecarNote, SidecarNote | None] | None:
        """How the recording ends where the live sidecar found the engine dead after its last
        message (and heard nothing after): that note, and the one of the recording's close
        (None: it did not close it); None where it did not, or the engine had closed its
        lane (a shutdown: telemetry/lane/record.py is_clean_close)."""
        last = self.last_message()
        if last is None or (type(last) is Heartbeat and last.closing):
            return None
        notes = self.notes_after(message_time_ns(last))
        dead = next((note for note in notes if note.status == DEAD), None)
        if dead is None:
            return None
        return dead, next((note for note in notes if note.closing), None)

    def last_message(self) -> IterationRecord | Heartbeat | None:
        """The engine's last message in record time (an iteration at its end; a heartbeat
        at the same time after it)."""
        last_record = self.records[-1] if self.records else None
        last_heartbeat = self.heartbeats[-1] if self.heartbeats else None
        if last_record is None:
            return last_heartbeat
        if last_heartbeat is not None and last_heartbeat.ts_ns >= self.col("end_ns")[-1]:
            return last_heartbeat
        return last_record

    def from_wall_ns(self, wall_ns: int) -> int:
        """The record time of a wall time, by the newest heartbeat's clock anchor."""
        if not self.heartbeats:
            raise ValueError(f"engine {self.engine_index}: no heartbeat, so no clock anchor")
        return wall_ns - self._anchor_offset_ns[-1]

    def to_wall_ns(self, ts_ns: int) -> int:
        """Wall time of a record time, from the nearest heartbeat's (ts_ns, wall_ns) anchor."""
        if not self.heartbeats:
            raise ValueError(f"engine {self.engine_index}: no heartbeat, so no clock anchor")
        i = bisect.bisect_left(self._anchor_ts_ns, ts_ns)
        candidates = [j for j in (i - 1, i) if 0 <= j < len(self._anchor_ts_ns)]
        nearest = min(candidates, key=lambda j: abs(self._anchor_ts_ns[j] - ts_ns))
        return ts_ns + self._anchor_offset_ns[nearest]


# The record fields kept as columns, under the record's own names. More are derived:
# ``end_ns`` (start_ns + elapsed_ns), ``num_finished_reqs`` (finish milestones),
# ``num_decode_kv_tokens`` (the decodes' context, from an FPM record's ``fpm``; else 0) and
# SPEC_DECODE_FIELDS (speculative decoding's counts, from ``spec_decode``; else 0).
RECORD_FIELDS = (
    "iteration",
    "start_ns",
    "elapsed_ns",
    "num_prefill_reqs",
    "num_prefill_tokens",
    "num_decode_reqs",
    "num_decode_tokens",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_kv_reqs",
    "num_waiting_seq_limit_reqs",
    "num_waiting_budget_reqs",
    "num_waiting_other_reqs",
    "num_kv_blocks_used",
    "num_kv_blocks_free",
    "num_kv_tokens",
    "num_preemptions",
    "unknown",  # UNKNOWN_* bits: fields the source did not give
)


# SpecDecodeCounts fields kept as columns, under their own names.
SPEC_DECODE_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def record_columns(records: list[IterationRecord]) -> dict[str, np.ndarray]:
    """The columns of ``records`` (RECORD_FIELDS and the derived ones), in their order."""
    columns = {
        name: np.fromiter((getattr(r, name) for r in records), dtype=np.int64, count=len(records))
        for name in RECORD_FIELDS
    }
    columns["end_ns"] = columns["start_ns"] + columns["elapsed_ns"]
    columns["num_decode_kv_tokens"] = np.fromiter(
        (r.fpm.num_decode_kv_tokens if r.fpm else 0 for r in records),
        dtype=np.int64,
        count=len(records),
    )
    columns["num_finished_reqs"] = np.fromiter(
        (sum(1 for m in r.milestones if m.event & EVENT_FINISHED) for r in records),
        dtype=np.int64,
        count=len(records),
    )
    columns.update(_spec_decode_columns(records))
    return columns


def _spec_decode_columns(records: list[IterationRecord]) -> dict[str, np.ndarray]:
    """SPEC_DECODE_FIELDS, 0 where a record has no ``spec_decode``: one pass over the
    records, and no more where none has one (every engine without speculative decoding)."""
    counts = [r.spec_decode for r in records]
    if not any(counts):
        return {name: np.zeros(len(records), dtype=np.int64) for name in SPEC_DECODE_FIELDS}
    return {
        name: np.fromiter(
            (getattr(c, name) if c else 0 for c in counts), dtype=np.int64, count=len(counts)
        )
        for name in SPEC_DECODE_FIELDS
    }


FACT_FIELDS = (
    "model_name",
    "device_name",
    "block_size",
    "num_kv_blocks_total",
    "max_num_seqs",
    "max_num_batched_tokens",
    "pid",
    "source",
    "prefill_schedule_interval",
    "engine_version",
    "num_speculative_tokens",
    "dtype",
    "max_model_len",
)


def _latest_facts(heartbeats: list[Heartbeat]) -> dict:
    facts: dict = {}
    for heartbeat in heartbeats:
        for name in FACT_FIELDS:
            value = getattr(heartbeat, name)
            if value:
                facts[name] = value
    return facts


def build_timelines(messages: Iterable[Line]) -> dict[int, EngineTimeline]:
    """Split messages by engine; duplicates (the same file read twice) are dropped. The
    sidecar's notes go with their engine's messages (an engine with notes only has none)."""
    records: dict[int, dict[tuple, IterationRecord]] = {}
    heartbeats: dict[int, dict[tuple, Heartbeat]] = {}
    notes: dict[int, dict[tuple, SidecarNote]] = {}
    for message in messages:
        if isinstance(message, IterationRecord):
            key = (message.msg_seq, message.start_ns)
            records.setdefault(message.engine_index, {})[key] = message
        elif isinstance(message, Heartbeat):
            key = (message.msg_seq, message.ts_ns)
            heartbeats.setdefault(message.engine_index, {})[key] = message
        else:
            key = (message.wall_ns, message.status, message.closing)
            notes.setdefault(message.engine_index, {})[key] = message
    timelines = {}
    for e in sorted(set(records) | set(heartbeats)):
        tl = EngineTimeline(
            e, list(records.get(e, {}).values()), list(heartbeats.get(e, {}).values())
        )
        tl.notes = sorted(notes.get(e, {}).values(), key=lambda note: note.wall_ns)
        timelines[e] = tl
    return timelines


class WaitReason(NamedTuple):
    """Why requests wait: the record field that counts them, the limit that held them (named
    by the engine flag that sets it, as an operator would change it) and why it holds them."""

    field: str
    limit: str
    cause: str


# Keyed by the reason's name in `explain --json` (``numbers.reason``), which scripts read.
WAIT_REASONS = {
    "waiting_kv": WaitReason(
        "num_waiting_kv_reqs", "KV capacity", "no free KV blocks for the next request"
    ),
    "waiting_seq_limit": WaitReason(
        "num_waiting_seq_limit_reqs",
        "--max-num-seqs",
        "the sequence limit (--max-num-seqs) was reached",
    ),
    "waiting_budget": WaitReason(
        "num_waiting_budget_reqs",
        "--max-num-batched-tokens",
        "the iteration's token budget (--max-num-batched-tokens) was used up",
    ),
    "waiting_other": WaitReason(
        "num_waiting_other_reqs",
        "held back by the engine",
        "the engine held them back for a reason of their own (a structured-output grammar "
        "still compiling, a remote KV transfer, a streaming input waiting for more)",
    ),
}


def read_timelines(
    paths: list[str | Path], fpm_producer: str = "unknown"
) -> tuple[dict[int, EngineTimeline], int, int]:
    """(timelines by engine index, number of messages (the sidecar's notes not counted),
    number of unreadable lines).

    A file's rotated predecessors (``rec.jsonl.1``, ...) are read too. Dynamo's FPM
    recordings are read alone (ValueError beside iterscope's), ``fpm_producer`` saying what
    their wall_time means (telemetry.sources.fpm.PRODUCERS). FileNotFoundError where a path
    given is no file: missing, a folder or something else (not_recording_files says which)."""
    why_not = not_recording_files([Path(p) for p in paths])
    if why_not:
        raise FileNotFoundError(why_not)
    taps = [is_tap(p) for p in paths]
    if any(taps):
        if not all(taps):
            raise ValueError("Dynamo's FPM recordings are read alone, not with iterscope's")
        return _read_tap_timelines(paths, fpm_producer)
    messages, num_bad_lines, num_notes = [], 0, 0
    pids: dict[int, dict[str, set[int]]] = {}  # engine index -> path given -> its pids
    for given, files in recording_groups(paths):
        for file in files:
            for item in read_file(file, notes=True):
                if isinstance(item, str):
                    num_bad_lines += 1
                    continue
                messages.append(item)
                num_notes += type(item) is SidecarNote
                if type(item) is Heartbeat and item.pid:
                    engine_pids = pids.setdefault(item.engine_index, {})
                    engine_pids.setdefault(given, set()).add(item.pid)
    _refuse_two_engines_as_one(pids)
    return build_timelines(messages), len(messages) - num_notes, num_bad_lines


# What recording files are named (iterscope's; Dynamo's FPM trace segments), for a folder given
# instead of one: the names it holds that may be.
RECORDING_SUFFIXES = (".jsonl", ".jsonl.gz")
NAMES_SHOWN = 3


def not_recording_files(paths: list[Path]) -> str | None:
    """Why some of ``paths`` are no recording file, for the error line; None where all are
    files. A folder is said to be one, with the recordings it seems to hold."""
    missing = [str(p) for p in paths if not p.exists()]
    whys = [f"no such recording file: {', '.join(missing)}"] if missing else []
    for path in paths:
        if path.is_dir():
            whys.append(_folder_text(path))
        elif path.exists() and not path.is_file():
            whys.append(f"{path} is not a regular file (give a recording file)")
    return "; ".join(whys) or None


def _folder_text(folder: Path) -> str:
    """'F is a folder, not a recording: give a .jsonl file in it (a.jsonl, b.jsonl, ...)'."""
    try:
        names = sorted(p.name for p in folder.iterdir() if p.name.endswith(RECORDING_SUFFIXES))
    except OSError:
        names = []
    if not names:
        return f"{folder} is a folder, not a recording (and holds no .jsonl file)"
    shown = ", ".join(names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")
    return f"{folder} is a folder, not a recording: give a .jsonl file in it ({shown})"


def nothing_to_read(
    timelines: dict[int, EngineTimeline], num_bad_lines: int, engine_index: int | None
) -> str:
    """Why a command found nothing to work on, for its error line: no line readable, only
    other engines, or an empty file."""
    if timelines and engine_index is not None:
        engines = "engine" if len(timelines) == 1 else "engines"
        return (
            f"no message of engine {engine_index} in the recording (it has {engines} "
            f"{', '.join(str(index) for index in sorted(timelines))})"
        )
    if num_bad_lines:
        lines = f"none of its {num_bad_lines} lines is" if num_bad_lines > 1 else "its line is not"
        return (
            f"no telemetry message found in the recording: {lines} one (these are read: "
            "`iterscope sidecar --record` recordings and Dynamo's FPM recordings)"
        )
    return "no telemetry message found in the recording: it is empty"


def _refuse_two_engines_as_one(pids: dict[int, dict[str, set[int]]]) -> None:
    """ValueError where two recordings given hold an engine of the same index whose processes
    have nothing in common (two runs, two hosts): drawn as one engine, their iterations would
    interleave on two unrelated clocks. An engine restarted within one recording, or a
    recording continued in another file by the same engine, is one engine."""
    for index, by_path in sorted(pids.items()):
        for (path_a, pids_a), (path_b, pids_b) in itertools.combinations(by_path.items(), 2):
            if not pids_a & pids_b:
                raise ValueError(
                    f"engine {index} of {path_a} (pid {min(pids_a)}) and engine {index} of "
                    f"{path_b} (pid {min(pids_b)}) are two engines that share an index: read "
                    "each recording on its own (or give engines distinct --engine-index)"
                )


def _read_tap_timelines(
    paths: list[str | Path], producer: str
) -> tuple[dict[int, EngineTimeline], int, int]:
    """read_timelines of Dynamo's FPM recordings; the count is of FPM messages."""
    tap = read_tap(paths, producer)
    timelines = build_timelines(tap.messages)
    for timeline in timelines.values():
        timeline.capture = tap.capture
    return timelines, tap.num_fpm_messages, tap.num_bad_lines
