"""Which matmul a CPU Linear runs: the CPU matmul kernel's panels or oneDNN's packed weights.

    the kernel's own conditions   cpu_matmul.why_not: its vectors (AVX2 with FMA, or AVX-512),
                                  the dtype (bf16 needs AVX512_BF16 and an even input size)
    a measured kind               cpu_matmul.measured_kind: the kinds the kernel was measured
                                  faster on (docs/performance.md): the kernel runs
    any other kind                timed here once per machine and dtype, at the first Linear
                                  that could take the kernel, and kept (kept_path) so that
                                  every process on the machine chooses alike and no later one
                                  times again: the kernel runs if it took at most DECODE_WIN
                                  of oneDNN's time at DECODE_ROWS rows with the weights
                                  streamed from memory (a decode step) and at most
                                  PREFILL_SLACK at PREFILL_ROWS (prefill, compute-bound, where
                                  oneDNN may use units the kernel does not, as AMX)

The timing streams synthetic weights of at least twice the last-level cache, so neither path
reads them from cache, and alternates the two paths, best of CALIBRATION_REPEATS each; it
costs a few tenths of a second, and holds the weights in both layouts meanwhile (at most
2 x MAX_WEIGHT_BYTES). Both paths compute the same products (docs/performance.md), so a
choice made on a busy machine costs speed, never correctness; deleting the kept file times
again. The engine's start-up line says which ran and why, and where the timing is kept
(engine/model/decoder.py cpu_kernels_line).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.kernels import cpu_build, cpu_matmul
from engine.model.onednn import pack_weight, packed_product, packing_available

DECODE_ROWS = 16
PREFILL_ROWS = 256
DECODE_WIN = 0.95  # the kernel's time over oneDNN's at DECODE_ROWS, at most
PREFILL_SLACK = 1.10  # the same at PREFILL_ROWS, at most
CALIBRATION_REPEATS = 5
WEIGHT_SHAPE = (2048, 1024)  # out, in: a projection of a small model
MIN_WEIGHT_BYTES, MAX_WEIGHT_BYTES = 64 << 20, 256 << 20
L3_SIZE_PATH = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")


@dataclass(frozen=True)
class Calibration:
    """The kernel's time over oneDNN's on this CPU, best of CALIBRATION_REPEATS each."""

    decode_ratio: float  # at DECODE_ROWS rows, the weights streamed from memory
    prefill_ratio: float  # at PREFILL_ROWS rows
    kept_in: str = ""  # the file this machine keeps it in ("" where it could not be written)

    @property
    def kernel_wins(self) -> bool:
        return self.decode_ratio <= DECODE_WIN and self.prefill_ratio <= PREFILL_SLACK

    def text(self) -> str:
        """What was timed, for the start-up line."""
        kept = f"; kept in {self.kept_in}, delete it to time again" if self.kept_in else ""
        return (
            f"timed on this CPU kind: the kernel took {self.decode_ratio:.2f}x oneDNN's time at "
            f"{DECODE_ROWS} rows, {self.prefill_ratio:.2f}x at {PREFILL_ROWS}{kept}"
        )


def why_not_here(dtype: torch.dtype, in_features: int) -> str | None:
    """Why this CPU does not run the kernel for a weight of ``dtype`` with ``in_features``,
    or None where it does (see the module docstring)."""
    vendor, flags = cpu_build.this_cpu()
    reason = cpu_matmul.why_not(vendor, flags, dtype, in_features)
    if reason is not None or cpu_matmul.measured_kind(vendor, flags):
        return reason
    found = calibration(dtype)
    if found is None:
        return "not measured on this CPU kind, and not timed: " + (
            cpu_matmul.KERNEL.build_error() or "the kernel is off"
        )
    return None if found.kernel_wins else f"oneDNN's is faster here ({found.text()})"


def note_here(dtype: torch.dtype) -> str:
    """Why the kernel runs, where a timing chose it ("" on a measured kind)."""
    vendor, flags = cpu_build.this_cpu()
    if cpu_matmul.measured_kind(vendor, flags):
        return ""
    found = calibration(dtype)
    return f" ({found.text()})" if found is not None and found.kernel_wins else ""


@functools.cache
def calibration(dtype: torch.dtype) -> Calibration | None:
    """This machine's timing for ``dtype``: the one it keeps, else one timed now and kept
    (read once per process); None where the kernel or oneDNN's packing is not there to time."""
    library = cpu_matmul.KERNEL.load()
    if library is None or not packing_available():
        return None
    path = kept_path(dtype)
    found = read_kept(path)
    if found is None:
        found = keep(path, measure(library, dtype, weight_bytes()))
    return found


def kept_path(dtype: torch.dtype) -> Path:
    """Where this machine keeps its timing for ``dtype``, beside the built kernels, named by
    what the timing depends on: the kernel's source, this CPU's vendor and flags, torch's
    version (oneDNN's), the threads, the dtype and what is timed. The choice rule is applied
    when it is read, so changing the rule needs no new timing."""
    digest = hashlib.sha256(cpu_matmul.SOURCE.read_bytes())
    timed = (DECODE_ROWS, PREFILL_ROWS, CALIBRATION_REPEATS, WEIGHT_SHAPE, weight_bytes())
    for part in (
        cpu_build.cpu_vendor(),
        cpu_build.cpu_flags(),
        torch.__version__,
        f"{torch.get_num_threads()} {dtype} {timed}",
    ):
        digest.update(part.encode())
    return cpu_build.kernel_cache_dir() / f"matmul-choice-{digest.hexdigest()[:16]}.json"


def read_kept(path: Path) -> Calibration | None:
    """The timing kept in ``path``; None where there is none or it cannot be read."""
    try:
        kept = json.loads(path.read_text())
        return Calibration(float(kept["decode_ratio"]), float(kept["prefill_ratio"]), str(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep(path: Path, found: Calibration) -> Calibration:
    """``found``, written whole to ``path`` (a temporary file renamed), so the next process
    on this machine chooses alike; unchanged where it cannot be written (a read-only home)."""
    ratios = {"decode_ratio": found.decode_ratio, "prefill_ratio": found.prefill_ratio}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            json.dump(ratios, file)
        try:
            os.replace(file.name, path)
        except OSError:
            os.unlink(file.name)
            raise
    except OSError:
        return found
    return dataclasses.replace(found, kept_in=str(path))


def weight_bytes() -> int:
    """Twice the last-level cache, within MIN_WEIGHT_BYTES and MAX_WEIGHT_BYTES."""
    try:
        size = L3_SIZE_PATH.read_text().strip()  # e.g. "32768K"
        cache_bytes = int(size.rstrip("KM")) << (20 if size.endswith("M") else 10)
    except (OSError, ValueError):
        cache_bytes = 0
    return min(max(2 * cache_bytes, MIN_WEIGHT_BYTES), MAX_WEIGHT_BYTES)


def measure(library: object, dtype: torch.dtype, total_bytes: int) -> Calibration:
    """Time both paths on synthetic weights of ``total_bytes`` (see the module docstring)."""
    n, k = WEIGHT_SHAPE
    one = (torch.rand(n, k) - 0.5).to(dtype)
    count = max(1, total_bytes // one.nbytes)
    panels = [cpu_matmul.pack(one) for _ in range(count)]
    packed = [pack_weight(one) for _ in range(count)]
    ratios = []
    for rows, weights in ((DECODE_ROWS, count), (PREFILL_ROWS, 1)):
        x = (torch.rand(rows, k) - 0.5).to(dtype)
        kernel = functools.partial(_kernel_pass, library, x, panels[:weights], n)
        onednn = functools.partial(_onednn_pass, x, packed[:weights])
        kernel_s, onednn_s = _best_times(kernel, onednn)
        ratios.append(kernel_s / onednn_s)
    return Calibration(*ratios)


def _kernel_pass(library: object, x: torch.Tensor, panels: list, n: int) -> None:
    for weight in panels:
        cpu_matmul.matmul(library, x, weight, n, None)


def _onednn_pass(x: torch.Tensor, packed: list) -> None:
    for weight in packed:
        packed_product(x, weight, None)


def _best_times(*passes: functools.partial) -> list[float]:
    """Each pass's best time of CALIBRATION_REPEATS, alternating, after one warm-up each."""
    best = [float("inf")] * len(passes)
    for repeat in range(CALIBRATION_REPEATS + 1):
        for number, run in enumerate(passes):
            start = time.perf_counter()
            run()
            if repeat:  # the first is the warm-up
                best[number] = min(best[number], time.perf_counter() - start)
    return best
