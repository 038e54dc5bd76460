"""JSONL recording of the raw lane messages: the input of replay, `explain` and `tune`.

This module writes it; ``telemetry.lane.recording`` reads it.

One message per line, the ``msgspec.json`` encoding of the decoded message: IterationRecord
and Heartbeat as tagged JSON arrays holding exactly the wire fields, and the sidecar's own
notes (telemetry.lane.recording.SidecarNote): a line when it finds an engine dead, and one per
engine as it closes the recording, with the engine's status then (a replay's sidecar writes
none: they would be its own judgments, at its own time), so `explain` can say whether a
recording that ends mid-work ends with the engine's death or with the recording stopped.
``msgspec.json.Decoder(telemetry.lane.recording.Line)`` reads every line back.

Files rotate by size with a bounded count:

    rec.jsonl      the newest, appended to
    rec.jsonl.1    the one before
    ...
    rec.jsonl.N-1  the oldest kept (N = max_files); older ones are deleted

Lines are buffered and written whole at every sidecar tick (about 0.1 s) or when the buffer
reaches ``flush_bytes``. A sidecar killed mid-write can leave a partial last line; the next
sidecar to open the file cuts it off, and reads the last ``msg_seq`` of every engine back, so the
messages it never wrote are counted as lost (``known_last_seqs``).

A write that fails (a full disk, a file size limit, an I/O error) leaves the file ending at
a whole line: the lines it wrote whole stay, a line it cut is truncated off the file
(``os.ftruncate``) and kept in the buffer with the lines not written, to be written again
once writes succeed; nothing is written twice. Only if that truncate fails too does the file
end inside a line (logged); the next write then completes that line first. While writes keep
failing, at most MAX_UNWRITTEN_BYTES are held; whole lines beyond that are dropped and
counted in ``num_lines_lost``. The failure itself propagates, so the sidecar counts it
(``num_errors``); both, and ``last_write_time``, are series of /metrics.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import msgspec

from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.lane.recording import TAG_SIDECAR_NOTE, SidecarNote, recording_files, rotated_path
from telemetry.sidecar.arg_types import positive_int
from telemetry.sidecar.engine_view import EngineStatus, EngineView
from telemetry.sidecar.sink import Sink

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_FILES = 4
DEFAULT_FLUSH_BYTES = 1 << 20
# Recordings hold request timings and ids of a whole service: readable by their owner only.
RECORDING_MODE = 0o600
MAX_UNWRITTEN_BYTES = 64 << 20  # held while writes fail (disk full); beyond it lines are lost

logger = logging.getLogger("iterscope.sidecar")


class LineHead(msgspec.Struct, array_like=True):
    """The first three elements of any recorded message; the rest are ignored."""

    tag: int
    engine_index: int
    msg_seq: int


def cut_partial_last_line(path: Path) -> None:
    """Truncate ``path`` after its last newline (a writer killed mid-line leaves a stub)."""
    with open(path, "rb+") as file:
        size = file.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - 65536)
            file.seek(start)
            chunk = file.read(end - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end != size:
            file.truncate(end)


def read_last_seqs(path: Path) -> dict[int, int]:
    """engine_index -> msg_seq of its last line in one recording file (bad lines skipped)."""
    decoder = msgspec.json.Decoder(LineHead)
    last_seqs: dict[int, int] = {}
    with open(path, "rb") as file:
        for line in file:
            try:
                head = decoder.decode(line)
            except msgspec.DecodeError:
                continue
            if head.tag != TAG_SIDECAR_NOTE:  # a note's third element is no seq
                last_seqs[head.engine_index] = head.msg_seq
    return last_seqs


class JsonlSink(Sink):
    """Appends every message to a size-rotated JSONL recording."""

    name = "jsonl"

    def __init__(
        self,
        path: str | os.PathLike,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
        flush_bytes: int = DEFAULT_FLUSH_BYTES,
        notes: bool = True,
    ) -> None:
        """``notes``: write the sidecar's notes (a live sidecar's; not a replay's)."""
        if max_bytes <= 0 or max_files < 1:
            raise ValueError(
                f"need max_bytes > 0 and max_files >= 1, got {max_bytes} and {max_files}"
            )
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.flush_bytes = flush_bytes
        self.num_messages = 0
        self.num_lines_lost = 0
        self._midline = False  # a partial write ended inside a line
        self._encoder = msgspec.json.Encoder()
        self._buffer = bytearray()
        # each engine's latest status (None: notes not written)
        self._statuses: dict[int, EngineStatus] | None = {} if notes else None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            cut_partial_last_line(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, RECORDING_MODE)
        self._size = os.fstat(self._fd).st_size

    def known_last_seqs(self) -> dict[int, int]:
        """The last seq per engine already recorded, from the newest two files.

        A live engine heartbeats every second, so it appears in the newest file unless that
        file was just started; the one before covers that case.
        """
        last_seqs: dict[int, int] = {}
        for path in recording_files(self.path)[-2:]:
            last_seqs.update(read_last_seqs(path))
        return last_seqs

    def _append(self, message: IterationRecord | Heartbeat, engine: EngineView) -> None:
        self._encoder.encode_into(message, self._buffer, -1)
        self._buffer += b"\n"
        self.num_messages += 1
        if len(self._buffer) >= self.flush_bytes:
            self.flush()

    on_iteration = _append
    on_heartbeat = _append

    def on_status(self, engine_index: int, status: EngineStatus, now_ns: int) -> None:
        if self._statuses is None:
            return
        self._statuses[engine_index] = status
        if status is EngineStatus.DEAD:
            self._note(engine_index, status, closing=False)

    def on_engine_removed(self, engine_index: int, silent_ns: int) -> None:
        if self._statuses is not None:
            self._statuses.pop(engine_index, None)

    def _note(self, engine_index: int, status: EngineStatus, closing: bool) -> None:
        note = SidecarNote(engine_index, time.time_ns(), status.value, closing)
        self._encoder.encode_into(note, self._buffer, -1)
        self._buffer += b"\n"

    def flush(self) -> None:
        """Write the buffered lines (whole lines only), rotating first if the file is full.

        The file's length is read once per flush (one ``lseek``), so that a write that fails
        part way can be cut back to the last whole line it wrote (``_keep_whole_lines``).
        """
        if not self._buffer:
            return
        if self._size and self._size + len(self._buffer) > self.max_bytes:
            self._rotate()
        buffer = self._buffer
        start, num_written = self._size, 0
        try:
            start = os.lseek(self._fd, 0, os.SEEK_END)  # where a failed write is cut back to
            while num_written < len(buffer):  # one write, unless one falls short
                rest = buffer[num_written:] if num_written else buffer
                num_written += os.write(self._fd, rest)
        except OSError:
            self._keep_whole_lines(start, num_written)
            if len(buffer) > MAX_UNWRITTEN_BYTES:
                self._drop_unwritten_lines()
            raise
        buffer.clear()
        self._midline = False
        self._size = start + num_written
        self.last_write_time = time.time()

    def _keep_whole_lines(self, start: int, num_written: int) -> None:
        """After a failed write of the buffer at file offset ``start``, of which ``num_written``
        bytes reached the file: the whole lines written leave the buffer, and a line cut part
        way is truncated off the file, so the file ends at a whole line and the buffer starts
        with the first line not in it. Should the truncate fail, the cut line's written part
        stays in the file and ``_midline`` says the buffer starts with its rest."""
        buffer = self._buffer
        whole = buffer.rfind(b"\n", 0, num_written) + 1
        if whole:
            self._midline = False  # a stub before this flush was completed
        if whole < num_written:
            try:
                os.ftruncate(self._fd, start + whole)  # O_APPEND: the next write goes to the end
            except OSError as error:
                logger.error(
                    "the recording %s ends inside a line: cutting off a partial write failed "
                    "(%s); the next write that succeeds completes the line",
                    self.path,
                    error,
                )
                whole, self._midline = num_written, True
        del buffer[:whole]
        self._size = start + whole

    def _drop_unwritten_lines(self) -> None:
        """Keep only the rest of a line a partial write began, so the file stays whole."""
        buffer = self._buffer
        keep = buffer.find(b"\n") + 1 if self._midline else 0
        self.num_lines_lost += buffer.count(b"\n", keep)
        del buffer[keep:]

    def _rotate(self) -> None:
        os.close(self._fd)
        oldest = rotated_path(self.path, self.max_files - 1)
        oldest.unlink(missing_ok=True)
        for generation in range(self.max_files - 2, -1, -1):
            source = rotated_path(self.path, generation)
            if source.exists():
                source.rename(rotated_path(self.path, generation + 1))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, RECORDING_MODE)
        self._size = 0

    def tick(self, now_ns: int) -> None:
        self.flush()

    def close(self) -> None:
        """Write what is buffered and close. Lines that cannot be written now never will be:
        they are counted lost and the error says how many (past the sidecar's first few sink
        errors nothing else would say it)."""
        if self._fd < 0:
            return
        for engine_index, status in (self._statuses or {}).items():
            self._note(engine_index, status, closing=True)
        try:
            self.flush()
        except OSError as error:
            num_before = self.num_lines_lost
            self._drop_unwritten_lines()
            raise OSError(
                error.errno,
                f"the recording {self.path} could not be written at close ({error.strerror}): "
                f"{self.num_lines_lost - num_before} buffered lines lost",
            ) from None
        finally:
            os.close(self._fd)
            self._fd = -1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("recording")
    group.add_argument("--record", metavar="PATH", help="record every message to a JSONL file")
    group.add_argument(
        "--record-max-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BYTES,
        metavar="N",
        help="rotate the recording at this size (default: %(default)s)",
    )
    group.add_argument(
        "--record-max-files",
        type=positive_int,
        default=DEFAULT_MAX_FILES,
        metavar="N",
        help="files kept, the current one included (default: %(default)s)",
    )


def build(args: argparse.Namespace) -> JsonlSink | None:
    if not args.record:
        return None
    return JsonlSink(
        args.record, args.record_max_bytes, args.record_max_files, notes=not args.replay
    )
