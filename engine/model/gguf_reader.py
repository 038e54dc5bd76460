"""Parse a GGUF container: header, metadata key/values, tensor infos and the tensor data views.

Layout (GGUF versions 2 and 3, little-endian; every integer below is little-endian):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count  x  (string key | u32 value_type | value)
    tensor_count x (string name | u32 n_dims | n_dims x u64 dim | u32 ggml_type | u64 offset)
    padding to `general.alignment` (u32, a power of two; default 32)
    tensor data: each tensor at data_offset + its offset

    string = u64 byte length | UTF-8 bytes;  array = u32 item_type | u64 count | items

The values match what gguf.GGUFReader gives, so the two are interchangeable for our uses:
`fields[key]` equals `GGUFReader.fields[key].contents()` (the pseudo fields GGUF.version,
GGUF.tensor_count and GGUF.kv_count included; nested arrays flattened), and a tensor's `data`
is the same read-only view of the file: F16/F32/F64/I8/I16/I32/I64 as their element dtype with
the GGUF dims reversed (row-major), every other type as uint8 rows of its bytes.

GGUFReader builds a numpy memmap slice per element (5.5 s for a 49k-token vocabulary); here
scalars and strings come from `struct` on an mmap and numeric arrays from one np.frombuffer.
A file we cannot read to the end (truncated, corrupt, big-endian, another version) raises a
ValueError that names it.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALAR_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype(np.bool_),
}
_ELEMENT_DTYPES: dict[GGMLQuantizationType, np.dtype] = {  # the rest are viewed as bytes
    GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F64: np.dtype(np.float64),
    GGMLQuantizationType.I8: np.dtype(np.int8),
    GGMLQuantizationType.I16: np.dtype(np.int16),
    GGMLQuantizationType.I32: np.dtype(np.int32),
    GGMLQuantizationType.I64: np.dtype(np.int64),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a read-only view into the file's mmap


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    fields: dict[str, Any]  # key -> decoded value, in file order
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the file at ``path``; the tensors stay memory-mapped."""
    path = Path(path)
    with open(path, "rb") as file:
        try:
            buf = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise ValueError(f"{path}: not a GGUF file ({exc})") from exc
    # the mmap outlives the file object; the tensor views keep it alive
    return _Parser(path, buf).parse()


class _Parser:
    """A cursor over the mapped bytes; every read checks the bounds first, so a short file
    fails here with its name instead of deep inside struct or numpy."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0
        self.types: dict[str, int] = {}  # metadata key -> its GGUF value type

    def error(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what} (offset {self.pos})")

    def need(self, nbytes: int, what: str) -> None:
        if self.pos + nbytes > self.size:
            raise self.error(
                f"truncated GGUF file: {what} needs {nbytes} bytes, {self.size - self.pos} left"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self, what: str) -> str:
        length = self.u64(what)
        self.need(length, what)
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        return self.decode(raw, what)

    def decode(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} is not UTF-8 ({exc})") from exc

    def parse(self) -> GGUFFile:
        version, tensor_count, kv_count = self.header()
        fields: dict[str, Any] = {
            "GGUF.version": version,
            "GGUF.tensor_count": tensor_count,
            "GGUF.kv_count": kv_count,
        }
        for _ in range(kv_count):
            self.key_value(fields)
        infos = [self.tensor_info() for _ in range(tensor_count)]
        alignment = self.alignment(fields)
        data_offset = -(-self.pos // alignment) * alignment  # rounded up to the alignment
        tensors = self.tensors(infos, data_offset)
        return GGUFFile(self.path, version, fields, tensors, alignment, data_offset)

    def header(self) -> tuple[int, int, int]:
        self.need(4, "the magic")
        if self.buf[:4] != GGUF_MAGIC:
            raise self.error(f"not a GGUF file (magic {self.buf[:4]!r}, expected {GGUF_MAGIC!r})")
        self.pos = 4
        version = self.u32("the version")
        if version & 0xFFFF == 0:  # a small version number read in the other byte order
            raise self.error("big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise self.error(f"GGUF version {version} is not supported {SUPPORTED_VERSIONS}")
        return version, self.u64("the tensor count"), self.u64("the key/value count")

    def key_value(self, fields: dict[str, Any]) -> None:
        key = self.string("a metadata key")
        if key in fields:
            raise self.error(f"duplicate metadata key {key!r}")
        value_type = self.types[key] = self.u32(f"the type of {key}")
        fields[key] = self.value(value_type, key)

    def value(self, value_type: int, key: str) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string(key)
        if value_type == GGUFValueType.ARRAY:
            return self.array(key)
        dtype = self.dtype(value_type, key)
        return self.numbers(dtype, 1, key)[0]

    def dtype(self, value_type: int, key: str) -> np.dtype:
        dtype = _SCALAR_DTYPES.get(value_type)
        if dtype is None:
            raise self.error(f"{key} has an unknown value type {value_type}")
        return dtype

    def numbers(self, dtype: np.dtype, count: int, key: str) -> list[Any]:
        # numpy's tolist, as GGUFReader's contents() does: float32 widened the same way
        self.need(count * dtype.itemsize, key)
        values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos += count * dtype.itemsize
        return values

    def array(self, key: str) -> list[Any]:
        item_type = self.u32(f"the item type of {key}")
        count = self.u64(f"the length of {key}")
        if item_type == GGUFValueType.STRING:
            return self.strings(count, key)
        if item_type == GGUFValueType.ARRAY:  # GGUFReader flattens nested arrays
            return [item for _ in range(count) for item in self.array(key)]
        return self.numbers(self.dtype(item_type, key), count, key)

    def strings(self, count: int, key: str) -> list[str]:
        # the hot loop (vocabularies and merges): locals and no method calls per item
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                break
            (length,) = unpack(buf, pos)
            if pos + 8 + length > size:
                break
            out.append(buf[pos + 8 : pos + 8 + length])
            pos += 8 + length
        self.pos = pos
        if len(out) < count:
            raise self.error(f"truncated GGUF file: {key} ends after {len(out)} of {count} strings")
        try:
            return [raw.decode("utf-8") for raw in out]
        except UnicodeDecodeError as exc:
            raise self.error(f"a string of {key} is not UTF-8 ({exc})") from exc

    def tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self.string("a tensor name")
        n_dims = self.u32(f"the dimension count of {name}")
        self.need(8 * n_dims, f"the dimensions of {name}")
        dims = [self.u64(f"the dimensions of {name}") for _ in range(n_dims)]
        ggml_type = self.u32(f"the type of {name}")
        return name, dims, ggml_type, self.u64(f"the offset of {name}")

    def alignment(self, fields: dict[str, Any]) -> int:
        if "general.alignment" not in fields:
            return DEFAULT_ALIGNMENT
        if self.types["general.alignment"] != GGUFValueType.UINT32:  # as GGUFReader demands
            raise self.error("general.alignment must be a u32")
        alignment = fields["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1):
            raise self.error(f"general.alignment {alignment} is not a power of two")
        return alignment

    def tensors(self, infos: list[tuple[str, list[int], int, int]], start: int) -> list[GGUFTensor]:
        tensors, names = [], set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise self.error(f"duplicate tensor {name!r}")
            names.add(name)
            tensors.append(self.tensor(name, dims, raw_type, start + offset))
        return tensors

    def tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> GGUFTensor:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.error(f"tensor {name!r} has an unknown type {raw_type}") from None
        n_elements = math.prod(dims)
        shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
        dtype = _ELEMENT_DTYPES.get(ggml_type)
        if dtype is None:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            dtype, count = np.dtype(np.uint8), n_elements * type_size // block_size
            try:
                shape = quant_shape_to_byte_shape(shape, ggml_type)
            except ValueError as exc:
                raise self.error(f"tensor {name!r}: {exc}") from None
        else:
            count = n_elements
        end = offset + count * dtype.itemsize
        if end > self.size:
            raise ValueError(
                f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                f"{offset}..{end}, the file has {self.size}"
            )
        data = np.frombuffer(self.buf, dtype, count, offset).reshape(shape)
        return GGUFTensor(name, ggml_type, data)
