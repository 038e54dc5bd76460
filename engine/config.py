"""EngineConfig: every setting of the engine core, checked once when it is built.

Defaults suit a 2-core CPU running SmolLM2-135M: blocks of 16 tokens, at most 32 running
requests (256 on CUDA), 2048 tokens per iteration and a 512 MiB KV cache. On CUDA the KV budget is
``gpu_memory_utilization`` of the card minus the weights and the activation peak measured
at start-up (engine/activation_profile.py), unless ``kv_cache_memory_bytes`` sets it
outright.

This dataclass is the one statement of the engine's settings: each field's metadata
(engine/settings.py) holds its flag, help and kind of value, `iterscope serve` builds its
engine flags from them (engine/entrypoints/serve_args.py, defaults included), and the checks
below are the only ones: the CLI reads a flag with the same kind the config checks it with.
``test_count_log_records`` is a probe for one test (the engine process counts its log
records); no command sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.auto_dtype import auto_dtype
from engine.settings import (
    DTYPE,
    Choice,
    Fraction,
    MemorySize,
    PowerOfTwo,
    WholeNumber,
    setting,
)
from telemetry.lane.publisher import DEFAULT_QUEUE_CAPACITY, DEFAULT_SNDHWM
from telemetry.lane.record import MAX_ENGINE_INDEX

DEVICES = ("cpu", "cuda")
MAX_BLOCK_SIZE = 256
DEFAULT_CPU_KV_CACHE_BYTES = 512 << 20
# A GPU decodes 256 requests in about the time of one (docs/performance.md: 2.2 ms at batch 1,
# 5.5 ms at 256 on an H200 with CUDA graphs); 256 is vLLM's default on GPUs short of H100s.
DEFAULT_MAX_NUM_SEQS = {"cpu": 32, "cuda": 256}
# A CPU prefills ~3,000 tokens a second (SmolLM2-135M, 2 cores): a 2,048-token iteration holds
# every request that arrived during it for 0.7 s. Half that budget, served under
# bench/serving_vs_vllm.py's load, cut the mean TTFT by 28% at the same output tok/s
# (docs/performance.md); a GPU's iteration of 2,048 tokens takes milliseconds.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 1024, "cuda": 2048}
_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str}


def flag_of(name: str) -> str | None:
    """The flag `iterscope serve` takes for an EngineConfig field, None if it has none."""
    return _FLAGS.get(name)


def field_and_flag(name: str) -> str:
    """``kv_cache_memory_bytes (--kv-cache-memory)``; the bare name for a setting with no flag."""
    flag = flag_of(name)
    return f"{name} ({flag})" if flag else name


@dataclass
class EngineConfig:
    model: str = setting(
        "smollm2",
        "--model",
        "HF directory, .gguf file, smollm2 or tiny-llama; `serve` also "
        "takes it as its first argument",
    )  # smollm2: the embedded default model
    served_model_name: str | None = None  # the name clients and telemetry use; None = model
    dtype: str = setting(
        "auto",
        "--dtype",
        "the model's dtype; auto: bfloat16 where the CPU or GPU computes it "
        "natively, else float32 on CPU and float16 on older GPUs (start-up says which)",
        DTYPE,
    )
    device: str = setting("cpu", "--device", "where the model runs", Choice(DEVICES))
    block_size: int = setting(
        16, "--block-size", "tokens per KV cache block", PowerOfTwo(MAX_BLOCK_SIZE), "N"
    )
    max_num_seqs: int | None = setting(
        None,
        "--max-num-seqs",
        "most requests running at once",
        WholeNumber(1),
        "N",
        default_text=", ".join(f"{n} on {d.upper()}" for d, n in DEFAULT_MAX_NUM_SEQS.items()),
    )
    max_num_batched_tokens: int | None = setting(
        None,
        "--max-num-batched-tokens",
        "most tokens in one iteration",
        WholeNumber(1),
        "N",
        default_text=", ".join(
            f"{n} on {d.upper()}" for d, n in DEFAULT_MAX_NUM_BATCHED_TOKENS.items()
        ),
    )
    max_model_len: int | None = setting(
        None,
        "--max-model-len",
        "longest prompt + output in tokens",
        WholeNumber(1),
        "N",
        default_text="the model's own limit",
    )
    kv_cache_memory_bytes: int | None = setting(
        None,
        "--kv-cache-memory",
        "KV cache budget, e.g. 512MiB or 4GiB",
        MemorySize(),
        "SIZE",
        default_text="512MiB on CPU, --gpu-memory-utilization of the card on CUDA",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "--gpu-memory-utilization",
        "share of the GPU's memory for weights, activations and KV cache on CUDA",
        Fraction(),
        "FRACTION",
    )
    enable_prefix_caching: bool = setting(
        True, "--no-prefix-caching", "turn the prefix cache off", negate=True
    )
    enable_chunked_prefill: bool = True
    cuda_graphs: bool = setting(
        True,
        "--enforce-eager",
        "on CUDA, run every step eagerly instead of replaying decode-only steps from CUDA "
        "graphs (as vLLM's flag)",
        negate=True,
        default_text="off: CUDA graphs on",
    )
    engine_index: int = setting(
        0,
        "--engine-index",
        "this engine's index in its telemetry (the `engine` label)",
        WholeNumber(0, MAX_ENGINE_INDEX),
        "N",
    )
    telemetry_address: str | None = None  # ZMQ address of the sidecar; None = telemetry off
    telemetry_curve_keys_dir: str | None = setting(
        None,
        "--telemetry-curve-keys-dir",
        "CURVE keys for a tcp telemetry lane to a sidecar "
        "on another host (iterscope curve-keys; docs/deploy.md)",
        metavar="DIR",
        default_text="none: ipc lane",
    )
    telemetry_curve_engine_name: str = setting(
        "engine",
        "--telemetry-curve-engine-name",
        "which engine key pair in that directory",
        metavar="NAME",
    )
    telemetry_sndhwm: int = setting(
        DEFAULT_SNDHWM,
        "--telemetry-sndhwm",
        "telemetry frames ZMQ may hold for a slow sidecar before dropping",
        WholeNumber(1),
        "N",
    )
    telemetry_queue_capacity: int = setting(
        DEFAULT_QUEUE_CAPACITY,
        "--telemetry-queue-capacity",
        "records the engine queues for its telemetry sender thread before dropping",
        WholeNumber(1),
        "N",
    )
    nvtx_markers: bool = setting(
        False,
        "--nvtx-markers",
        "one NVTX range per iteration in the engine process, to pair "
        "with the sidecar's --nvtx ranges in Nsight Systems (docs/profiling.md)",
    )
    test_count_log_records: bool = False  # engine process counts every log record (probe)

    def __post_init__(self) -> None:
        self._check_types()
        self._check_kinds()
        if self.max_num_seqs is None:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS[self.device]
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device]
        self.dtype = DTYPE.canonical(self.dtype)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_num_seqs ({self.max_num_seqs}), so a full batch of decodes could never "
                "run in one iteration; raise max_num_batched_tokens (--max-num-batched-tokens) "
                "or lower max_num_seqs (--max-num-seqs)"
            )
        if self.max_model_len is not None:
            self._check_token_budget(self.max_model_len)

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
        for setting_field in fields(self):
            value = getattr(self, setting_field.name)
            kinds = setting_field.type.split(" | ")
            if value is None and "None" in kinds:
                continue
            accepted = tuple(_TYPES[kind] for kind in kinds if kind != "None")
            is_bool = isinstance(value, bool)
            if not isinstance(value, accepted) or (is_bool and bool not in accepted):
                raise ValueError(
                    f"{field_and_flag(setting_field.name)} must be {' or '.join(kinds)}, "
                    f"got {value!r} ({type(value).__name__})"
                )

    def _check_kinds(self) -> None:
        """Each setting with a kind (engine/settings.py) is one its flag would accept."""
        for setting_field in fields(self):
            kind = setting_field.metadata.get("kind")
            value = getattr(self, setting_field.name)
            if kind is not None and value is not None and not kind.accepts(value):
                raise ValueError(
                    f"{field_and_flag(setting_field.name)} must be {kind.expected}, got {value!r}"
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


_FLAGS = {f.name: f.metadata["flag"] for f in fields(EngineConfig) if f.metadata.get("flag")}
