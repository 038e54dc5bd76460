"""Logits of our paged decoder == transformers' LlamaForCausalLM / Qwen3ForCausalLM (fp32).

The same tiny random weights go into both. Our side runs through the ModelRunner with shuffled
(non-contiguous) block tables, for a full prefill, a chunked prefill, paged decode, and one mixed
batch holding all three at once.
"""

from __future__ import annotations

import pytest
import torch

from engine.model import attention as attention_module
from engine.model.attention import PagedAttention
from engine.model.config import ModelConfig
from engine.model.decoder import Decoder
from engine.model.kernels import cpu_paged_decode, cpu_prefill_attention
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

ATOL = 1e-4

CASES = {
    "llama": tiny_hf_config("llama"),
    "qwen3": tiny_hf_config("qwen3"),
    "llama3-rope": tiny_hf_config(
        "llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    hf_config = CASES[request.param]
    state_dict = tiny_state_dict(hf_config, seed=1)
    config = ModelConfig.from_hf_dict(hf_config, request.param, "float32")
    ours = LoadedModel(config, ByteTokenizer(config.vocab_size), Decoder(config, state_dict, "cpu"))
    return ours, hf_model(hf_config, state_dict)


def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(params=["cpu_kernel", "plain", "plain_in_chunks", "sdpa", "sdpa_cuda_backends"])
def fresh_prefill_path(request, pair, monkeypatch):
    """Prefills (fresh prompts, and chunks over their cached context) through the C kernel,
    or torch's path: batched matmuls (short; in query chunks of 5 positions, the last one
    partial), or SDPA (longer than the limit; always on CUDA, with the backends chosen there)."""
    attention = pair[0].decoder.attention
    if request.param == "cpu_kernel":
        assert attention.prefill_kernel is not None, cpu_prefill_attention.KERNEL.build_error()
        return request.param
    monkeypatch.setattr(attention, "prefill_kernel", None)
    if request.param == "plain_in_chunks":
        monkeypatch.setattr(attention_module, "QUERY_CHUNK", 5)
    if request.param.startswith("sdpa"):
        monkeypatch.setattr(attention, "plain_prefill_max_len", 0)
    if request.param == "sdpa_cuda_backends":
        monkeypatch.setattr(attention, "sdpa_backends", attention_module.CUDA_PROMPT_SDPA_BACKENDS)
    return request.param


@pytest.fixture(params=["cpu_kernel", "torch"])
def decode_backend(request, pair, monkeypatch):
    """Decode through the C kernel or the torch gather path (the reference)."""
    attention = pair[0].decoder.attention
    if request.param == "cpu_kernel":
        assert attention.cpu_kernel is not None, cpu_paged_decode.KERNEL.build_error()
    else:
        monkeypatch.setattr(attention, "cpu_kernel", None)
    return request.param


def test_full_prefill(pair, fresh_prefill_path):
    ours, ref = pair
    runner = ModelRunner(ours, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    tokens = random_tokens(0)
    logits = run_in_chunks(runner, make_request("a", tokens, shuffled_blocks(0)), [SEQ_LEN])
    torch.testing.assert_close(logits, reference_logits(ref, tokens), atol=ATOL, rtol=0)


def test_chunked_prefill(pair, fresh_prefill_path):
    ours, ref = pair
    runner = ModelRunner(ours, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    tokens = random_tokens(1)
    request = make_request("a", tokens, shuffled_blocks(1))
    logits = run_in_chunks(runner, request, [6, 13, 1, 17])
    torch.testing.assert_close(logits, reference_logits(ref, tokens), atol=ATOL, rtol=0)


def test_paged_decode(pair, decode_backend):
    ours, ref = pair
    runner = ModelRunner(ours, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    tokens = random_tokens(2)
    request = make_request("a", tokens, shuffled_blocks(2))
    logits = run_in_chunks(runner, request, [20] + [1] * (SEQ_LEN - 20))
    torch.testing.assert_close(logits, reference_logits(ref, tokens), atol=ATOL, rtol=0)
    assert ours.decoder.attention.decode_backend == decode_backend


def test_mixed_batch_of_prefill_chunk_and_decodes(pair, decode_backend):
    """One step holds a fresh prefill, a chunk on top of a cached prefix, and two decodes."""
    ours, ref = pair
    runner = ModelRunner(ours, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    free = shuffled_blocks(3)
    seqs = [random_tokens(10 + i, n) for i, n in enumerate([29, 37, 11, 23])]
    reqs = [make_request(f"r{i}", s, free) for i, s in enumerate(seqs)]
    # Bring r1 to 20 computed tokens, r2 and r3 to one token short of their ends.
    for request, done in zip(reqs[1:], [20, 10, 22], strict=True):
        run_in_chunks(runner, request, [done])
    step = [(reqs[2], 1), (reqs[0], 29), (reqs[1], 17), (reqs[3], 1)]
    got = runner.compute_logits(step)
    expected = [reference_logits(ref, s) for s in seqs]
    torch.testing.assert_close(got[0], expected[2][10:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], expected[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2], expected[1][20:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[3], expected[3][22:], atol=ATOL, rtol=0)
    # execute() samples greedily from the last position of requests that reached their end.
    tokens = runner.execute(step)
    last_rows = [expected[2][-1], expected[0][-1], expected[1][-1], expected[3][-1]]
    assert tokens == [int(row.argmax()) for row in last_rows]
    assert ours.decoder.attention.decode_backend == decode_backend


def test_close_length_fresh_prompts_batched_in_one_call(pair, fresh_prefill_path):
    """Fresh prompts of equal or close lengths (padded to the longest) share one attention
    call; one too much shorter does not; every position matches the reference."""
    ours, ref = pair
    runner = ModelRunner(ours, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    free = shuffled_blocks(4)
    seqs = [random_tokens(20 + i, n) for i, n in enumerate([12, 12, 11, 9])]
    step = [(make_request(f"r{i}", s, free), len(s)) for i, s in enumerate(seqs)]
    spans = runner.prepare(step).meta.prefills
    shapes = [(span.lengths, span.token_end - span.token_start) for span in spans]
    assert shapes == [([12, 12, 11], 35), ([9], 9)]
    for got, seq in zip(runner.compute_logits(step), seqs, strict=True):
        torch.testing.assert_close(got, reference_logits(ref, seq), atol=ATOL, rtol=0)


def test_chunks_over_cached_contexts_of_one_length_batched_in_one_call(pair, fresh_prefill_path):
    """Chunks that start at the same position (prompts over one cached chat template) and
    are of close lengths share one attention call, padded, over their cached contexts; one
    at another position does not; every position matches the reference."""
    ours, ref = pair
    runner = ModelRunner(ours, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    free = shuffled_blocks(5)
    seqs = [random_tokens(30 + i, n) for i, n in enumerate([27, 29, 28, 25])]
    reqs = [make_request(f"r{i}", s, free) for i, s in enumerate(seqs)]
    for request, done in zip(reqs, [8, 8, 8, 5], strict=True):
        run_in_chunks(runner, request, [done])  # their cached contexts
    step = [(r, len(seq) - r.num_computed_tokens) for r, seq in zip(reqs, seqs, strict=True)]
    spans = runner.prepare(step).meta.prefills
    assert [(span.start, span.lengths) for span in spans] == [(8, [19, 21, 20]), (5, [20])]
    for got, request, seq in zip(runner.compute_logits(step), reqs, seqs, strict=True):
        expected = reference_logits(ref, seq)[request.num_computed_tokens :]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_prompts_on_cuda_attend_through_sdpa_flash_or_math_and_on_cpu_as_measured_there():
    """The choice bench/gpu_check.py's prefill and mixed steps measured on an H200
    (docs/performance.md): on CUDA every prompt through SDPA, flash or math; the CPU keeps its
    batched matmuls up to the limit. The fixture above checks both against the reference."""
    from torch.nn.attention import SDPBackend

    cuda = PagedAttention(9, 3, 64, torch.bfloat16, "cuda")
    assert cuda.plain_prefill_max_len == 0
    assert cuda.sdpa_backends == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    cpu = PagedAttention(9, 3, 64, torch.bfloat16, "cpu")
    assert cpu.plain_prefill_max_len == attention_module.PLAIN_PREFILL_MAX_LEN
    assert cpu.sdpa_backends is None
