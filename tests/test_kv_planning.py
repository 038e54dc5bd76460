"""KV memory planning: story 5's numbers, the start-up lines, and config checks."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, field_and_flag
from engine.kv_planning import (
    GIB,
    cuda_kv_budget_bytes,
    estimate_max_model_len,
    kv_bytes_for_tokens,
    kv_bytes_per_token,
    plan_kv_cache,
)
from engine.settings import parse_memory_size

# USER_STORIES story 5: an 8B model, 36 layers x 8 KV heads x head_dim 128, bf16.
STORY5_BYTES_PER_TOKEN = kv_bytes_per_token(36, 8, 128, 2)


def test_story5_bytes_per_token():
    assert STORY5_BYTES_PER_TOKEN == 147_456
    assert f"{kv_bytes_for_tokens(40_960, STORY5_BYTES_PER_TOKEN, 16) / GIB:.2f}" == "5.62"


def test_story5_error_names_needed_available_estimate_and_fixes():
    with pytest.raises(ValueError) as error:
        plan_kv_cache(
            STORY5_BYTES_PER_TOKEN,
            int(4.5 * GIB),
            16,
            40_960,
            field_and_flag("gpu_memory_utilization"),
        )
    assert str(error.value) == (
        "To serve at least one request with the model's max seq len (40960), 5.62 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (4.50 GiB). "
        "Based on the available memory, the estimated maximum model length is 32768. Try "
        "increasing gpu_memory_utilization (--gpu-memory-utilization) or decreasing "
        "max_model_len (--max-model-len)."
    )


def test_memory_setting_names_the_flag():
    assert EngineConfig(device="cuda").kv_cache_memory_setting() == (
        "gpu_memory_utilization (--gpu-memory-utilization)"
    )
    assert EngineConfig(kv_cache_memory_bytes=GIB).kv_cache_memory_setting() == (
        "kv_cache_memory_bytes (--kv-cache-memory)"
    )


def test_estimate_is_the_largest_length_that_fits():
    available = 1_000_000
    estimate = estimate_max_model_len(1000, available, 16, 10_000)
    assert kv_bytes_for_tokens(estimate, 1000, 16) <= available
    assert kv_bytes_for_tokens(estimate + 1, 1000, 16) > available
    assert estimate == 992  # 62 whole blocks of 16 tokens
    assert estimate_max_model_len(1000, available, 16, 500) == 500


def test_startup_lines():
    bytes_per_token = kv_bytes_per_token(8, 4, 256, 2)  # 32 KiB per token
    plan = plan_kv_cache(bytes_per_token, int(45.94 * GIB), 16, 262_144)
    assert plan.num_blocks == int(45.94 * GIB) // (16 * bytes_per_token) == 94_085
    assert plan.startup_lines() == [
        "Available KV cache memory: 45.94 GiB",
        "KV cache size: 1,505,360 tokens",
        "Maximum concurrency for 262,144 tokens per request: 5.74x",
    ]
    assert plan.startup_lines(request_len=80_800)[2] == (
        "Maximum concurrency for 80,800 tokens per request: 18.63x"
    )


def test_plan_counts_whole_blocks():
    plan = plan_kv_cache(100, 100 * 16 * 10 + 99, 16, 17)
    assert plan.num_blocks == 10
    assert plan.num_tokens == 160
    assert plan.max_concurrency() == 5.0  # a 17-token request holds 2 blocks
    assert plan.max_concurrency(160) == 1.0


def test_cuda_budget_subtracts_weights_and_activations():
    assert cuda_kv_budget_bytes(80 * GIB, 0.9, 16 * GIB, 2 * GIB) == int(72 * GIB) - 18 * GIB
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        cuda_kv_budget_bytes(24 * GIB, 0.5, 15 * GIB, 1 * GIB)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GIB),
        ("4.5GiB", int(4.5 * GIB)),
        ("512MiB", 512 << 20),
        ("1GB", 10**9),
        ("512B", 512),
        (" 2 kib ", 2048),
    ],
)
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", ""),
        ("GiB", ""),
        ("-1GiB", ""),
        ("12 parsecs", ": 'parsecs' is not a unit; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"),
        ("512", ": it has no unit (write 512B for bytes)"),
        ("0MiB", ": it is not above 0 bytes"),
        ("0.4B", ": it is not above 0 bytes"),
    ],
)
def test_parse_memory_size_says_what_is_wrong(text, reason):
    expected = f"expected a size with its unit, e.g. 512MiB, 4GiB or 4.5GB, got {text!r}{reason}"
    with pytest.raises(ValueError) as error:
        parse_memory_size(text)
    assert str(error.value) == expected


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"block_size": 0}, r"block_size \(--block-size\) must be a power of two up to 256"),
        ({"block_size": 12}, "power of two"),
        ({"max_num_seqs": 0}, r"max_num_seqs \(--max-num-seqs\) must be a whole number >= 1"),
        (
            {"max_num_seqs": 64, "max_num_batched_tokens": 32},
            r"raise max_num_batched_tokens \(--max-num-batched-tokens\)",
        ),
        ({"max_model_len": 0}, r"max_model_len \(--max-model-len\) must be a whole number >= 1"),
        (
            {"enable_chunked_prefill": False, "max_model_len": 4096},
            "enable chunked prefill, raise max_num_batched_tokens",
        ),
        (
            {"gpu_memory_utilization": 1.5},
            r"gpu_memory_utilization \(--gpu-memory-utilization\) must be a fraction in",
        ),
        (
            {"kv_cache_memory_bytes": 0},
            r"kv_cache_memory_bytes \(--kv-cache-memory\) must be a whole number of bytes above 0 "
            r"\(on a command line, a size with its unit, e.g. 512MiB",
        ),
        ({"dtype": "int3"}, r"dtype \(--dtype\) must be auto, float32, bfloat16 or float16"),
        ({"device": "tpu"}, r"device \(--device\) must be cpu or cuda, got 'tpu'"),
        (
            {"max_num_seqs": 2.5},
            r"max_num_seqs \(--max-num-seqs\) must be int or None, got 2.5 \(float\)",
        ),
        ({"block_size": 16.0}, r"block_size \(--block-size\) must be int, got 16.0 \(float\)"),
        (
            {"max_num_batched_tokens": float("inf")},
            r"max_num_batched_tokens \(--max-num-batched-tokens\) must be int",
        ),
        (
            {"max_num_seqs": True},
            r"max_num_seqs \(--max-num-seqs\) must be int or None, got True \(bool\)",
        ),
        ({"enable_chunked_prefill": "no"}, "enable_chunked_prefill must be bool, got 'no'"),
        (
            {"max_model_len": "4096"},
            r"max_model_len \(--max-model-len\) must be int or None, got '4096'",
        ),
        (
            {"gpu_memory_utilization": "0.9"},
            r"gpu_memory_utilization \(--gpu-memory-utilization\) must be float",
        ),
        ({"telemetry_address": 5555}, "telemetry_address must be str or None"),
    ],
)
def test_invalid_config_names_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_config_accepts_ints_for_floats_and_none_where_allowed():
    config = EngineConfig(gpu_memory_utilization=1, max_model_len=None)
    assert config.gpu_memory_utilization == 1 and config.max_model_len is None


def test_config_resolves_model_len_and_dtype():
    config = EngineConfig(dtype="bf16")
    assert config.dtype == "bfloat16"
    assert EngineConfig(dtype="float16").torch_dtype_name == "float16"
    assert config.resolve_max_model_len(8192) == 8192
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        EngineConfig(max_model_len=9000).resolve_max_model_len(8192)
    with pytest.raises(ValueError, match="chunked prefill"):
        EngineConfig(enable_chunked_prefill=False).resolve_max_model_len(8192)
