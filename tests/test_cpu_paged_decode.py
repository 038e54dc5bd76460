"""The C paged-decode kernel (engine/model/kernels/paged_decode.c) against the torch path, its
build (cache key, missing compiler, failed build), and its use by the model runner."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model.attention import PagedAttention
from engine.model.attention_metadata import AttentionMetadata
from engine.model.kernels import cpu_build, cpu_matmul, cpu_paged_decode
from engine.model.loader import build_tiny_model
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from tests.helpers.ahead import ahead, take

REPO = Path(__file__).resolve().parents[1]


def gcc() -> str:
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.fail("gcc is required: the CPU decode kernel is built with it")
    return compiler


@pytest.fixture(scope="module")
def kernel():
    library = cpu_paged_decode.KERNEL.load()
    assert library is not None, cpu_paged_decode.KERNEL.build_error()
    return library


CPU_FLAGS = set(cpu_build.cpu_flags().split())
HAS_AVX2 = {"avx2", "fma"} <= CPU_FLAGS

# Builds of the paths this machine's default build may skip: the plain-C loop, AVX-512
# without the BF16 instructions (bf16 widened to float32 instead), and the AVX2 path (which
# an AVX-512 CPU's default build does not take). Each with the vector_path() it must report.
OTHER_BUILDS = {
    "portable": (("-DPAGED_DECODE_PORTABLE",), 0),
    # both prefetch targets, whichever this CPU kind's build takes (cpu_build.prefetch_flags)
    "prefetch_l1": (("-DPREFETCH_LOCALITY=3",), None),
    "prefetch_l2": (("-DPREFETCH_LOCALITY=1",), None),
}
if platform.machine() == "x86_64":
    OTHER_BUILDS["no_bf16_pairs"] = (("-mno-avx512bf16",), None)
    if HAS_AVX2:
        OTHER_BUILDS["avx2"] = (("-mno-avx512f",), 2)


@ahead(fixture="other_build", tmp_name="kernel-cache")
@contextlib.contextmanager
def built(cache: Path, name: str, **_: object) -> Iterator[dict]:
    """One of OTHER_BUILDS, built into ``cache``: ~8-10 s of gcc each, so started ahead
    (tests/helpers/ahead.py) while the fast tests leave a core idle."""
    yield {"path": cpu_paged_decode.build(gcc(), cache, OTHER_BUILDS[name][0])}


@pytest.fixture(scope="module", params=sorted(OTHER_BUILDS))
def other_build(request, tmp_path_factory):
    expected_path = OTHER_BUILDS[request.param][1]
    with take(built, request.param, tmp_path_factory) as build:
        library = cpu_paged_decode.open_library(build["path"])
    if expected_path is not None:
        assert library.vector_path() == expected_path
    return library


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    cache = tmp_path_factory.mktemp("portable-cache")
    path = cpu_paged_decode.build(gcc(), cache, ("-DPAGED_DECODE_PORTABLE",))
    return cpu_paged_decode.open_library(path)


def random_case(seed: int, dtype, group: int, head_dim: int, block_size: int, num_seqs: int):
    """Caches with random contents, block tables of distinct shuffled blocks, lengths not
    multiples of the block size, the first length 1."""
    rng = random.Random(seed)
    lens = [1] + [rng.randrange(2, 5 * block_size) for _ in range(num_seqs - 1)]
    lens[-1] = 3 * block_size + 5 if num_seqs > 1 else 1
    return case_of_lengths(seed, dtype, group, head_dim, block_size, lens)


def case_of_lengths(
    seed: int,
    dtype,
    group: int,
    head_dim: int,
    block_size: int,
    lens: list[int],
    num_kv_heads: int = 2,
):
    """Caches with random contents and block tables of distinct shuffled blocks for sequences
    of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_seqs = len(lens)
    max_blocks = max((n + block_size - 1) // block_size for n in lens)
    num_blocks = num_seqs * max_blocks + 3
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    table = torch.tensor(
        [[blocks.pop() for _ in range(max_blocks)] for _ in range(num_seqs)], dtype=torch.long
    )
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(num_seqs, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, key_cache, value_cache, table, torch.tensor(lens, dtype=torch.long)


def torch_path(q, key_cache, value_cache, table, seq_lens) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    attention = PagedAttention(num_heads, key_cache.shape[1], head_dim, q.dtype)
    attention.cpu_kernel = None  # the reference path
    meta = AttentionMetadata(
        slot_blocks=torch.zeros(0, dtype=torch.long),
        slot_offsets=torch.zeros(0, dtype=torch.long),
        num_decode_tokens=num_seqs,
        decode_block_table=table,
        decode_seq_lens=seq_lens,
        prefills=[],
    )
    attention.begin_step(meta, key_cache)
    assert attention.decode_backend == "torch"
    out = torch.empty_like(q)
    attention._decode_into(out, q, key_cache, value_cache, meta)
    return out


def exact(q, key_cache, value_cache, table, seq_lens) -> torch.Tensor:
    """float64 attention of each sequence over its positions, for error bounds."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(num_seqs):
        n = int(seq_lens[b])
        blocks = table[b, : (n + block_size - 1) // block_size]
        keys, values = (
            cache[blocks].double().transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :n]
            for cache in (key_cache, value_cache)
        )
        grouped = q[b].double().view(num_kv_heads, -1, head_dim)
        probs = torch.softmax(grouped @ keys.transpose(1, 2) * head_dim**-0.5, dim=-1)
        out[b] = (probs @ values).reshape(num_heads, head_dim)
    return out


def run_kernel(library, case) -> torch.Tensor:
    q, key_cache, value_cache, table, seq_lens = case
    out = torch.full_like(q, float("nan"))
    cpu_paged_decode.paged_decode(
        library, q, key_cache, value_cache, table, seq_lens, out, q.shape[-1] ** -0.5
    )
    return out


def test_kernel_builds_with_gcc_here(kernel):
    gcc()
    assert cpu_paged_decode.KERNEL.build_error() is None
    assert kernel.vector_path() in (0, 1, 2)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 vector paths")
def test_default_build_takes_this_cpus_vector_path(kernel):
    """So the tests against the references below exercise the vector path this CPU runs."""
    expected = 1 if "avx512f" in CPU_FLAGS else 2 if HAS_AVX2 else 0
    assert kernel.vector_path() == expected


@pytest.mark.parametrize("num_seqs", [1, 33])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_float32_matches_torch_path(kernel, group, head_dim, block_size, num_seqs):
    case = random_case(
        group * head_dim + block_size, torch.float32, group, head_dim, block_size, num_seqs
    )
    torch.testing.assert_close(run_kernel(kernel, case), torch_path(*case), atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_seqs", [1, 33])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_bfloat16_matches_torch_path(kernel, group, head_dim, block_size, num_seqs):
    """bf16: the kernel keeps scores in float32 where the torch path rounds them to bf16, so
    both are held to the exact float64 result: the kernel at most as far off as the torch path
    plus half a bf16 step of the output."""
    case = random_case(
        7 + group * head_dim + block_size, torch.bfloat16, group, head_dim, block_size, num_seqs
    )
    reference = exact(*case)
    ours = (run_kernel(kernel, case).double() - reference).abs().max().item()
    theirs = (torch_path(*case).double() - reference).abs().max().item()
    assert ours <= theirs + 4e-3, (ours, theirs)
    assert ours < 2e-2


@pytest.mark.live
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [20, 24, 64, 128])
def test_other_builds_and_odd_head_dims(kernel, other_build, dtype, head_dim):
    """Every build agrees with the exact result. head_dim 20 takes the plain-C loop in all;
    24 the AVX2 path (a multiple of 8, not of 16) or the plain-C loop on AVX-512."""
    case = random_case(11 + head_dim, dtype, 3, head_dim, 16, 9)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    reference = exact(*case)
    for library in (kernel, other_build):
        torch.testing.assert_close(run_kernel(library, case).double(), reference, atol=atol, rtol=0)


# Lengths around the 8- and 16-position chunks and the 16-position blocks: 1, a partial first
# chunk, exactly one chunk, one past it, a block, one past a block, several blocks plus a tail.
EDGE_LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 47, 64, 100, 161]


@pytest.mark.live
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 16])
def test_lengths_at_chunk_and_block_edges(kernel, portable, dtype, group):
    """The vector path and the plain-C loop against the exact result, for every group size the
    vector path specializes (1, 2, 3, 4, 8), one it does not (5), and the largest (16)."""
    case = case_of_lengths(group, dtype, group, 64, 16, EDGE_LENGTHS, num_kv_heads=3)
    reference = exact(*case)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for library in (kernel, portable):
        torch.testing.assert_close(run_kernel(library, case).double(), reference, atol=atol, rtol=0)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("num_seqs", [1, 5, 40])
def test_sequences_fewer_and_more_than_threads(kernel, num_threads, num_seqs):
    """Fewer than 4 sequences per thread split sequences into single kv heads; more keep them
    whole. Each thread's run of items (and its prefetches into the next item) must add up to
    every head of every sequence exactly once."""
    rng = random.Random(num_seqs)
    lens = [rng.randrange(1, 90) for _ in range(num_seqs)]
    case = case_of_lengths(num_seqs, torch.float32, 3, 64, 16, lens, num_kv_heads=3)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = run_kernel(kernel, case)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), exact(*case), atol=1e-5, rtol=0)


@pytest.mark.live
def test_large_score_gaps_underflow_to_zero(kernel, portable):
    """Scores far below the running max (e^x under float32's range, where the vector exp
    clamps) weigh nothing, and a later, larger max rescales what came before."""
    case = case_of_lengths(3, torch.float32, 3, 64, 16, [40, 9, 1], num_kv_heads=3)
    q, key_cache = case[0], case[1]
    q.mul_(30.0)  # scores of several hundred: differences well past -88
    key_cache[case[3][0, 2]] *= 3.0  # the first sequence's max arrives in its third block
    reference = exact(*case)
    for library in (kernel, portable):
        out = run_kernel(library, case)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=0)


def test_block_size_below_a_chunk(kernel):
    case = random_case(5, torch.float32, 2, 64, 4, 6)
    torch.testing.assert_close(run_kernel(kernel, case), torch_path(*case), atol=1e-5, rtol=0)


@pytest.mark.live
def test_build_key_follows_the_source(tmp_path):
    compiler, source = gcc(), cpu_paged_decode.SOURCE
    key = cpu_build.build_key(compiler, source)
    assert cpu_build.build_key(compiler, source) == key
    edited = tmp_path / "paged_decode.c"
    edited.write_text(source.read_text() + "\n/* edited */\n")
    header = tmp_path / "bf16.h"
    header.write_text(source.with_name("bf16.h").read_text())
    assert cpu_build.build_key(compiler, edited) != key
    edited_key = cpu_build.build_key(compiler, edited)
    header.write_text(header.read_text() + "\n/* edited */\n")  # a header it includes
    assert cpu_build.build_key(compiler, edited) != edited_key
    assert cpu_build.build_key(compiler, source, (*cpu_build.FLAGS, "-DX")) != key
    library = cpu_build.build(compiler, tmp_path / "cache", edited)
    assert library.name == f"paged_decode-{cpu_build.build_key(compiler, edited)}.so"
    assert cpu_paged_decode.open_library(library).vector_path() in (0, 1, 2)


FALLBACK_SCRIPT = """
import json, sys
from engine.model.kernels import cpu_paged_decode
from engine.model.loader import build_tiny_model
from engine.runner import ModelRunner
runner = ModelRunner(build_tiny_model("llama", seed=0), 16, 4, "cpu")
print(json.dumps({"loaded": cpu_paged_decode.KERNEL.load() is not None,
                  "error": cpu_paged_decode.KERNEL.build_error(),
                  "kernel": runner.decoder.attention.cpu_kernel is not None,
                  "norm_kernel": runner.decoder.norm_kernel is not None}))
"""


def run_fallback(tmp_path: Path, **env: str) -> dict:
    full_env = {**os.environ, "ITERSCOPE_KERNEL_CACHE": str(tmp_path / "cache"), **env}
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.live
def test_missing_compiler_falls_back_and_says_why(tmp_path):
    result = run_fallback(tmp_path, CC="/nonexistent/cc")
    assert result == {
        "loaded": False,
        "error": result["error"],
        "kernel": False,
        "norm_kernel": False,  # the RMSNorm kernel falls back alike (torch's ops)
    }
    assert "no C compiler" in result["error"]


@pytest.mark.live
def test_failing_build_falls_back_and_says_why(tmp_path):
    broken = tmp_path / "cc"
    broken.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo broken 1; exit 0; fi\n'
        "echo 'cc: internal error' >&2\nexit 1\n"
    )
    broken.chmod(0o755)
    result = run_fallback(tmp_path, CC=str(broken))
    assert not result["loaded"] and not result["kernel"] and not result["norm_kernel"]
    assert "paged_decode.c" in result["error"] and "internal error" in result["error"]


def decode_logits(monkeypatch, dtype: str, enabled: bool) -> tuple[str, torch.Tensor]:
    """Prefill two prompts, then one decode step of both; the decode backend and logits."""
    monkeypatch.setenv("ITERSCOPE_CPU_KERNELS", "1" if enabled else "0")
    runner = ModelRunner(build_tiny_model("qwen3", seed=2, dtype=dtype), 32, 4, "cpu")
    requests = []
    for i, n in enumerate([9, 14]):
        request = Request(
            f"r{i}", [(7 * i + t) % 200 for t in range(n + 1)], SamplingParams(temperature=0)
        )
        request.block_ids = [31 - 8 * i - j for j in range(5)]
        requests.append(request)
    runner.compute_logits([(r, len(r.token_ids) - 1) for r in requests])
    for r in requests:
        r.num_computed_tokens = len(r.token_ids) - 1
    logits = torch.cat(runner.compute_logits([(r, 1) for r in requests]))
    return runner.decoder.attention.decode_backend, logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_decodes_with_the_kernel_and_falls_back_when_disabled(monkeypatch, dtype):
    backend, ours = decode_logits(monkeypatch, dtype, enabled=True)
    assert backend == "cpu_kernel"
    fallback, reference = decode_logits(monkeypatch, dtype, enabled=False)
    assert fallback == "torch"
    assert cpu_paged_decode.KERNEL.load() is None
    if dtype == "float32":
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
        return
    # bf16 rounding differs between the paths (float32 scores in the kernel): both are held
    # to the float32 model, the kernel no further off than the torch path (plus a little).
    _, exact_logits = decode_logits(monkeypatch, "float32", enabled=False)
    ours_error = (ours - exact_logits).abs().max().item()
    torch_error = (reference - exact_logits).abs().max().item()
    assert ours_error <= 1.5 * torch_error + 0.05, (ours_error, torch_error)


def test_float16_keeps_the_torch_path():
    attention = PagedAttention(4, 2, 64, torch.float16)
    assert attention.cpu_kernel is None
    assert not cpu_paged_decode.supports(torch.float16, 4, 2, 64)
    assert not cpu_paged_decode.supports(torch.float32, 68, 2, 64)  # group over MAX_GROUP


class RecordingTriton:
    """Stands in for engine/model/kernels/triton_paged.py: records calls, computes on CPU."""

    def __init__(self, library):
        self.library = library
        self.calls: list[str] = []

    def store_kv(self, k, v, key_cache, value_cache, slot_blocks, slot_offsets) -> None:
        self.calls.append("store_kv")
        key_cache[slot_blocks, :, slot_offsets] = k
        value_cache[slot_blocks, :, slot_offsets] = v

    def paged_decode(self, q, key_cache, value_cache, block_table, seq_lens, out, scale) -> None:
        self.calls.append("paged_decode")
        cpu_paged_decode.paged_decode(
            self.library, q, key_cache, value_cache, block_table, seq_lens, out, scale
        )


def test_cuda_dispatch_stores_and_decodes_through_triton_kernels(kernel):
    """On CUDA (here simulated) the Triton module stores K/V and decodes; prefill stays torch."""
    runner = ModelRunner(build_tiny_model("llama", seed=4), 32, 4, "cpu")
    attention = runner.decoder.attention
    fake = RecordingTriton(kernel)
    attention.cpu_kernel, attention.prefill_kernel, attention.triton = None, None, fake
    request = Request("r", list(range(10, 21)), SamplingParams(temperature=0))
    request.block_ids = [9, 3, 17]
    prefill = runner.compute_logits([(request, 10)])[0]
    assert fake.calls == ["store_kv", "store_kv"]  # one per layer, no decode
    request.num_computed_tokens = 10
    decode = runner.compute_logits([(request, 1)])[0]
    assert attention.decode_backend == "triton"
    assert fake.calls[2:] == ["store_kv", "paged_decode"] * 2
    attention.triton = None  # the torch path on the same cache
    request.num_computed_tokens = 0
    expected = runner.compute_logits([(request, 11)])[0]
    torch.testing.assert_close(torch.cat([prefill, decode]), expected, atol=1e-5, rtol=0)


def test_triton_kernels_only_where_available():
    from engine.model import attention as attention_module
    from engine.model.kernels import triton_paged

    assert attention_module._triton_kernels(torch.device("cpu")) is None
    cuda = torch.device("cuda")
    found = attention_module._triton_kernels(cuda)
    assert (found is triton_paged) == triton_paged.available(cuda)


def test_prefetch_into_l1_only_on_the_kind_measured_faster_so():
    assert cpu_build.prefetch_flags("AuthenticAMD", {"avx2", "avx512f"}) == (
        "-DPREFETCH_LOCALITY=3",
    )
    assert cpu_build.prefetch_flags("AuthenticAMD", {"avx2", "fma"}) == ()
    assert cpu_build.prefetch_flags("GenuineIntel", {"avx2", "avx512f"}) == ()
    flags = set(cpu_build.cpu_flags().split())
    expected = cpu_build.prefetch_flags(cpu_build.cpu_vendor(), flags)
    assert cpu_paged_decode.KERNEL.extra_flags == expected
    assert cpu_matmul.KERNEL.extra_flags == expected  # the matmul kernel prefetches alike
