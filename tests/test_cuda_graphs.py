"""Decode steps replayed from CUDA graphs (engine/model/cuda_graphs.py) compute what the eager
step computes, and their padding rows write nothing.

CI has no GPU: the padded forward pass a graph holds runs eagerly here, with the Triton kernels
interpreted on CPU (TRITON_INTERPRET=1, in a subprocess as tests/test_triton_paged.py does),
against the step's own forward pass. Capture and replay themselves run only on a CUDA machine
(test_replay_on_cuda_matches_eager, and bench/gpu_check.sh's parity and decode steps).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model.attention_metadata import AttentionMetadata
from engine.model.cuda_graphs import NO_SLOT, DecodeGraphs, StaticInputs, batch_buckets
from tests.helpers.processes import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]


def test_buckets_cover_every_batch_up_to_the_largest():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


def decode_meta(num: int, width: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_blocks=torch.arange(num) + 10,
        slot_offsets=torch.arange(num) % 4,
        num_decode_tokens=num,
        decode_block_table=torch.arange(num * width).view(num, width) + 100,
        decode_seq_lens=torch.arange(num) + 7,
        prefills=[],
    )


def test_fill_copies_the_step_and_pads_the_rest_of_the_bucket():
    static = StaticInputs.allocate(8, 6, torch.device("cpu"))
    static.fill(torch.tensor([5, 6, 7]), torch.tensor([6, 7, 8]), decode_meta(3, 2), bucket=4)
    meta = static.meta(4)
    assert meta.num_decode_tokens == 4 and meta.decode_block_table.shape == (4, 6)
    assert static.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert meta.slot_blocks.tolist() == [10, 11, 12, NO_SLOT]
    assert meta.decode_seq_lens.tolist() == [7, 8, 9, 1]
    assert meta.decode_block_table[:3, :2].tolist() == [[100, 101], [102, 103], [104, 105]]
    assert meta.decode_block_table[3].tolist() == [0] * 6
    # a smaller step afterwards: its padded rows forget the earlier step's values
    static.fill(torch.tensor([9]), torch.tensor([3]), decode_meta(1, 1), bucket=2)
    assert static.slot_blocks[:2].tolist() == [10, NO_SLOT]
    assert static.seq_lens[:2].tolist() == [7, 1]


def test_only_decode_steps_that_fit_a_captured_bucket_replay():
    graphs = DecodeGraphs(None, torch.zeros(1), max_batch=8, max_blocks=4)
    graphs.graphs = {bucket: None for bucket in graphs.buckets}  # as if captured
    assert graphs.bucket_for(decode_meta(3, 2)) == 4
    assert graphs.bucket_for(decode_meta(8, 4)) == 8
    assert graphs.bucket_for(decode_meta(9, 2)) is None  # more requests than the largest
    assert graphs.bucket_for(decode_meta(2, 5)) is None  # a table wider than captured
    with_prefill = decode_meta(2, 2)
    with_prefill.prefills = [object()]
    assert graphs.bucket_for(with_prefill) is None


PADDED_FORWARD = """
import os, random, sys
assert os.environ["TRITON_INTERPRET"] == "1"
import torch
from engine.model.cuda_graphs import DecodeGraphs
from engine.model.kernels import triton_paged
from engine.model.loader import build_tiny_model
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner

model = build_tiny_model("llama", seed=1)
attention = model.decoder.attention
attention.triton, attention.cpu_kernel = triton_paged, None  # the CUDA path, interpreted
runner = ModelRunner(model, 24, 4, "cpu")
free = list(range(24))
random.Random(0).shuffle(free)
requests = []
for i, length in enumerate((3, 9, 14)):
    request = Request(f"r{i}", [random.Random(i).randrange(256) for _ in range(length)],
                      SamplingParams(temperature=0))
    request.block_ids = [free.pop() for _ in range(length // 4 + 1)]
    request.token_ids.append(runner.execute([(request, length)])[0])
    request.num_computed_tokens = length
    requests.append(request)
inputs = runner.prepare([(r, 1) for r in requests])
eager_cache = runner.kv_cache.clone()
eager = model.decoder.forward(inputs.input_ids, inputs.positions, inputs.meta, eager_cache)
for bucket in (3, 4, 8):
    padded_cache = runner.kv_cache.clone()
    graphs = DecodeGraphs(model.decoder, padded_cache, max_batch=8, max_blocks=6)
    graphs.static.fill(inputs.input_ids, inputs.positions, inputs.meta, bucket)
    padded = graphs.forward_static(bucket)
    assert padded.shape[0] == bucket, padded.shape
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded_cache, eager_cache), "a padded row wrote to the KV cache"
print("ok", attention.decode_backend)
"""


@pytest.mark.live
def test_padded_forward_matches_the_eager_step_with_the_triton_kernels_interpreted():
    done = subprocess.run(
        [sys.executable, "-c", PADDED_FORWARD],
        cwd=ROOT,
        env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=child_pythonpath()),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["ok", "triton"]


@pytest.mark.live
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI: interpreted)")
def test_replay_on_cuda_matches_eager():
    """The engine on a GPU, float32: the same tokens with CUDA graphs as with --enforce-eager,
    over steps of every batch size from 1 to 6 (requests finishing at different lengths)."""
    from engine.config import EngineConfig
    from engine.model.loader import build_tiny_model
    from engine.request import Request, SamplingParams
    from engine.startup import build_engine_core

    def run(cuda_graphs: bool) -> dict[str, list[int]]:
        model = build_tiny_model("llama", seed=2, device="cuda")
        config = EngineConfig(
            model="tiny", dtype="float32", device="cuda", max_num_seqs=6, max_model_len=128,
            kv_cache_memory_bytes=1 << 26, cuda_graphs=cuda_graphs,
        )  # fmt: skip
        core, _ = build_engine_core(config, load_model=lambda *a: model)
        assert (core.runner.decode_graphs is not None) == cuda_graphs
        tokens: dict[str, list[int]] = {}
        for i in range(6):
            params = SamplingParams(temperature=0, max_tokens=8 + 7 * i, ignore_eos=True)
            tokens[f"r{i}"] = []
            core.add_request(Request(f"r{i}", list(range(3 + 5 * i, 20 + 9 * i)), params))
        while core.has_work:
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
        return tokens

    assert run(cuda_graphs=True) == run(cuda_graphs=False)
