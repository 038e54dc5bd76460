"""Protocol buffer wire format by hand, for a trace's bulk packets (perfetto_trace.py).

Two ways to build the same bytes:

* one message at a time: ``varint``, ``tag`` and ``length_delimited`` return bytes to join;
* many messages at once, with numpy: a message is a list of ``Column``s (each a matrix of
  bytes with a length per row), one row per message; ``join_rows`` lays every row's columns
  end to end. ``varint_column``, ``double_column`` and ``fixed64_column`` encode a value per
  row, ``constant`` repeats fixed bytes, ``bytes_column``, ``slices_column`` and
  ``lookup_column`` take bytes encoded already,
  ``optional`` drops a row's columns where a field is absent and ``length_delimited_columns``
  wraps a row's columns as a length-delimited field (a nested message, or a trace's packet).

Only what a trace needs: varint, fixed64 (a double, a flow id) and length-delimited fields; a
negative integer is written as protobuf writes an int64 (its 64-bit two's complement, 10 bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

VARINT = 0
FIXED64 = 1
LENGTH_DELIMITED = 2
MASK_64 = (1 << 64) - 1
MAX_VARINT_BYTES = 10
_SMALL = [bytes([value]) for value in range(128)]
_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, MAX_VARINT_BYTES)], np.uint64)


def varint(value: int) -> bytes:
    """``value`` as a base-128 varint (an int64's two's complement when negative)."""
    if 0 <= value < 128:
        return _SMALL[value]
    value &= MASK_64
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint(field_number << 3 | wire_type)


def length_delimited(field_tag: bytes, payload: bytes) -> bytes:
    return field_tag + varint(len(payload)) + payload


def double(value: float) -> bytes:
    return struct.pack("<d", value)


def fixed64(value: int) -> bytes:
    return struct.pack("<Q", value)


@dataclass
class Column:
    """A field's bytes for each row: ``data[i, :lengths[i]]`` (the rest is padding)."""

    data: np.ndarray  # (rows, width) uint8
    lengths: np.ndarray  # (rows,) int64


Rows = list[Column]


def constant(value: bytes, num_rows: int) -> Column:
    data = np.broadcast_to(np.frombuffer(value, np.uint8), (num_rows, len(value)))
    return Column(data, np.full(num_rows, len(value), np.int64))


def varint_column(values: np.ndarray) -> Column:
    """Each value as a varint, as ``varint`` writes it."""
    unsigned = np.asarray(values, np.int64).view(np.uint64)
    if not unsigned.size or unsigned.max() < 0x80:  # one byte each: most counts and iids
        return Column(unsigned.astype(np.uint8)[:, None], np.ones(len(unsigned), np.int64))
    num_bytes = 1 + np.searchsorted(_VARINT_LIMITS, unsigned, side="right")
    width = int(num_bytes.max(initial=1))
    shifts = np.uint64(7) * np.arange(width, dtype=np.uint64)
    groups = ((unsigned[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    more = np.arange(width) < (num_bytes - 1)[:, None]  # every byte but the last
    return Column(groups | (more.astype(np.uint8) << 7), num_bytes)


def double_column(values: np.ndarray) -> Column:
    """Each value as a little-endian double (fixed64)."""
    return fixed64_column(np.asarray(values, "<f8"))


def fixed64_column(values: np.ndarray) -> Column:
    """Each value's 8 bytes, little-endian (``values``: a numpy array of 8-byte numbers)."""
    data = np.ascontiguousarray(values, values.dtype.newbyteorder("<")).view(np.uint8)
    return Column(data.reshape(-1, 8), np.full(len(values), 8, np.int64))


def lookup_column(codes: np.ndarray, table: list[bytes]) -> Column:
    """Row i holds ``table[codes[i]]``: a field with few distinct values, encoded once each."""
    width = max((len(value) for value in table), default=0)
    data = np.zeros((len(table), max(width, 1)), np.uint8)
    for i, value in enumerate(table):
        data[i, : len(value)] = np.frombuffer(value, np.uint8)
    lengths = np.array([len(value) for value in table], np.int64)
    return Column(data[codes], lengths[codes])


def bytes_column(values: list[bytes]) -> Column:
    """Row i holds ``values[i]``."""
    lengths = np.fromiter(map(len, values), np.int64, len(values))
    flat = np.frombuffer(b"".join(values) + b"\0", np.uint8)
    return slices_column(flat, np.cumsum(lengths) - lengths, lengths)


def slices_column(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> Column:
    """Row i holds ``flat[starts[i] : starts[i] + lengths[i]]``; ``flat`` (uint8) ends with a
    spare byte, which the padding points at."""
    offsets = starts[:, None] + np.arange(int(lengths.max(initial=1)))
    return Column(flat[np.minimum(offsets, len(flat) - 1)], lengths)


def field_columns(field_tag: bytes, value: Column) -> Rows:
    return [constant(field_tag, len(value.lengths)), value]


def optional(columns: Rows, present: np.ndarray) -> Rows:
    """``columns`` in the rows where ``present``; nothing in the others."""
    return [Column(c.data, np.where(present, c.lengths, 0)) for c in columns]


def rows_length(columns: Rows) -> np.ndarray:
    total = columns[0].lengths.copy()
    for column in columns[1:]:
        total += column.lengths
    return total


def length_delimited_columns(field_tag: bytes, columns: Rows) -> Rows:
    """``columns`` wrapped, row by row, as one length-delimited field tagged ``field_tag``."""
    num_rows = len(columns[0].lengths)
    return [constant(field_tag, num_rows), varint_column(rows_length(columns)), *columns]


def join_rows(columns: Rows) -> bytes:
    """Row 0's columns in order, then row 1's, ...: every row's bytes, end to end."""
    data = np.hstack([c.data for c in columns])
    widths = [c.data.shape[1] for c in columns]
    # positions and lengths in the narrowest type that holds them: the mask is built from a
    # matrix as large as the bytes
    small = np.uint8 if max(widths) <= 0xFF else np.int64
    position = np.concatenate([np.arange(width, dtype=small) for width in widths])
    lengths = np.empty((len(columns[0].lengths), len(columns)), small)
    for i, column in enumerate(columns):
        lengths[:, i] = column.lengths
    return data[position < np.repeat(lengths, widths, axis=1)].tobytes()
