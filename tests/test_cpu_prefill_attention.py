"""The C prefill attention kernel (engine/model/kernels/prefill_attention.c) against a float64
reference, built for this machine, for AVX2 and for SSE only (the vector code gcc makes of
the same source on CPUs without AVX-512 or AVX); its table checks; and its use by the runner
(logits as torch's prefill path gives them, and that path kept when the kernel is off)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.attention_metadata import AttentionMetadata, check_prefill_tables
from engine.model.kernels import cpu_prefill_attention
from engine.model.loader import build_tiny_model
from tests.helpers.cpu_kernels import build_names, load_build


@pytest.fixture(scope="module", params=build_names())
def library(request, tmp_path_factory):
    return load_build(request.param, cpu_prefill_attention, tmp_path_factory)


class Case:
    """Random caches and queries for chunks given as (first position, length); each chunk's
    blocks are distinct, shuffled ids. ``run`` calls the kernel, ``reference`` computes the
    same in float64 from the cache."""

    def __init__(self, dtype, chunks, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim, self.block_size = (
            heads,
            kv_heads,
            head_dim,
            block_size,
        )
        blocks_per_chunk = [math.ceil((start + n) / block_size) for start, n in chunks]
        num_blocks = sum(blocks_per_chunk) + 3
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.key_cache = torch.randn(shape, generator=generator).to(dtype)
        self.value_cache = torch.randn(shape, generator=generator).to(dtype)
        ids = torch.randperm(num_blocks, generator=generator).tolist()
        rows, info, token = [], [], 0
        for (start, n), count in zip(chunks, blocks_per_chunk, strict=True):
            rows.append([ids.pop() for _ in range(count)])
            info.append((token, start, n))
            token += n
        longest = max(blocks_per_chunk)
        self.table = torch.tensor([r + [0] * (longest - len(r)) for r in rows], dtype=torch.long)
        self.chunks = torch.tensor(info, dtype=torch.long).T.contiguous()
        self.q = (torch.randn(token, heads, head_dim, generator=generator) * 2).to(dtype)

    def run(self, library, threads=2) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        floats = cpu_prefill_attention.scratch_floats(
            library, self.chunks, self.kv_heads, self.head_dim, threads
        )
        scratch = torch.empty(floats, dtype=torch.float32)
        scale = self.head_dim**-0.5
        cpu_prefill_attention.prefill_attention(
            library, self.q, self.key_cache, self.value_cache, self.table, self.chunks, out,
            scratch, scale, threads,
        )  # fmt: skip
        return out

    def reference(self) -> torch.Tensor:
        group = self.heads // self.kv_heads
        out = torch.empty(self.q.shape, dtype=torch.float64)
        for c, (token, start, n) in enumerate(self.chunks.T.tolist()):
            positions = torch.arange(start + n)
            blocks = self.table[c][positions // self.block_size]
            offsets = positions % self.block_size
            keys = self.key_cache[blocks, :, offsets].double()  # [P, KVH, D]
            values = self.value_cache[blocks, :, offsets].double()
            future = positions[None, :] > (start + torch.arange(n))[:, None]
            for head in range(self.heads):
                queries = self.q[token : token + n, head].double()
                scores = queries @ keys[:, head // group].T * self.head_dim**-0.5
                probs = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
                out[token : token + n, head] = probs @ values[:, head // group]
        return out


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == torch.float32:  # float32 sums in another order than float64's
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # rounded once to bf16 at the end: within one bf16 step of the exact value
        torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=1e-3)


CHUNK_SETS = {
    "fresh prompts": [(0, 270), (0, 270), (0, 250)],
    "over a cached prefix and later chunks": [(16, 254), (202, 68), (0, 33)],
    "short and one-token chunks": [(5, 2), (0, 1), (31, 17)],
    "a chunk deep into a long prompt": [(3000, 70)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", list(CHUNK_SETS), ids=str)
def test_matches_a_float64_reference(library, dtype, chunks):
    case = Case(dtype, CHUNK_SETS[chunks])
    assert_matches(case.run(library), case.reference())


# (heads, kv heads, head_dim, block size): SmolLM2's; a Llama-like group of 4 at 128 (an
# unrolled size); one kv head for 8 (past the 6-row micro-tile); plain multi-head at 48 (the
# generic loop) with blocks of 7 positions (none a multiple of the vector width)
SHAPES = [(9, 3, 64, 16), (16, 4, 128, 16), (8, 1, 64, 32), (4, 4, 48, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_model_shapes_and_block_sizes(library, dtype, shape):
    heads, kv_heads, head_dim, block_size = shape
    case = Case(dtype, [(3, 40), (0, 77)], heads, kv_heads, head_dim, block_size, seed=1)
    assert_matches(case.run(library), case.reference())


@pytest.mark.parametrize("threads", [1, 3])
def test_any_number_of_threads(library, threads):
    case = Case(torch.float32, [(0, 100), (40, 50)], seed=threads)
    assert_matches(case.run(library, threads), case.reference())


def test_only_the_chunks_rows_are_written(library):
    """Rows of q outside the chunks (a step's decodes come first) are left as they were."""
    case = Case(torch.float32, [(0, 20)])
    case.q = torch.cat([torch.randn(4, 9, 64), case.q])
    case.chunks[0] += 4  # the chunk's rows now start at 4
    got = case.run(library)
    assert got[:4].isnan().all()
    case.q, case.chunks[0] = case.q[4:], case.chunks[0] - 4
    assert_matches(got[4:], case.reference())


def test_a_huge_score_gap_gives_probability_zero_not_nan(library):
    case = Case(torch.float32, [(0, 40)])
    case.q *= 1e4  # scores spread by ~1e5: every probability but the largest underflows
    got = case.run(library)
    assert not got.isnan().any()
    assert_matches(got, case.reference())


def meta_for(chunks: torch.Tensor, table: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        slot_blocks=torch.zeros(10, dtype=torch.long),
        slot_offsets=torch.zeros(10, dtype=torch.long),
        num_decode_tokens=0,
        decode_block_table=None,
        decode_seq_lens=None,
        prefills=[],
        prefill_chunks=chunks,
        prefill_block_table=table,
    )


def test_table_checks_pass_a_good_step_and_refuse_bad_ones():
    good_chunks = torch.tensor([[0, 6], [0, 16], [6, 4]])  # token starts, starts, lengths
    good_table = torch.tensor([[3, 0], [1, 2]])
    check_prefill_tables(meta_for(good_chunks, good_table), 10, 4, 16)
    bad = {
        "a block id past the cache": (good_chunks, torch.tensor([[3, 0], [1, 4]])),
        "positions past the table": (torch.tensor([[0, 6], [0, 30], [6, 4]]), good_table),
        "rows past the step": (torch.tensor([[0, 7], [0, 16], [6, 4]]), good_table),
        "an empty chunk": (torch.tensor([[0, 6], [0, 16], [6, 0]]), good_table),
        "int32 tables": (good_chunks.int(), good_table),
        "a table per chunk missing": (good_chunks, good_table[:1]),
    }
    for reason, (chunks, table) in bad.items():
        with pytest.raises(ValueError):
            check_prefill_tables(meta_for(chunks, table), 10, 4, 16)
            pytest.fail(f"accepted {reason}")


def runner_logits(monkeypatch, dtype: str, kernel: bool) -> tuple[bool, torch.Tensor]:
    """Two fresh prompts of unequal lengths, then a third over the first's cached blocks (as
    a prefix cache hit leaves it) beside a chunk that continues the second, on a tiny Llama:
    whether attention took the kernel, and every logit."""
    from engine.request import Request, SamplingParams
    from engine.runner import ModelRunner

    if not kernel:
        monkeypatch.setattr(cpu_prefill_attention.KERNEL, "load", lambda: None)
    runner = ModelRunner(build_tiny_model("llama", seed=3, dtype=dtype), 40, 4, "cpu")
    tokens = [[(7 * i + t) % 200 for t in range(n)] for i, n in enumerate([13, 22, 17])]
    tokens[2][:8] = tokens[0][:8]  # two blocks shared with the first prompt
    requests = [Request(f"r{i}", t, SamplingParams(temperature=0)) for i, t in enumerate(tokens)]
    requests[0].block_ids = [1, 2, 3, 4]
    requests[1].block_ids = [10, 11, 12, 13, 14, 15]
    requests[2].block_ids = [1, 2, 20, 21, 22]
    first = runner.compute_logits([(requests[0], 13), (requests[1], 12)])
    requests[1].num_computed_tokens, requests[2].num_computed_tokens = 12, 8
    second = runner.compute_logits([(requests[1], 10), (requests[2], 9)])
    took_kernel = runner.decoder.attention.prefill_kernel is not None
    return took_kernel, torch.cat([*first, *second])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_with_the_kernel_gives_the_torch_paths_logits(monkeypatch, dtype):
    took_kernel, ours = runner_logits(monkeypatch, dtype, kernel=True)
    assert took_kernel
    took_it_anyway, reference = runner_logits(monkeypatch, dtype, kernel=False)
    assert not took_it_anyway
    # float32: the sums' order; bf16: torch rounds scores and probabilities to bf16, the
    # kernel keeps them in float32
    atol = 1e-4 if dtype == "float32" else 0.1
    torch.testing.assert_close(ours, reference, atol=atol, rtol=0)


def test_kernels_off_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv("ITERSCOPE_CPU_KERNELS", "0")
    assert cpu_prefill_attention.KERNEL.load() is None
    assert build_tiny_model("llama", seed=0).decoder.attention.prefill_kernel is None


def test_float16_and_odd_head_dims_keep_the_torch_path():
    assert not cpu_prefill_attention.supports(torch.float16, 9, 3, 64)
    assert not cpu_prefill_attention.supports(torch.float32, 9, 3, 72)  # not whole vectors
    assert not cpu_prefill_attention.supports(torch.float32, 9, 2, 64)  # no whole groups
    assert cpu_prefill_attention.supports(torch.bfloat16, 32, 8, 128)
