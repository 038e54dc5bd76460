"""The Triton paged-decode and KV-store kernels against plain torch.

CI has no GPU: each case group runs this file as a script in a subprocess with
TRITON_INTERPRET=1 set before triton is imported, so Triton's interpreter executes the kernels
on CPU tensors and the interpreter never leaks into other tests' imports. That checks the
kernels' indexing, masking, GQA mapping, online softmax and split merge; it proves nothing
about compiling them for a GPU or their speed. On a CUDA machine the same groups also run
compiled on the GPU (test_compiled_on_cuda).

Caches start as NaN everywhere; only each sequence's positions get values, and unused
block-table entries point at an all-NaN block, so a kernel reading one slot too many fails.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {"decode-fp32": 5, "decode-16bit": 4, "decode-split": 5, "store": 4}
NUM_SM90_COMPILES = 12
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


# ---- run in this process (no interpreter): availability and argument checks ----


def test_triton_is_installed():
    import triton

    assert triton.__version__


def test_available_is_false_on_cpu_and_when_disabled(monkeypatch):
    from engine.model.kernels import triton_paged

    assert not triton_paged.available(torch.device("cpu"))
    assert not triton_paged.available("cpu")
    assert not triton_paged.available("not a device")  # never raises
    monkeypatch.setenv("ITERSCOPE_TRITON", "0")
    assert not triton_paged.available(torch.device("cuda"))


def test_split_count_fills_the_sms_once_and_keeps_16_blocks_per_split(monkeypatch):
    from engine.model.kernels import triton_paged

    monkeypatch.setattr(triton_paged, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert triton_paged._pick_num_splits(cuda, 8, 188) == 11  # 188 // 16 caps ceil(132 / 8)
    assert triton_paged._pick_num_splits(cuda, 8, 4096) == 17  # ceil(132 / 8)
    assert triton_paged._pick_num_splits(cuda, 200, 4096) == 1  # already one program per SM
    assert triton_paged._pick_num_splits(cuda, 8, 10) == 1  # too short to split
    assert triton_paged._pick_num_splits(torch.device("cpu"), 8, 4096) == 1


def _decode_args(**changes):
    args = {
        "q": torch.zeros(2, 4, 64),
        "key_cache": torch.zeros(8, 2, 16, 64),
        "value_cache": torch.zeros(8, 2, 16, 64),
        "block_table": torch.zeros(2, 3, dtype=torch.long),
        "seq_lens": torch.ones(2, dtype=torch.long),
        "out": torch.zeros(2, 4, 64),
    }
    return {**args, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q": torch.zeros(2, 4, 64, dtype=torch.float64)}, "dtype"),
        ({"out": torch.zeros(2, 4, 64, dtype=torch.bfloat16)}, "out must match q"),
        ({"q": torch.zeros(2, 3, 64), "out": torch.zeros(2, 3, 64)}, "not a multiple"),
        ({"q": torch.zeros(2, 4, 32), "out": torch.zeros(2, 4, 32)}, "head_dim"),
        ({"q": torch.zeros(2, 64, 4).transpose(1, 2)}, "contiguous"),
        ({"key_cache": torch.zeros(8, 16, 2, 64).transpose(1, 2)}, "key_cache must be contig"),
        ({"value_cache": torch.zeros(8, 2, 32, 64)}, "value_cache"),
        ({"block_table": torch.zeros(3, 3, dtype=torch.long)}, "block_table must have"),
        ({"block_table": torch.zeros(2, 3)}, "int32 or int64"),
        ({"seq_lens": torch.ones(2, 1, dtype=torch.long)}, "seq_lens must have 1 dims"),
        ({"q": torch.zeros(4, 64)}, "q must have 3 dims"),
    ],
)
def test_decode_rejects_bad_arguments(changes, message):
    from engine.model.kernels.triton_paged import paged_decode

    with pytest.raises(ValueError, match=message):
        paged_decode(**_decode_args(**changes), scale=0.125)


def test_decode_rejects_zero_splits():
    from engine.model.kernels.triton_paged import paged_decode

    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        paged_decode(**_decode_args(), scale=0.125, num_splits=0)


def test_store_rejects_bad_arguments():
    from engine.model.kernels.triton_paged import store_kv

    cache = torch.zeros(8, 2, 16, 64)
    slots = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"k must be \[T, KVH, D\]"):
        store_kv(torch.zeros(3, 4, 64), torch.zeros(3, 2, 64), cache, cache.clone(), slots, slots)
    with pytest.raises(ValueError, match="slot_offsets must have 1 dims and 3 rows"):
        store_kv(
            torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache, cache.clone(), slots, slots[:2]
        )
    with pytest.raises(ValueError, match="v is torch.float16"):
        store_kv(
            torch.zeros(3, 2, 64),
            torch.zeros(3, 2, 64, dtype=torch.float16),
            cache,
            cache.clone(),
            slots,
            slots,
        )


# ---- the kernels themselves, in a subprocess ----


def _run_group(group: str, device: str, interpret: bool) -> None:
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, __file__, group, device],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"checked {GROUPS[group]} cases" in done.stdout, output


@pytest.mark.live
@pytest.mark.parametrize("group", list(GROUPS))
def test_interpreted_on_cpu(group):
    _run_group(group, "cpu", interpret=True)


@pytest.mark.live
def test_compiles_for_sm90_without_a_gpu(tmp_path):
    """Triton lowers every kernel variant to a cubin for sm_90 (H100/H200) with its bundled
    ptxas; no GPU is needed to compile, only to run."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, __file__, "compile", "sm90"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"compiled {NUM_SM90_COMPILES} variants for sm_90" in done.stdout, output


@pytest.mark.live
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI: interpreted)")
@pytest.mark.parametrize("group", list(GROUPS))
def test_compiled_on_cuda(group):
    _run_group(group, "cuda", interpret=False)


# ---- the cases (executed only in the subprocess) ----


@dataclass
class DecodeCase:
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    seq_lens: list[int]
    index_dtype: torch.dtype = torch.int64
    strided: bool = False  # q a view into a fused qkv tensor, out a view into a wider one
    num_splits: int | None = None


DECODE_CASES = {
    "decode-fp32": [
        DecodeCase(torch.float32, 3, 1, 64, 16, [1, 17, 33, 16, 40]),
        DecodeCase(torch.float32, 2, 2, 128, 32, [45], index_dtype=torch.int32),
        DecodeCase(torch.float32, 6, 2, 128, 32, [32, 1, 65, 7, 100], strided=True),
        DecodeCase(torch.float32, 4, 4, 64, 16, [1]),
        DecodeCase(torch.float32, 6, 2, 64, 16, [3, 31, 64, 1, 9], index_dtype=torch.int32),
    ],
    "decode-16bit": [
        DecodeCase(torch.bfloat16, 3, 1, 64, 16, [1, 17, 33, 16, 40]),
        DecodeCase(torch.bfloat16, 6, 2, 128, 32, [32, 1, 65, 7, 100], strided=True),
        DecodeCase(torch.float16, 2, 2, 128, 32, [45], index_dtype=torch.int32),
        DecodeCase(torch.float16, 6, 2, 64, 16, [3, 31, 64, 1, 9], strided=True),
    ],
    "decode-split": [
        DecodeCase(torch.float32, 6, 2, 64, 16, [70, 1, 33], num_splits=3),
        DecodeCase(torch.float32, 6, 2, 64, 16, [70, 1, 33], num_splits=4),  # empty splits
        DecodeCase(torch.float32, 2, 2, 128, 32, [200], num_splits=7, strided=True),
        DecodeCase(torch.bfloat16, 3, 1, 64, 16, [70, 1], num_splits=2),
        DecodeCase(torch.float16, 3, 1, 128, 32, [90, 5], num_splits=3),
    ],
}


def _make_decode_inputs(case: DecodeCase, device: str, generator: torch.Generator):
    """Random caches (NaN outside the sequences' positions) and shuffled block tables."""
    num_seqs = len(case.seq_lens)
    blocks_needed = [math.ceil(n / case.block_size) for n in case.seq_lens]
    max_blocks = max(blocks_needed) + 1  # one spare column: never read
    num_blocks = sum(blocks_needed) + 1  # block `poison` stays all NaN
    order = torch.randperm(num_blocks, generator=generator)
    poison, owned = int(order[0]), order[1:].tolist()
    table = torch.full((num_seqs, max_blocks), poison, dtype=torch.long)
    cache_shape = (num_blocks, case.num_kv_heads, case.block_size, case.head_dim)
    key_cache = torch.full(cache_shape, float("nan"))
    value_cache = torch.full(cache_shape, float("nan"))
    for seq, seq_len in enumerate(case.seq_lens):
        for index in range(blocks_needed[seq]):
            block = owned.pop()
            table[seq, index] = block
            used = min(case.block_size, seq_len - index * case.block_size)
            shape = (case.num_kv_heads, used, case.head_dim)
            key_cache[block, :, :used] = torch.randn(shape, generator=generator)
            value_cache[block, :, :used] = torch.randn(shape, generator=generator)
    extra = 2 * case.num_kv_heads if case.strided else 0
    qkv = torch.randn(num_seqs, case.num_heads + extra, case.head_dim, generator=generator)
    out_rows = torch.empty(num_seqs, case.num_heads + 3 * case.strided, case.head_dim)

    def put(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=device, dtype=case.dtype)

    return {
        "q": put(qkv)[:, : case.num_heads],
        "key_cache": put(key_cache),
        "value_cache": put(value_cache),
        "block_table": table.to(device=device, dtype=case.index_dtype),
        "seq_lens": torch.tensor(case.seq_lens, dtype=case.index_dtype, device=device),
        "out": put(out_rows)[:, : case.num_heads],
    }


def _reference_decode(inputs: dict, scale: float) -> torch.Tensor:
    """Plain attention in float64 over each sequence's gathered positions (GQA by repeat)."""
    q, key_cache, value_cache = (
        inputs[name].double().cpu() for name in ("q", "key_cache", "value_cache")
    )
    table, seq_lens = inputs["block_table"].cpu().long(), inputs["seq_lens"].cpu().tolist()
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[1]
    group = num_heads // num_kv_heads
    result = torch.empty_like(q)
    for seq, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        blocks = table[seq, positions // key_cache.shape[2]]
        offsets = positions % key_cache.shape[2]
        keys = key_cache[blocks, :, offsets].transpose(0, 1).repeat_interleave(group, 0)
        values = value_cache[blocks, :, offsets].transpose(0, 1).repeat_interleave(group, 0)
        probs = torch.softmax(torch.einsum("hd,hld->hl", q[seq], keys) * scale, dim=-1)
        result[seq] = torch.einsum("hl,hld->hd", probs, values)
    return result


def _check_decode_group(group: str, device: str) -> int:
    from engine.model.kernels.triton_paged import paged_decode

    generator = torch.Generator().manual_seed(1234)
    for case in DECODE_CASES[group]:
        inputs = _make_decode_inputs(case, device, generator)
        scale = case.head_dim**-0.5
        paged_decode(**inputs, scale=scale, num_splits=case.num_splits)
        got = inputs["out"].double().cpu()
        error = (got - _reference_decode(inputs, scale)).abs().max().item()
        if not error <= TOLERANCES[case.dtype]:  # also catches NaN
            raise AssertionError(f"{case}: max abs error {error}")
    return len(DECODE_CASES[group])


def _check_store_group(device: str) -> int:
    """store_kv equals index assignment, for strided k/v views, both index dtypes and a skip."""
    from engine.model.kernels.triton_paged import store_kv

    generator = torch.Generator().manual_seed(99)
    cases = [
        (torch.float32, torch.int64, 2, 64, 16),
        (torch.float32, torch.int32, 1, 128, 32),
        (torch.bfloat16, torch.int64, 3, 64, 32),
        (torch.float16, torch.int32, 2, 128, 16),
    ]
    for dtype, index_dtype, num_kv_heads, head_dim, block_size in cases:
        num_blocks, num_tokens = 6, 11
        slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
        slot_blocks, slot_offsets = slots // block_size, slots % block_size
        slot_blocks[3] = -1  # a padding token: written nowhere
        fused = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, generator=generator)
        fused = fused.to(device=device, dtype=dtype)
        k, v = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 3 * num_kv_heads :]
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        key_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        value_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        expected_keys, expected_values = key_cache.clone(), value_cache.clone()
        kept = slot_blocks >= 0
        expected_keys[slot_blocks[kept], :, slot_offsets[kept]] = k[kept.to(device)]
        expected_values[slot_blocks[kept], :, slot_offsets[kept]] = v[kept.to(device)]
        store_kv(
            k,
            v,
            key_cache,
            value_cache,
            slot_blocks.to(device=device, dtype=index_dtype),
            slot_offsets.to(device=device, dtype=index_dtype),
        )
        same_keys = torch.equal(key_cache, expected_keys)
        if not (same_keys and torch.equal(value_cache, expected_values)):
            raise AssertionError(f"store_kv {dtype} {index_dtype} differs from index assignment")
    return len(cases)


TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _compile_sm90(kernel, pointer_types: dict[str, str], constexprs: dict) -> str:
    """Compile one specialisation for sm_90; returns its PTX. Scalars: scale fp32, ints i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointer_types.get(name, "fp32" if name == "scale" else "i32")
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    if "cubin" not in compiled.asm:
        raise AssertionError(f"{kernel.__name__}: no cubin")
    return compiled.asm["ptx"]


def _check_sm90_compiles() -> int:
    """Every dtype, split and no split, GQA 1 and 3, head_dim 64 and 128, both index dtypes."""
    import triton.language as tl

    from engine.model.kernels import triton_paged_kernels as kernels
    from engine.model.kernels.triton_paged import _dot_dtype

    num_compiles = 0
    for dtype in TRITON_TYPES:
        data = f"*{TRITON_TYPES[dtype]}"
        dot_dtype = _dot_dtype(dtype)
        for num_splits, group, head_dim, index in ((1, 3, 128, "*i64"), (4, 1, 64, "*i32")):
            pointers = {
                "q_ptr": data,
                "key_cache_ptr": data,
                "value_cache_ptr": data,
                "out_ptr": data,
                "block_table_ptr": index,
                "seq_lens_ptr": index,
                "split_out_ptr": "*fp32",
                "split_lse_ptr": "*fp32",
            }
            constexprs = {
                "GROUP": group,
                "HEAD_DIM": head_dim,
                "BLOCK_SIZE": 16,
                "GROUP_PAD": 16,
                "DIM_PAD": head_dim,
                "BLOCK_PAD": 16,
                "NUM_SPLITS": num_splits,
                "DOT_DTYPE": dot_dtype,
                "DOT_PRECISION": "ieee" if dot_dtype == tl.float32 else "tf32",
            }
            ptx = _compile_sm90(kernels.paged_decode_kernel, pointers, constexprs)
            on_tensor_cores = "mma.sync" in ptx or "wgmma" in ptx
            if on_tensor_cores != (dtype != torch.float32):  # float32: IEEE, never TF32
                raise AssertionError(f"{dtype} decode: tensor-core dots {on_tensor_cores}")
            num_compiles += 1
        _compile_sm90(
            kernels.merge_splits_kernel,
            {"split_out_ptr": "*fp32", "split_lse_ptr": "*fp32", "out_ptr": data},
            {"HEAD_DIM": 128, "DIM_PAD": 128, "NUM_SPLITS": 5, "SPLIT_PAD": 8},
        )
        pointers = {name: data for name in ("k_ptr", "v_ptr", "key_cache_ptr", "value_cache_ptr")}
        pointers.update(slot_blocks_ptr="*i64", slot_offsets_ptr="*i64")
        _compile_sm90(kernels.store_kv_kernel, pointers, {"HEAD_DIM": 96, "DIM_PAD": 128})
        num_compiles += 2
    return num_compiles


def _main(group: str, device: str) -> None:
    import triton

    if group == "compile":
        print(f"compiled {_check_sm90_compiles()} variants for sm_90")
        return
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if (device == "cpu") != interpreted or triton.knobs.runtime.interpret != interpreted:
        raise SystemExit(f"device {device} needs TRITON_INTERPRET=1 exactly when on cpu")
    if group == "store":
        num_cases = _check_store_group(device)
    else:
        num_cases = _check_decode_group(group, device)
    print(f"checked {num_cases} cases")


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
