"""Building a CPU kernel (a C file next to this one) with gcc once, loaded with ctypes.

The first use compiles the source with the C compiler ($CC, else gcc) for this machine
(-march=native) into $ITERSCOPE_KERNEL_CACHE (default ~/.cache/iterscope/kernels), named by a
hash of the source and the headers beside it, the flags, the compiler's version and the CPU's
flags, so a cache shared between machines or edits never loads a stale build. The rename
into place is atomic: concurrent processes each build and one wins. Without a compiler, or
when the build fails, the caller keeps its torch path and says why. ITERSCOPE_CPU_KERNELS=0
turns every kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    # Reassociation lets gcc vectorize the sums; no -ffinite-math-only (the paged decode's
    # online softmax starts from -inf).
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)


def kernels_enabled() -> bool:
    return os.environ.get("ITERSCOPE_CPU_KERNELS", "1") != "0"


class CpuKernel:
    """One kernel's library: built and opened on first use; None, and build_error() says
    why, when ITERSCOPE_CPU_KERNELS=0 (no reason then), without a compiler or on failure."""

    def __init__(
        self,
        source: Path,
        open_library: Callable[[Path], ctypes.CDLL],
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        """``extra_flags``: this machine's own, added to FLAGS (e.g. a define chosen per CPU
        kind)."""
        self.source = source
        self.open_library = open_library  # opens a built library, declaring its signatures
        self.extra_flags = extra_flags
        self.errors: list[str] = []
        self._tried = False
        self._library: ctypes.CDLL | None = None

    def load(self) -> ctypes.CDLL | None:
        if not kernels_enabled():
            return None
        if not self._tried:
            self._tried = True
            self._library = load(self.source, self.open_library, self.errors, self.extra_flags)
        return self._library

    def build_error(self) -> str | None:
        """Why the last build attempt failed, or None."""
        return self.errors[-1] if self.errors else None


def load(
    source: Path,
    open_library: Callable[[Path], ctypes.CDLL],
    errors: list[str],
    extra_flags: tuple[str, ...] = (),
) -> ctypes.CDLL | None:
    """``source`` built (or found in the cache) and opened by ``open_library``; None, with
    the reason appended to ``errors``, without a compiler or when the build fails."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        errors.append("no C compiler (set CC or install gcc)")
        return None
    try:
        return open_library(build(compiler, kernel_cache_dir(), source, extra_flags))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        errors.append(f"building {source.name} with {compiler} failed: {detail}")
        return None


def kernel_cache_dir() -> Path:
    """Where built kernels are kept: $ITERSCOPE_KERNEL_CACHE, else ~/.cache/iterscope/kernels."""
    return Path(
        os.environ.get("ITERSCOPE_KERNEL_CACHE", Path.home() / ".cache" / "iterscope" / "kernels")
    )


def build(compiler: str, cache_dir: Path, source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library built from ``source`` in cache_dir (built now unless already there)."""
    flags = (*FLAGS, *extra_flags)
    library = cache_dir / f"{source.stem}-{build_key(compiler, source, flags)}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        built = Path(scratch) / library.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(source), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, library)
    return library


def build_key(compiler: str, source: Path, flags: tuple[str, ...] = FLAGS) -> str:
    """Hash of the source and the headers beside it, the flags, the compiler's version and
    the CPU's flags."""
    version = subprocess.run(
        [compiler, "--version"], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    for part in (" ".join(flags), version, cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@functools.cache
def this_cpu() -> tuple[str, set[str]]:
    """This CPU's vendor and flags (cpu_vendor, cpu_flags), read once: shared, not to be changed."""
    return cpu_vendor(), set(cpu_flags().split())


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def prefetch_flags(vendor: str, flags: set[str]) -> tuple[str, ...]:
    """Where the kernels that prefetch their next reads (paged_decode.c, matmul.c) put them:
    into L1 on AMD CPUs with AVX-512, the kind measured faster so (docs/performance.md), into
    L2 elsewhere (an Intel Xeon stalled on its few L1 miss buffers)."""
    if vendor == "AuthenticAMD" and "avx512f" in flags:
        return ("-DPREFETCH_LOCALITY=3",)
    return ()


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (e.g. AuthenticAMD, GenuineIntel); "" where it has none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""
