"""EngineConfig: every setting of the engine core, checked once when it is built.

Defaults suit a 2-core CPU running SmolLM2-135M: blocks of 16 tokens, at most 32 running
requests, 2048 tokens per iteration and a 512 MiB KV cache. On CUDA the KV budget is
``gpu_memory_utilization`` of the card minus the weights and the activation peak measured
at start-up (engine/activation_profile.py), unless ``kv_cache_memory_bytes`` sets it
outright.

The ``test_*`` fields are test-only fault injection for the scenario tests (a KV block leak,
a stall inside the loop); they are off unless set, and no user-facing command sets them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from engine.auto_dtype import auto_dtype
from telemetry.lane.publisher import DEFAULT_QUEUE_CAPACITY, DEFAULT_SNDHWM
from telemetry.lane.record import MAX_ENGINE_INDEX

DTYPE_ALIASES = {
    "auto": "auto",
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}
DEVICES = ("cpu", "cuda")
MAX_BLOCK_SIZE = 256
DEFAULT_CPU_KV_CACHE_BYTES = 512 << 20

_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_memory_size(text: str) -> int:
    """'24GiB' -> bytes. Accepts B, KB/MB/GB/TB (powers of 10) and KiB/MiB/GiB/TiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 24GiB, 512MiB or 4.5GB")
    return int(float(match.group(1)) * _MEMORY_UNITS[unit])


_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str}



# The flag `iterscope serve` (and demo) takes for each setting, so that errors name what the
# user types as well as the field a Python caller sets.
FLAGS = {
    "block_size": "--block-size",
    "device": "--device",
    "dtype": "--dtype",
    "engine_index": "--engine-index",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "kv_cache_memory_bytes": "--kv-cache-memory",
    "max_model_len": "--max-model-len",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_num_seqs": "--max-num-seqs",
    "telemetry_queue_capacity": "--telemetry-queue-capacity",
    "telemetry_sndhwm": "--telemetry-sndhwm",
}


def field_and_flag(name: str) -> str:
    """``kv_cache_memory_bytes (--kv-cache-memory)``; the bare name for a setting with no flag."""
    flag = FLAGS.get(name)
    return f"{name} ({flag})" if flag else name

@dataclass
class EngineConfig:
    model: str = "smollm2"  # an HF directory, or "smollm2" for the embedded default model
    served_model_name: str | None = None  # the name clients and telemetry use; None = model
    dtype: str = "auto"  # auto: bfloat16 where computed natively (engine/auto_dtype.py)
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None  # None = 512 MiB on CPU, derived on CUDA
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    engine_index: int = 0
    telemetry_address: str | None = None  # ZMQ address of the sidecar; None = telemetry off
    telemetry_curve_keys_dir: str | None = None  # CURVE keys for a tcp lane across hosts
    telemetry_curve_engine_name: str = "engine"  # which engine key pair in that directory
    telemetry_sndhwm: int = DEFAULT_SNDHWM  # frames ZMQ may hold for a slow sidecar
    telemetry_queue_capacity: int = DEFAULT_QUEUE_CAPACITY  # records waiting for the sender
    nvtx_markers: bool = False  # one NVTX range per iteration when an NVTX tool is attached
    test_count_log_records: bool = False  # engine process counts every log record (probe)

    def __post_init__(self) -> None:
        self._check_types()
        self.dtype = self._checked_dtype()
        self._check_positive("telemetry_sndhwm", self.telemetry_sndhwm)
        self._check_positive("telemetry_queue_capacity", self.telemetry_queue_capacity)
        if not 0 <= self.engine_index <= MAX_ENGINE_INDEX:
            raise ValueError(
                f"{field_and_flag('engine_index')} must be in 0..{MAX_ENGINE_INDEX} (the "
                f"sidecar drops anything else as malformed), got {self.engine_index}"
            )
        self._check_device()
        self._check_positive("block_size", self.block_size)
        if self.block_size > MAX_BLOCK_SIZE or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"{field_and_flag('block_size')} must be a power of two up to "
                f"{MAX_BLOCK_SIZE}, got {self.block_size}; use 16"
            )
        self._check_positive("max_num_seqs", self.max_num_seqs)
        self._check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_num_seqs ({self.max_num_seqs}), so a full batch of decodes could never "
                "run in one iteration; raise max_num_batched_tokens (--max-num-batched-tokens) "
                "or lower max_num_seqs (--max-num-seqs)"
            )
        if self.max_model_len is not None:
            self._check_positive("max_model_len", self.max_model_len)
            self._check_token_budget(self.max_model_len)
        if self.kv_cache_memory_bytes is not None:
            self._check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"{field_and_flag('gpu_memory_utilization')} must be in (0, 1], got "
                f"{self.gpu_memory_utilization}"
            )

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """The max_model_len to serve with, given the model's own limit."""
        if self.max_model_len is None:
            self._check_token_budget(max_position_embeddings)
            return max_position_embeddings
        if self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({max_position_embeddings}); lower max_model_len "
                "(--max-model-len)"
            )
        return self.max_model_len

    def kv_cache_memory_setting(self) -> str:
        """The setting a user changes to give the KV cache more memory on this device."""
        if self.device == "cuda" and self.kv_cache_memory_bytes is None:
            return field_and_flag("gpu_memory_utilization")
        return field_and_flag("kv_cache_memory_bytes")

    def _check_types(self) -> None:
        """Each setting has its annotated type: 2.5 sequences or "no" for a switch (truthy,
        so on) would otherwise pass the range checks or fail later without a clear cause."""
        for setting in fields(self):
            value = getattr(self, setting.name)
            kinds = setting.type.split(" | ")
            if value is None and "None" in kinds:
                continue
            accepted = tuple(_TYPES[kind] for kind in kinds if kind != "None")
            is_bool = isinstance(value, bool)
            if not isinstance(value, accepted) or (is_bool and bool not in accepted):
                raise ValueError(
                    f"{field_and_flag(setting.name)} must be {' or '.join(kinds)}, got {value!r} "
                    f"({type(value).__name__})"
                )

    def _checked_dtype(self) -> str:
        dtype = DTYPE_ALIASES.get(str(self.dtype).lower())
        if dtype is None:
            raise ValueError(
                f"{field_and_flag('dtype')} {self.dtype!r} is not supported; use one of auto, "
                "float32, bfloat16, float16"
            )
        return dtype

    def _check_device(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(
                f"{field_and_flag('device')} must be one of {', '.join(DEVICES)}, got "
                f"{self.device!r}"
            )

    def _check_token_budget(self, max_model_len: int) -> None:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({max_model_len}) "
                "or a long prompt could never be scheduled; enable chunked prefill, raise "
                "max_num_batched_tokens (--max-num-batched-tokens) or lower max_model_len "
                "(--max-model-len)"
            )

    @staticmethod
    def _check_positive(name: str, value: int) -> None:
        if value < 1:
            raise ValueError(f"{field_and_flag(name)} must be at least 1, got {value}")

    @property
    def torch_dtype_name(self) -> str:
        """float32 / bfloat16 / float16 with auto resolved for the device."""
        return self.dtype_choice()[0]

    def dtype_choice(self) -> tuple[str, str]:
        """(dtype, the start-up line that says which and why)."""
        if self.dtype != "auto":
            return self.dtype, f"dtype {self.dtype} (--dtype {self.dtype})"
        dtype, reason = auto_dtype(self.device)
        return dtype, f"dtype {dtype} (--dtype auto: {reason})"

    @property
    def device_name(self) -> str:
        """What the log lines call the device: "GPU" on CUDA, else e.g. "CPU"."""
        return "GPU" if self.device == "cuda" else self.device.upper()
