"""The CPU paged-decode kernel (engine/model/kernels/paged_decode.c): this machine's default
build (its vector path: AVX-512 or AVX2) against the portable build (-DPAGED_DECODE_PORTABLE),
side by side in one process.

    .venv/bin/python bench/paged_decode_kernel.py [--dtype float32] [--layers 30] [--repeats 7]

Shapes of SmolLM2-135M decode: 9 query heads, 3 kv heads, head_dim 64, block size 16, for
batches of 16 and 32 sequences at contexts of 300 and 1000 positions. Each layer has its own
cache with its blocks shuffled (as a pool hands them out after some churn), so one step reads
every layer's blocks from memory as the engine's does. One timed step = the kernel called
once per layer. The builds take turns step by step (interleaved), so load from other work on
the machine hits both alike; each time is the median over the repeats, in ms per step, and
the speedup is the median of the repeats' portable / vector ratios (each ratio from one pair
of neighbouring steps). Before timing, both builds'
outputs are compared. The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.model.kernels import cpu_paged_decode  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M
CASES = [(16, 300), (16, 1000), (32, 300), (32, 1000)]  # (batch, context)


def build_libraries() -> dict[str, object]:
    """{"vector": the default build, "portable": the plain-C build}, both from the kernel cache."""
    vector = cpu_paged_decode.KERNEL.load()
    if vector is None:
        sys.exit(f"no kernel: {cpu_paged_decode.KERNEL.build_error()}")
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    cache_dir = Path(
        os.environ.get("ITERSCOPE_KERNEL_CACHE", Path.home() / ".cache" / "iterscope" / "kernels")
    )
    portable = cpu_paged_decode.open_library(
        cpu_paged_decode.build(compiler, cache_dir, ("-DPAGED_DECODE_PORTABLE",))
    )
    return {"portable": portable, "vector": vector}


def make_layers(num_layers: int, batch: int, context: int, dtype: torch.dtype, seed: int):
    """Per layer: q, key cache, value cache, block table (shuffled blocks), out; and seq_lens.
    Lengths vary around `context` (+-10%) so the last blocks are partly filled."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(int(context * 0.9), int(context * 1.1)) for _ in range(batch)]
    max_blocks = max(math.ceil(n / BLOCK_SIZE) for n in lens)
    num_blocks = batch * max_blocks
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    layers = []
    for _ in range(num_layers):
        blocks = list(range(num_blocks))
        rng.shuffle(blocks)
        table = torch.tensor(blocks, dtype=torch.long).view(batch, max_blocks)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        key_cache = torch.randn(shape, generator=gen).to(dtype)
        value_cache = torch.randn(shape, generator=gen).to(dtype)
        layers.append((q, key_cache, value_cache, table, torch.empty_like(q)))
    return layers, torch.tensor(lens, dtype=torch.long)


def step(library, layers, seq_lens) -> None:
    for q, key_cache, value_cache, table, out in layers:
        cpu_paged_decode.paged_decode(
            library, q, key_cache, value_cache, table, seq_lens, out, HEAD_DIM**-0.5
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    libraries = build_libraries()
    vector_path = libraries["vector"].vector_path()
    print(
        f"vector path {vector_path} (1 AVX-512, 2 AVX2, 0 none), {args.dtype}, "
        f"{torch.get_num_threads()} threads, {args.layers} layers, ms per step (median of "
        f"{args.repeats})"
    )
    cases = []
    for batch, context in CASES:
        layers, seq_lens = make_layers(args.layers, batch, context, dtype, seed=batch + context)
        outputs = {}
        for name, library in libraries.items():  # also warms up both
            step(library, layers[:1], seq_lens)
            outputs[name] = layers[0][4].float().clone()
        max_diff = (outputs["vector"] - outputs["portable"]).abs().max().item()
        times: dict[str, list[float]] = {name: [] for name in libraries}
        for _ in range(args.repeats):
            for name, library in libraries.items():
                start = time.perf_counter()
                step(library, layers, seq_lens)
                times[name].append((time.perf_counter() - start) * 1e3)
        portable, vector = (statistics.median(times[n]) for n in ("portable", "vector"))
        pairs = zip(times["portable"], times["vector"], strict=True)
        speedup = statistics.median([p / v for p, v in pairs])
        case = {
            "batch": batch,
            "context": context,
            "portable_ms": round(portable, 2),
            "vector_ms": round(vector, 2),
            "speedup": round(speedup, 2),
            "max_abs_diff": max_diff,
        }
        cases.append(case)
        print(
            f"batch {batch:2d} context {context:4d}: portable {portable:8.2f}  vector "
            f"{vector:8.2f}  speedup {speedup:5.2f}x  (max |diff| {max_diff:.1e})"
        )
    geomean = math.exp(statistics.fmean(math.log(c["speedup"]) for c in cases))
    print(f"geometric mean speedup {geomean:.2f}x")
    print(
        json.dumps(
            {
                "vector_path": vector_path,
                "dtype": args.dtype,
                "num_threads": torch.get_num_threads(),
                "layers": args.layers,
                "repeats": args.repeats,
                "cases": cases,
                "geomean_speedup": round(geomean, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
