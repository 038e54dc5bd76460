"""The C RoPE + K/V store kernel (engine/model/kernels/rope_store.c) against torch's ops
(engine/model/rope.py's apply_rope and attention's index_put stores), built for this machine,
for AVX2 and for SSE only; its slot checks; and its use by the decoder, only where attention
reads keys and values from the cache alone (logits as with torch's ops)."""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels import cpu_rope_store
from engine.model.loader import build_tiny_model
from engine.model.rope import apply_rope, inverse_frequencies, rope_cos_sin
from tests.helpers.cpu_kernels import build_names, load_build, prefill_then_decode_logits


@pytest.fixture(scope="module", params=build_names())
def library(request, tmp_path_factory):
    return load_build(request.param, cpu_rope_store, tmp_path_factory)


def step(dtype, num_tokens, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0):
    """A fused projection's output [T, (H + 2 KVH) * D] as views q, k, v; cos and sin of
    random positions; empty caches of 8 blocks; distinct random slots."""
    generator = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=generator) * 4).to(
        dtype
    )
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    positions = torch.randint(0, 4000, (num_tokens,), generator=generator)
    cos, sin = rope_cos_sin(positions, inverse_frequencies(head_dim, 10000.0, None), dtype)
    num_blocks = 8
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    caches = torch.zeros(2, num_blocks, kv_heads, block_size, head_dim, dtype=dtype)
    return q, k, v, cos, sin, caches, slots // block_size, slots % block_size


def torch_reference(q, k, v, cos, sin, caches, blocks, offsets):
    """What the decoder and attention do without the kernel: rotated q; the caches stored."""
    rotated = apply_rope(torch.cat([q, k], dim=1), cos, sin)
    expected = caches.clone()
    expected[0][blocks, :, offsets] = rotated[:, q.shape[1] :]
    expected[1][blocks, :, offsets] = v
    return rotated[:, : q.shape[1]], expected


def run(library, q, k, v, cos, sin, caches, blocks, offsets, threads=2):
    got = caches.clone()
    q_out = cpu_rope_store.rope_store(
        library, q, k, v, cos, sin, got[0], got[1], blocks, offsets, threads
    )
    return q_out, got


def assert_same_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == torch.float32:  # the order of float32 operations may differ
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        return
    # bf16: rounded as torch rounds; where torch's float32 sum differs in its last bit, a
    # value can round one bf16 step the other way
    differ = got != expected
    assert differ.float().mean() < 0.002
    torch.testing.assert_close(got[differ].float(), expected[differ].float(), rtol=2**-7, atol=0)


# 3 tokens stay on the calling thread (a decode step), 100 are spread over threads
@pytest.mark.parametrize("num_tokens", [3, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotates_and_stores_as_torch_does(library, num_tokens, dtype):
    inputs = step(dtype, num_tokens)
    expected_q, expected_caches = torch_reference(*inputs)
    q_out, caches = run(library, *inputs)
    assert_same_rounding(q_out, expected_q)
    assert_same_rounding(caches, expected_caches)
    untouched = expected_caches == 0  # every slot not written stays as it was
    assert (caches[untouched] == 0).all()


@pytest.mark.parametrize("shape", [(4, 4, 6, 4), (16, 2, 128, 32)], ids=str)
def test_other_head_dims_and_block_sizes(library, shape):
    heads, kv_heads, head_dim, block_size = shape
    inputs = step(torch.float32, 20, heads, kv_heads, head_dim, block_size, seed=2)
    expected_q, expected_caches = torch_reference(*inputs)
    q_out, caches = run(library, *inputs, threads=3)
    assert_same_rounding(q_out, expected_q)
    assert_same_rounding(caches, expected_caches)


def test_separate_tensors_with_their_own_strides(library):
    """Qwen3's q and k come normed in a tensor of their own, v from the projection."""
    q, k, v, cos, sin, caches, blocks, offsets = step(torch.bfloat16, 10)
    q_and_k = torch.cat([q, k], dim=1)  # contiguous: another row stride than v's
    inputs = (q_and_k[:, :9], q_and_k[:, 9:], v, cos, sin, caches, blocks, offsets)
    expected_q, expected_caches = torch_reference(*inputs)
    q_out, got = run(library, *inputs)
    assert_same_rounding(q_out, expected_q)
    assert_same_rounding(got, expected_caches)


def test_slot_checks_refuse_what_the_kernel_would_write_out_of_bounds():
    blocks, offsets = torch.tensor([0, 7]), torch.tensor([3, 15])
    cpu_rope_store.check_slots(blocks, offsets, 8, 16)
    bad = {
        "a block past the cache": (torch.tensor([0, 8]), offsets),
        "a negative block": (torch.tensor([-1, 7]), offsets),
        "an offset past the block": (blocks, torch.tensor([3, 16])),
        "int32 slots": (blocks.int(), offsets),
        "fewer offsets than tokens": (blocks, offsets[:1]),
    }
    for reason, (b, o) in bad.items():
        with pytest.raises(ValueError):
            cpu_rope_store.check_slots(b, o, 8, 16)
            pytest.fail(f"accepted {reason}")


def decoder_logits(monkeypatch, architecture: str, dtype: str, kernel: bool):
    """Two prompts prefilled, then a decode step of both: whether the decoder took the
    kernel in the decode step, and every logit."""
    from engine.runner import ModelRunner

    if not kernel:
        monkeypatch.setattr(cpu_rope_store.KERNEL, "load", lambda: None)
    runner = ModelRunner(build_tiny_model(architecture, seed=5, dtype=dtype), 32, 4, "cpu")
    logits = prefill_then_decode_logits(runner)
    return runner.decoder._rope_fused, logits


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decoder_with_the_kernel_gives_torchs_logits(monkeypatch, architecture, dtype):
    fused, ours = decoder_logits(monkeypatch, architecture, dtype, kernel=True)
    assert fused
    fused_anyway, reference = decoder_logits(monkeypatch, architecture, dtype, kernel=False)
    assert not fused_anyway
    atol = 1e-4 if dtype == "float32" else 0.05  # the sums' order; bf16: a rounding step
    torch.testing.assert_close(ours, reference, atol=atol, rtol=0)


def test_torchs_ops_where_attention_needs_this_steps_keys():
    """Without attention's CPU decode kernel, keys are attended from the tensors handed in:
    the decoder rotates and attention stores them in torch."""
    from engine.request import Request, SamplingParams
    from engine.runner import ModelRunner

    runner = ModelRunner(build_tiny_model("llama", seed=5), 32, 4, "cpu")
    assert runner.decoder.rope_kernel is not None
    runner.decoder.attention.cpu_kernel = None
    request = Request("r", list(range(12)), SamplingParams())
    request.block_ids = [3, 4, 5]
    runner.compute_logits([(request, 12)])
    assert not runner.decoder._rope_fused


def test_kernels_off_keep_torchs_ops(monkeypatch):
    monkeypatch.setenv("ITERSCOPE_CPU_KERNELS", "0")
    assert cpu_rope_store.KERNEL.load() is None
    assert build_tiny_model("llama", seed=0).decoder.rope_kernel is None


def test_float16_odd_and_huge_head_dims_keep_torchs_ops():
    assert not cpu_rope_store.supports(torch.float16, 64)
    assert not cpu_rope_store.supports(torch.float32, 65)  # no halves
    assert not cpu_rope_store.supports(torch.float32, 512)  # past the compiled bound
    assert cpu_rope_store.supports(torch.bfloat16, 256)
