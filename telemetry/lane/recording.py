"""The JSONL recording format (what ``telemetry.sidecar.sinks.jsonl`` writes): file names, and
reading it back for replay, explain and tune.

A recording is one message per line, the msgspec JSON of an IterationRecord or Heartbeat, and
the sidecar's own notes (SidecarNote: what it saw of an engine that no message of the engine's
says, such as its death). It may span rotated files, oldest last in number:

    rec.jsonl.N-1 ... rec.jsonl.1 rec.jsonl      (read in this order)

Every line decodes to a message or to the reason it could not be ('malformed', 'truncated',
'version'), the same reasons and the same plausibility checks the live sidecar applies to a
frame, so a replay and ``explain`` count bad lines the same way.
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from telemetry.lane.frame_checks import classify_undecodable, is_plausible
from telemetry.lane.record import MAX_ENGINE_INDEX, TAG_HEARTBEAT, IterationRecord, Message

StrPath = str | os.PathLike
TAG_SIDECAR_NOTE = TAG_HEARTBEAT + 1  # the next kind of the lane's tags, never on the lane


class SidecarNote(msgspec.Struct, array_like=True, gc=False, tag=TAG_SIDECAR_NOTE):
    """A line of the sidecar's, never sent on the lane: the status the live sidecar judged an
    engine to be in, where the engine's own messages cannot say it. Written when it found an
    engine dead (no message, not even a heartbeat, for --dead-after: a process killed, say,
    sends nothing more), and for every engine as it closed the recording (``closing``), so a
    recording that ends mid-work says whether the engine died or the recording stopped."""

    engine_index: int
    # the sidecar's time.time_ns() when it judged so; readers place it among the engine's
    # messages by their clock anchors, so it takes the two hosts' clocks to agree (NTP)
    wall_ns: int
    status: str  # the engine's status then (EngineStatus's value: "dead", "running", ...)
    closing: bool = False  # written as the sidecar closed the recording


Line = Message | SidecarNote  # what a recording's line decodes to
DEAD = "dead"  # a note's status for a dead engine: EngineStatus.DEAD's value (the sidecar's)


def rotated_path(path: Path, generation: int) -> Path:
    """Generation 0 is ``path`` itself, generation n >= 1 is ``path.n``."""
    return path if generation == 0 else path.with_name(f"{path.name}.{generation}")


def recording_files(path: StrPath) -> list[Path]:
    """The files of a recording, oldest first: path.N, ..., path.1, path."""
    path = Path(path)
    older = []
    generation = 1
    while rotated_path(path, generation).exists():
        older.append(rotated_path(path, generation))
        generation += 1
    return [*reversed(older), path]


def with_rotated_files(paths: Iterable[StrPath]) -> list[Path]:
    """Each path preceded by its rotated older files, without repeats."""
    return [file for _, files in recording_groups(paths) for file in files]


def recording_groups(paths: Iterable[StrPath]) -> list[tuple[str, list[Path]]]:
    """Each path given, with the files it stands for: its rotated older files, then itself,
    none that an earlier path already stands for."""
    seen: set[Path] = set()
    groups = []
    for path in paths:
        files = [file for file in recording_files(path) if file not in seen]
        seen.update(files)
        groups.append((str(path), files))
    return groups


def decode_line(decoder: msgspec.json.Decoder, line: bytes) -> Line | str:
    """A message or note, or why the line is neither ('malformed', 'truncated', 'version')."""
    try:
        message = decoder.decode(line)
    except (msgspec.DecodeError, ValueError) as error:
        return classify_undecodable(line, error, loads=msgspec.json.decode)
    if type(message) is SidecarNote:
        return message if 0 <= message.engine_index <= MAX_ENGINE_INDEX else "malformed"
    return message if is_plausible(message) else "malformed"


def read_recording(paths: StrPath | Iterable[StrPath], notes: bool = False) -> Iterator[Line | str]:
    """Every line of a recording: one path or several, each read with its rotated older files
    (oldest first, a file given twice read once); a message per line, or the reason the line
    could not be decoded; the sidecar's notes where ``notes`` asks for them."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    for file_path in with_rotated_files(paths):
        yield from read_file(file_path, notes)


GZIP_MAGIC = b"\x1f\x8b"


def open_recording(file_path: StrPath) -> BinaryIO:
    """A recording file for reading, gunzipped as it is read where it is gzip (a rotated file
    that logrotate compressed)."""
    with open(file_path, "rb") as file:
        gzipped = file.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    return gzip.open(file_path, "rb") if gzipped else open(file_path, "rb")


def is_gzipped_recording(file_path: StrPath) -> bool:
    """Whether a gzip file holds an iterscope recording (its first line a JSON array), not
    one of Dynamo's FPM traces (JSON objects)."""
    try:
        with gzip.open(file_path, "rb") as file:
            return file.read(1) == b"["
    except (OSError, EOFError):
        return False


def read_file(file_path: Path, notes: bool = False) -> Iterator[Line | str]:
    """Every line of one file (no rotated files; gzip or not): a message, or why the line is
    not one; the sidecar's notes where ``notes`` asks for them (else passed over)."""
    decoder = msgspec.json.Decoder(Line)
    with open_recording(file_path) as file:
        for line in file:
            item = decode_line(decoder, line)
            if notes or type(item) is not SidecarNote:
                yield item


def message_time_ns(message: Message) -> int:
    """When a message happened on its engine's monotonic clock (an iteration's end)."""
    if type(message) is IterationRecord:
        return message.start_ns + message.elapsed_ns
    return message.ts_ns


FORGET_AFTER_CALLS = 3


class RecordingReader:
    """Reads the lines added to a recording since the last call (``explain --follow``).

    The file list (each path with its rotated older files) is looked up again at every call,
    so a ``rec.jsonl.1`` that a rotation creates later is read too. Where a file stopped being
    read is kept by inode, not by name: rotation renames ``rec.jsonl`` to ``rec.jsonl.1``, and
    its tail written just before the rename is read from where reading stopped, once. A file
    that shrank is read again from its start. An inode missing from FORGET_AFTER_CALLS file
    lists in a row is forgotten (a reused inode then starts from 0); one missing from fewer,
    as when a rotation lands between listing the files and opening them, keeps its place.
    """

    def __init__(self, paths: Iterable[StrPath], notes: bool = False) -> None:
        """``notes``: the sidecar's notes read too (else passed over)."""
        self.paths = [Path(p) for p in paths]
        self.notes = notes
        self.decoder = msgspec.json.Decoder(Line)
        self.num_bad_lines = 0
        self._offsets: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> bytes read
        self._last_seen: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> call number
        self._num_calls = 0

    def read_new(self) -> list[Line]:
        """Complete lines added since the last call: an unterminated last line is left for the
        next call (its writer may still be completing it)."""
        messages: list[Line] = []
        seen: set[tuple[int, int]] = set()
        for path in with_rotated_files(self.paths):
            messages += self._read_path(path, seen)
        self._num_calls += 1
        for key in seen:
            self._last_seen[key] = self._num_calls
        for key, last in list(self._last_seen.items()):
            if self._num_calls - last >= FORGET_AFTER_CALLS:
                del self._last_seen[key]
                self._offsets.pop(key, None)
        return messages

    def _read_path(self, path: Path, seen: set[tuple[int, int]]) -> list[Line]:
        try:
            with open(path, "rb") as file:
                stat = os.fstat(file.fileno())
                key = (stat.st_dev, stat.st_ino)
                if key in seen:  # the same file under two names
                    return []
                offset = self._offsets.get(key, 0)
                if stat.st_size < offset:
                    offset = 0
                file.seek(offset)
                data = file.read()
        except FileNotFoundError:
            return []
        seen.add(key)
        end = data.rfind(b"\n") + 1
        self._offsets[key] = offset + end
        return self._decode_lines(data[:end])

    def _decode_lines(self, data: bytes) -> list[Line]:
        messages = []
        for line in io.BytesIO(data):  # split as reading the file line by line would
            item = decode_line(self.decoder, line)
            if isinstance(item, str):
                self.num_bad_lines += 1
            elif self.notes or type(item) is not SidecarNote:
                messages.append(item)
        return messages
