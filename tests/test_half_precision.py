"""16-bit weights and KV cache (bfloat16, float16): the paged decoder against transformers run
in the same dtype, and against our own float32 result.

16-bit rounding differs between two correct implementations (fused q/k/v, accumulation
order), so the bar is relative: the difference from transformers in the same dtype must be
no larger than transformers' own 16-bit rounding error (its distance from float32), with a
small allowance, and the greedy tokens must agree wherever float32's top two logits are
further apart than twice that rounding error (closer, a 16-bit argmax may flip). A
dtype bug (a cache or a softmax in the wrong precision, a mask in the wrong dtype) is orders
of magnitude bigger than that.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.decoder import Decoder
from engine.model.loader import LoadedModel, tiny_hf_config, tiny_state_dict
from engine.model.tokenizer import ByteTokenizer
from engine.runner import ModelRunner
from tests.helpers.parity import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    SEQ_LEN,
    hf_model,
    make_request,
    random_tokens,
    run_in_chunks,
    shuffled_blocks,
)

pytestmark = pytest.mark.live

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def our_logits(architecture: str, dtype: str, chunks: list[int]) -> torch.Tensor:
    hf_config = tiny_hf_config(architecture)
    config = ModelConfig.from_hf_dict(hf_config, architecture, dtype)
    state_dict = tiny_state_dict(hf_config, seed=1)
    decoder = Decoder(config, state_dict, "cpu")
    model = LoadedModel(config, ByteTokenizer(config.vocab_size), decoder)
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    assert runner.kv_cache.dtype == DTYPES.get(dtype, torch.float32)
    request = make_request("a", random_tokens(5), shuffled_blocks(5))
    return run_in_chunks(runner, request, chunks)


def transformers_logits(architecture: str, dtype: torch.dtype) -> torch.Tensor:
    hf_config = tiny_hf_config(architecture)
    model = hf_model(hf_config, tiny_state_dict(hf_config, seed=1)).to(dtype)
    with torch.no_grad():
        return model(torch.tensor([random_tokens(5)])).logits[0].float()


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_and_paged_decode_match_transformers_in_the_same_dtype(architecture, dtype):
    chunks = [9, 7] + [1] * (SEQ_LEN - 16)  # a chunked prefill, then paged decode
    ours = our_logits(architecture, dtype, chunks)
    ours_fp32 = our_logits(architecture, "float32", chunks)
    reference = transformers_logits(architecture, DTYPES[dtype])
    reference_fp32 = transformers_logits(architecture, torch.float32)

    rounding_error = (reference - reference_fp32).abs().max().item()
    assert rounding_error > 0  # the reference really ran in 16 bits
    assert (ours - reference).abs().max().item() <= 2 * rounding_error + 1e-3
    assert (ours - ours_fp32).abs().max().item() <= 2 * rounding_error + 1e-3

    top2 = ours_fp32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * rounding_error
    assert clear.sum() >= SEQ_LEN // 2  # enough positions to make the check mean something
    assert torch.equal(ours.argmax(-1)[clear], ours_fp32.argmax(-1)[clear])


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_bfloat16_on_a_cpu_without_bf16_matmuls(architecture, monkeypatch, onednn_linears):
    """CPUs without bf16 matmuls (AVX2) widen bf16 weights and the plain prefill to float32
    (engine/model/linear.py). Forced here, so CI runs that path on any CPU: same bar."""
    from engine.model import attention, linear

    def refuse(weight):
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(linear, "pack_weight", refuse)
    monkeypatch.setattr(attention, "cpu_has_bf16_matmul", lambda: False)
    hf_config = tiny_hf_config(architecture)
    config = ModelConfig.from_hf_dict(hf_config, architecture, "bfloat16")
    decoder = Decoder(config, tiny_state_dict(hf_config, seed=1), "cpu")
    assert decoder.attention.widen_plain_prefill
    assert decoder.layers[0].qkv_proj.widened is not None
    test_prefill_and_paged_decode_match_transformers_in_the_same_dtype(architecture, "bfloat16")
