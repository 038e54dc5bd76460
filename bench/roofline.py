"""This machine's own limits with SmolLM2-135M's shapes, and the time a workload needs at them.

    .venv/bin/python bench/roofline.py [--dtype auto|float32|bfloat16] [--threads N]

Limits, measured here with torch (the best of several timed runs, all cores unless --threads):
- matmul GFLOP/s per dtype (the fastest of torch's linear, oneDNN's packed one and the
  engine's Linear, which is the CPU matmul kernel on the kinds it runs on) at the
  prefill shape (a 2048-token chunk through the MLP's up
  projection, 2048 x 576 @ 576 x 1536) and at each workload's decode shape (one row per
  request decoding at once: 16 or 32);
- memory bandwidth: bytes read per second summing a 1 GiB tensor.

The bound of a workload (N requests of P prompt and O output tokens, at most C at once), at
those limits and with perfect continuous batching, FLOPs at the best matmul rate measured (a
kernel slower at the decode shape is a kernel's limit, not the machine's):
- prefill: the FLOPs of N x P prompt tokens (projections, attention over the prompt so far and
  one output projection per request);
- decode: N x O / C iterations of C tokens each, each taking the longer of its FLOPs and its
  bytes (every weight once, the tied embedding once as the output projection, and each
  request's KV cache) at the bandwidth.
The serving workload is bench/serving_vs_vllm.py's (64 x 256 in / 128 out, concurrency 16),
the offline one bench/throughput.py's (64 x 256 / 128, max 32 at once). A server's
roofline share is its output tok/s over the bound's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.auto_dtype import auto_dtype, cpu_flags  # noqa: E402
from engine.model.gguf_file import gguf_hf_config, open_gguf  # noqa: E402
from engine.model.linear import Linear, pack_weight  # noqa: E402
from engine.model.paths import resolve_model_path  # noqa: E402

KIND_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
PREFILL_ROWS = 2048


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    output_len: int
    concurrency: int


SERVING = Workload("serving", 64, 256, 128, 16)  # bench/vllm_server.py BENCH_LOAD
OFFLINE = Workload("offline", 64, 256, 128, 32)  # bench/throughput.py's defaults


@dataclass(frozen=True)
class Limits:
    prefill_flops_per_s: float
    decode_flops_per_s: dict[int, float]  # by rows: requests decoding at once
    bytes_per_s: float

    @property
    def peak_flops_per_s(self) -> float:
        return max(self.prefill_flops_per_s, *self.decode_flops_per_s.values())


@dataclass(frozen=True)
class Shapes:
    """What one token costs in SmolLM2-135M (from its GGUF's own config)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def smollm2(cls) -> Shapes:
        hf = gguf_hf_config(open_gguf(resolve_model_path("smollm2")))
        return cls(
            hf["num_hidden_layers"],
            hf["hidden_size"],
            hf["intermediate_size"],
            hf["num_attention_heads"],
            hf["num_key_value_heads"],
            hf["head_dim"],
            hf["vocab_size"],
        )

    @property
    def layer_weights(self) -> int:
        """Weights of the projections one token goes through in each layer."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_and_o + k_and_v + 3 * self.hidden * self.intermediate

    @property
    def weights(self) -> int:
        """Every weight a decode step reads: the layers and the tied embedding, once."""
        return self.layers * self.layer_weights + self.vocab * self.hidden

    def token_flops(self, context: float) -> float:
        """One token through every layer, attending over ``context`` positions."""
        attention = 4 * self.heads * self.head_dim * context
        return self.layers * (2 * self.layer_weights + attention)

    @property
    def logits_flops(self) -> int:
        return 2 * self.hidden * self.vocab

    def kv_elements_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim


def cpu_kind() -> dict:
    """The CPU's model name and the flags that choose our kernels' paths."""
    flags = cpu_flags()
    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    return {"cpu": name, "cpu_flags": [flag for flag in KIND_FLAGS if flag in flags]}


def best_seconds(run, repeats: int = 7) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_flops_per_s(rows: int, shapes: Shapes, dtype: torch.dtype) -> float:
    """The fastest at this shape of torch's plain linear, oneDNN's packed one (where the CPU
    can pack this dtype: often several times faster) and the engine's Linear (the CPU matmul
    kernel, engine/model/kernels/matmul.c, where it runs)."""
    x = torch.randn(rows, shapes.hidden).to(dtype)
    w = torch.randn(shapes.intermediate, shapes.hidden).to(dtype)
    engine_linear = Linear(w)
    candidates = [lambda: torch.nn.functional.linear(x, w), lambda: engine_linear(x)]
    try:
        packed = pack_weight(w)
    except (RuntimeError, AttributeError):  # no oneDNN, or no bf16 in this CPU
        pass
    else:
        candidates.append(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")
        )
    calls = max(1, 8192 // rows)
    flops = 2 * rows * shapes.hidden * shapes.intermediate * calls
    return max(
        flops / best_seconds(lambda run=run: [run() for _ in range(calls)]) for run in candidates
    )


def read_bytes_per_s(size_bytes: int = 1 << 30) -> float:
    data = torch.ones(size_bytes // 4, dtype=torch.float32)
    return size_bytes / best_seconds(data.sum, repeats=5)


def measure_limits(shapes: Shapes, dtype: torch.dtype, decode_rows: set[int]) -> Limits:
    return Limits(
        matmul_flops_per_s(PREFILL_ROWS, shapes, dtype),
        {rows: matmul_flops_per_s(rows, shapes, dtype) for rows in sorted(decode_rows)},
        read_bytes_per_s(),
    )


def bound_seconds(load: Workload, shapes: Shapes, limits: Limits, element_bytes: int) -> dict:
    """The least time ``load`` needs at ``limits``: prefill and decode, in seconds."""
    prompt_flops = sum(shapes.token_flops(position) for position in range(load.prompt_len))
    prefill_flops = load.num_requests * (prompt_flops + shapes.logits_flops)
    iterations = load.num_requests * load.output_len / load.concurrency
    mean_context = load.prompt_len + load.output_len / 2
    step_flops = load.concurrency * (shapes.token_flops(mean_context) + shapes.logits_flops)
    kv_elements = load.concurrency * mean_context * shapes.kv_elements_per_token()
    step_bytes = (shapes.weights + kv_elements) * element_bytes
    compute_s = step_flops / limits.peak_flops_per_s
    step_s = max(compute_s, step_bytes / limits.bytes_per_s)
    prefill_s = prefill_flops / limits.peak_flops_per_s
    return {
        "prefill_s": prefill_s,
        "decode_s": iterations * step_s,
        "decode_step_bound_by": "compute" if compute_s == step_s else "memory",
        "output_tokens_per_s": load.num_requests
        * load.output_len
        / (prefill_s + iterations * step_s),
    }


def roofline(dtype_name: str = "auto") -> dict:
    """This machine's limits and the serving and offline workloads' bounds, for ``dtype``."""
    if dtype_name == "auto":
        dtype_name = auto_dtype("cpu")[0]
    dtype = getattr(torch, dtype_name)
    shapes = Shapes.smollm2()
    limits = measure_limits(shapes, dtype, {load.concurrency for load in (SERVING, OFFLINE)})
    element_bytes = dtype.itemsize
    return {
        **cpu_kind(),
        "dtype": dtype_name,
        "num_threads": torch.get_num_threads(),
        "prefill_gflops": round(limits.prefill_flops_per_s / 1e9, 1),
        "decode_gflops": {
            rows: round(rate / 1e9, 1) for rows, rate in limits.decode_flops_per_s.items()
        },
        "read_gb_per_s": round(limits.bytes_per_s / 1e9, 1),
        **{
            load.name: bound_seconds(load, shapes, limits, element_bytes)
            for load in (SERVING, OFFLINE)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = roofline(args.dtype)
    print(f"{figures['cpu']} ({', '.join(figures['cpu_flags'])}), {figures['dtype']}, "
          f"{figures['num_threads']} threads")  # fmt: skip
    print(
        f"matmul GFLOP/s: {figures['prefill_gflops']} at {PREFILL_ROWS} rows, "
        + ", ".join(f"{rate} at {rows}" for rows, rate in figures["decode_gflops"].items())
        + f"; memory read {figures['read_gb_per_s']} GB/s"
    )
    for load in (SERVING, OFFLINE):
        bound = figures[load.name]
        print(
            f"{load.name} ({load.num_requests} x {load.prompt_len} in / {load.output_len} out, "
            f"{load.concurrency} at once): prefill {bound['prefill_s']:.1f} s + decode "
            f"{bound['decode_s']:.1f} s ({bound['decode_step_bound_by']}-bound) -> at most "
            f"{bound['output_tokens_per_s']:.1f} output tok/s"
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
