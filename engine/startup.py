"""Building an engine core from its config, in start-up order: pick the dtype, load the model,
measure weights and the activation peak (CUDA), size the KV cache (engine/kv_planning.py),
build the runner and the core. Each step logs its one start-up line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine.core import EngineCore, Publisher
from engine.cpu_allocator import allocator_line
from engine.kv_planning import KvPlan, cuda_kv_budget_bytes, kv_bytes_per_token, plan_kv_cache

logger = logging.getLogger(__name__)


def kv_budget_bytes(config: EngineConfig, weights_bytes: int, activation_peak_bytes: int) -> int:
    """Bytes the KV cache may use: the explicit setting, else 512 MiB on CPU, else CUDA's share."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if config.device != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    import torch

    total_bytes = torch.cuda.get_device_properties(0).total_memory
    return cuda_kv_budget_bytes(
        total_bytes, config.gpu_memory_utilization, weights_bytes, activation_peak_bytes
    )


def plan_for_model(
    config: EngineConfig,
    model_config: Any,
    weights_bytes: int = 0,
    activation_peak_bytes: int = 0,
) -> KvPlan:
    """KV plan for a model (anything with num_layers, num_kv_heads, head_dim, dtype,
    max_position_embeddings); logs the start-up lines once."""
    bytes_per_token = kv_bytes_per_token(
        model_config.num_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
        model_config.dtype.itemsize,
    )
    plan = plan_kv_cache(
        bytes_per_token,
        kv_budget_bytes(config, weights_bytes, activation_peak_bytes),
        config.block_size,
        config.resolve_max_model_len(model_config.max_position_embeddings),
        config.kv_cache_memory_setting(),
    )
    for line in plan.startup_lines():
        logger.info(line)
    return plan


def _measure_cuda_memory(config: EngineConfig, model: Any, runner_class: Any) -> tuple[int, int]:
    """(weights bytes, measured activation peak bytes) on the current CUDA device."""
    import torch

    from engine.activation_profile import cuda_probe, measure_activation_peak_bytes

    weights_bytes = torch.cuda.memory_allocated()
    max_model_len = config.resolve_max_model_len(model.config.max_position_embeddings)
    peak_bytes = measure_activation_peak_bytes(
        config, model, runner_class, max_model_len, cuda_probe()
    )
    torch.cuda.empty_cache()  # hand the profile's blocks back before the KV cache is sized
    logger.info(
        "activation peak %.2f GiB measured over the worst-case iterations (weights %.2f GiB)",
        peak_bytes / 2**30,
        weights_bytes / 2**30,
    )
    return weights_bytes, peak_bytes


def build_engine_core(
    config: EngineConfig,
    load_model: Any = None,
    runner_class: Any = None,
    publisher: Publisher | None = None,
) -> tuple[EngineCore, Any]:
    """Load the model, plan the KV cache, build the runner; returns (core, loaded model).

    ``load_model(name_or_dir, dtype, device)`` and ``runner_class(model, num_blocks,
    block_size, device)`` default to the real ones (tests pass fakes with the same shape).
    """
    if load_model is None:
        from engine.model.loader import load_model
    if runner_class is None:
        from engine.runner import ModelRunner as runner_class
    dtype, dtype_line = config.dtype_choice()
    logger.info(dtype_line)
    model = load_model(config.model, dtype, config.device)
    weights_bytes = activation_peak_bytes = 0
    if config.device == "cuda":
        weights_bytes, activation_peak_bytes = _measure_cuda_memory(config, model, runner_class)
    plan = plan_for_model(config, model.config, weights_bytes, activation_peak_bytes)
    runner = runner_class(model, plan.num_blocks, config.block_size, config.device)
    core = EngineCore(
        config,
        runner,
        plan,
        tuple(model.config.eos_token_ids),
        publisher,
        model.config.vocab_size,
    )
    if config.device == "cpu":
        core.startup_notes += [allocator_line(), runner.cpu_kernels_line()]
        for line in core.startup_notes[-2:]:
            logger.info(line)
    if config.device == "cuda" and config.cuda_graphs:
        core.startup_notes.append(_capture_decode_graphs(runner, config, plan.max_model_len))
        logger.info(core.startup_notes[-1])
    return core, model


def _capture_decode_graphs(runner: Any, config: EngineConfig, max_model_len: int) -> str:
    """Capture the runner's decode-only CUDA graphs; the start-up line that says so."""
    start = time.monotonic()
    buckets = runner.capture_decode_graphs(config.max_num_seqs, max_model_len)
    if buckets is None:
        return "CUDA graphs: not used (they need the Triton decode kernels); steps run eagerly"
    return (
        f"CUDA graphs: decode-only steps of up to {buckets[-1]} requests replayed from "
        f"{len(buckets)} graphs, captured in {time.monotonic() - start:.1f} s (--enforce-eager "
        "turns them off)"
    )
