"""The start-up timing that chooses a CPU Linear's matmul on kinds not measured before
(engine/model/matmul_choice.py), run here whatever this CPU's kind, several times: what it
finds, whether it would choose the kernel, and what the table of measured kinds says.

    .venv/bin/python bench/matmul_choice.py [--rounds 5] [--dtype float32|bfloat16]

A timing that agrees with the measured table on a measured kind, round after round, is what
lets the engine trust it on the kinds no session has seen. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.roofline import cpu_kind  # noqa: E402
from engine.model import matmul_choice  # noqa: E402
from engine.model.kernels import cpu_build, cpu_matmul  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    vendor, flags = cpu_build.this_cpu()
    reason = cpu_matmul.why_not(vendor, flags, dtype, matmul_choice.WEIGHT_SHAPE[1])
    library = cpu_matmul.KERNEL.load()
    if reason or library is None:
        print(f"the kernel cannot run here: {reason or cpu_matmul.KERNEL.build_error()}")
        return 1
    weight_bytes = matmul_choice.weight_bytes()
    rounds = []
    for number in range(args.rounds):
        start = time.perf_counter()
        found = matmul_choice.measure(library, dtype, weight_bytes)
        seconds = time.perf_counter() - start
        rounds.append((found, seconds))
        print(
            f"round {number + 1}: kernel / oneDNN {found.decode_ratio:.3f} at "
            f"{matmul_choice.DECODE_ROWS} rows, {found.prefill_ratio:.3f} at "
            f"{matmul_choice.PREFILL_ROWS}: {'kernel' if found.kernel_wins else 'oneDNN'} "
            f"({seconds:.2f} s)"
        )
    measured = cpu_matmul.measured_kind(vendor, flags)
    chosen = [found.kernel_wins for found, _ in rounds]
    print(
        f"{sum(chosen)} of {len(chosen)} timings choose the kernel; the measured kinds' table "
        f"says {'kernel' if measured else 'not measured'} for this CPU "
        f"({weight_bytes >> 20} MiB of {args.dtype} weights streamed at "
        f"{matmul_choice.DECODE_ROWS} rows)"
    )
    figures = {
        **cpu_kind(),
        "dtype": args.dtype,
        "weight_mib": weight_bytes >> 20,
        "decode_ratios": [round(found.decode_ratio, 3) for found, _ in rounds],
        "prefill_ratios": [round(found.prefill_ratio, 3) for found, _ in rounds],
        "kernel_chosen": chosen,
        "measured_kind": measured,
        "seconds_median": round(statistics.median(seconds for _, seconds in rounds), 3),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
