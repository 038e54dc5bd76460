"""engine/model/gguf_reader.py reads what gguf.GGUFReader reads (the embedded SmolLM2 file and a
small file with the value and tensor types SmolLM2 lacks), and refuses a damaged file by name."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from engine.model.gguf_file import (
    gguf_hf_config,
    gguf_tokenizer_fields,
    load_gguf_state_dict,
    open_gguf,
    read_gguf_metadata,
)
from engine.model.gguf_reader import read_gguf
from engine.model.paths import resolve_model_path

TOKENS = "tokenizer.ggml.tokens"


@pytest.fixture(scope="module")
def path():
    return resolve_model_path("smollm2")


@pytest.fixture(scope="module")
def reference(path):
    """gguf's own reader: the ground truth (about 5 s, so once per module)."""
    return GGUFReader(str(path))


@pytest.fixture(scope="module")
def ours(path):
    return open_gguf(path)


def as_old_reader(reference: GGUFReader) -> SimpleNamespace:
    """GGUFReader seen the way the old gguf_file.py used it: every field through .contents(),
    the tensors as they are, so the functions below run on the reference's values."""
    fields = {key: field.contents() for key, field in reference.fields.items()}
    return SimpleNamespace(fields=fields, tensors=reference.tensors)


def assert_same_file(ours, reference: GGUFReader) -> None:
    assert ours.fields.keys() == reference.fields.keys()
    for key, field in reference.fields.items():
        assert ours.fields[key] == field.contents(), key
        assert type(ours.fields[key]) is type(field.contents()), key
    assert ours.data_offset == reference.data_offset
    assert ours.alignment == reference.alignment
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (theirs.name, theirs.tensor_type)
        assert mine.data.shape == theirs.data.shape, mine.name
        assert mine.data.dtype == theirs.data.dtype, mine.name
        assert not mine.data.flags.writeable  # load_gguf_state_dict copies these before use
        assert np.array_equal(mine.data, theirs.data), mine.name


@pytest.mark.live
def test_smollm2_reads_as_gguf_reads_it(ours, reference):
    assert_same_file(ours, reference)
    assert len(ours.fields[TOKENS]) == len(reference.fields[TOKENS].data) == 49152


@pytest.mark.live
def test_config_tokenizer_and_weights_match_the_gguf_reader_path(ours, reference):
    old = as_old_reader(reference)
    config, old_config = gguf_hf_config(ours), gguf_hf_config(old)
    assert config == old_config
    assert read_gguf_metadata(ours) == read_gguf_metadata(old)
    assert gguf_tokenizer_fields(ours) == gguf_tokenizer_fields(old)
    weights, old_weights = load_gguf_state_dict(ours, config), load_gguf_state_dict(old, old_config)
    assert config == old_config  # both gained tie_word_embeddings alike
    assert weights.keys() == old_weights.keys()
    for name, tensor in weights.items():
        assert tensor.dtype == old_weights[name].dtype and torch.equal(tensor, old_weights[name])


@pytest.mark.live
def test_returned_lists_are_the_callers_own(ours):
    fields = gguf_tokenizer_fields(ours)
    fields["tokens"].append("extra")
    assert len(gguf_tokenizer_fields(ours)["tokens"]) == 49152


def test_other_types_alignment_and_nested_arrays(tmp_path):
    """Value and tensor types the SmolLM2 file does not carry, and a non-default alignment."""
    path = tmp_path / "small.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_bool("t.bool", True)
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 65535)
    writer.add_int64("t.i64", -(2**40))
    writer.add_string("t.str", "héllo")
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.strings", ["a", "", "ü"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    bf16 = rng.integers(0, 256, (4, 16), dtype=np.uint8)  # 4 rows of 8 bf16 values
    writer.add_tensor("bf16", bf16, raw_dtype=GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_file(read_gguf(path), GGUFReader(str(path)))
    assert read_gguf(path).alignment == 64


def write_prefix(source, target, nbytes: int, patch: bytes = b""):
    with open(source, "rb") as file:
        data = bytearray(file.read(nbytes))
    data[: len(patch)] = patch
    target.write_bytes(bytes(data))
    return target


CUTS = ["empty", "header", "metadata", "vocabulary", "tensor infos", "tensor data"]


@pytest.mark.live
@pytest.mark.parametrize("cut", CUTS)
def test_a_truncated_file_is_refused_by_name(path, reference, tmp_path, cut):
    nbytes = {
        "empty": 0,
        "header": 10,
        "metadata": 1000,
        "vocabulary": reference.fields[TOKENS].offset + 100_000,
        "tensor infos": reference.tensors[100].field.offset + 5,
        "tensor data": reference.data_offset + 1000,
    }[cut]
    damaged = write_prefix(path, tmp_path / "cut.gguf", nbytes)
    with pytest.raises(ValueError, match="cut.gguf"):
        open_gguf(damaged)


@pytest.mark.parametrize(
    "patch, message",
    [
        (b"GGUX", "not a GGUF file"),
        (b"GGUF\x04\x00\x00\x00", "version 4"),
        (b"GGUF\x00\x00\x00\x03", "big-endian"),
    ],
)
def test_a_wrong_magic_version_or_byte_order_is_refused_by_name(path, tmp_path, patch, message):
    damaged = write_prefix(path, tmp_path / "bad.gguf", 4096, patch)
    with pytest.raises(ValueError, match=rf"bad\.gguf.*{message}"):
        open_gguf(damaged)
