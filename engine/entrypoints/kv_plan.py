"""`iterscope kv-plan`: how many tokens and requests fit in a KV budget, before launch.

    iterscope kv-plan --model DIR|FILE.gguf|smollm2 --memory 4.5GiB --max-model-len 40960
    iterscope kv-plan --model DIR --gpu-memory 80GiB --gpu-memory-utilization 0.9 \
        --weights 16GiB --activation-peak 2GiB

``--memory`` is the memory the KV cache gets (what serve's ``--kv-cache-memory`` sets).
``--gpu-memory`` plans the way the engine budgets on a GPU: the card's memory times
``--gpu-memory-utilization``, minus the weights (default: the size of the model's weight
files) and the activation peak (the engine measures it at start-up and logs it), each term
printed. The KV cache has the engine's dtype: ``--dtype``, by default what `iterscope serve
--dtype auto` picks for ``--device`` (on this machine's CPU bfloat16 only where it computes
it natively, else float32; on a GPU 2 bytes, bfloat16 or float16), never the checkpoint's own
dtype, which the engine does not follow either. The model's shape comes from its config.json
or a GGUF file's metadata. Uses the engine's own planning code, so the lines and the error
are the ones the engine prints at start-up. It plans for iterscope's engine and reads each
value with the rule `iterscope serve` reads its flag with (a size with its unit,
``--block-size`` a power of two up to 256), so it refuses what the engine would, in the same
words. Exits 1 when max_model_len does not fit, 2 on bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.auto_dtype import auto_dtype
from engine.config import DEVICES, EngineConfig
from engine.entrypoints import arg_types
from engine.kv_planning import (
    GIB,
    KvPlan,
    cuda_kv_budget_bytes,
    estimate_max_model_len,
    kv_bytes_per_token,
    plan_kv_cache,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# serve's rule for --block-size (engine/config.py), so kv-plan refuses what the engine refuses
BLOCK_SIZE_KIND = next(f.metadata["kind"] for f in fields(EngineConfig) if f.name == "block_size")


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int


def shape_from_hf_config(hf: dict[str, Any], name: str) -> ModelShape:
    """Read the KV-relevant fields of an HF config.json dict (text_config when nested)."""
    hf = hf.get("text_config") or hf
    try:
        num_heads = hf["num_attention_heads"]
        return ModelShape(
            name=name,
            num_layers=hf["num_hidden_layers"],
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
        )
    except KeyError as error:
        raise ValueError(f"{name}: config.json lacks {error.args[0]!r}") from None


def read_model_shape(model: str) -> ModelShape:
    """An HF directory (config.json only), a .gguf file, or an embedded model name."""
    path = Path(model).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{model}: no config.json in this directory")
        return shape_from_hf_config(json.loads(config_path.read_text()), model)
    if not path.is_file():
        from engine.model.paths import resolve_model_path  # embedded names, e.g. smollm2

        path = resolve_model_path(model)
    from engine.model.gguf_file import gguf_hf_config, open_gguf

    return shape_from_hf_config(gguf_hf_config(open_gguf(path)), model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterscope kv-plan",
        description="How many tokens and concurrent requests fit in a KV cache budget of "
        "iterscope's engine (its flags take values as `iterscope serve` does).",
    )
    parser.add_argument("--model", required=True, help="HF directory, .gguf file or smollm2")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument(
        "--memory",
        type=arg_types.memory_size,
        metavar="SIZE",
        help="memory for the KV cache, e.g. 4.5GiB, 24GiB, 512MiB (serve's --kv-cache-memory)",
    )
    budget.add_argument(
        "--gpu-memory",
        type=arg_types.memory_size,
        metavar="SIZE",
        help="the card's total memory, e.g. 80GiB: plan as the engine budgets a GPU",
    )
    _add_gpu_arguments(parser)
    _add_shape_arguments(parser)
    return parser


def _add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu-memory-utilization",
        type=arg_types.fraction,
        default=0.9,
        metavar="FRACTION",
        help="share of --gpu-memory the engine may use (default 0.9, as serve)",
    )
    parser.add_argument(
        "--weights",
        type=arg_types.memory_size,
        metavar="SIZE",
        help="weights' memory (default: the model's weight files)",
    )
    parser.add_argument(
        "--activation-peak",
        type=arg_types.memory_size,
        metavar="SIZE",
        help="activation peak, as the engine logs it at start-up (needed with --gpu-memory)",
    )


def _add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    at_least_one = arg_types.int_in_range(1)
    parser.add_argument(
        "--max-model-len",
        type=at_least_one,
        metavar="N",
        help="tokens per request to plan for (default: the model's)",
    )
    parser.add_argument(
        "--dtype",
        type=arg_types.dtype,
        default="auto",
        metavar="DTYPE",
        help="the engine's dtype, as `iterscope serve --dtype` takes it: auto, float32, "
        "bfloat16, float16 (or fp32, bf16, fp16, half); auto (the default) picks as serve "
        "does for --device",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        help="where the engine runs, as serve's --device (default cpu; cuda with --gpu-memory)",
    )
    parser.add_argument(
        "--block-size",
        type=arg_types.of_kind(BLOCK_SIZE_KIND),
        default=16,
        metavar="N",
        help=f"tokens per KV cache block: {BLOCK_SIZE_KIND.expected}, as `iterscope serve` "
        "takes (default 16). This plans for iterscope's engine; vLLM's block sizes depend "
        "on its attention backend",
    )
    parser.add_argument(
        "--request-len",
        type=at_least_one,
        metavar="N",
        help="request length for the concurrency line (default: --max-model-len)",
    )


def weight_files_bytes(model: str) -> int:
    """Bytes of the model's weight files: a .gguf file (an embedded model's too), or a
    directory's safetensors/bin."""
    path = Path(model).expanduser()
    if not path.exists():
        from engine.model.paths import resolve_model_path  # embedded names, e.g. smollm2

        path = resolve_model_path(model)
    if path.is_file():
        return path.stat().st_size
    files = [*path.glob("*.safetensors"), *path.glob("*.bin")] if path.is_dir() else []
    if not files:
        raise ValueError(f"{model}: no weight files (*.safetensors, *.bin) to size; pass --weights")
    return sum(f.stat().st_size for f in files)


def kv_budget(args: argparse.Namespace) -> tuple[int, list[str], str]:
    """(KV bytes, the lines that show how they were reached, the flag that gives more)."""
    if args.memory is not None:
        return args.memory, [], "--memory"
    if args.activation_peak is None:
        raise ValueError(
            "--gpu-memory needs --activation-peak: the engine measures it at "
            "start-up and logs it ('activation peak X GiB')"
        )
    total, utilization, peak = args.gpu_memory, args.gpu_memory_utilization, args.activation_peak
    weights = args.weights if args.weights is not None else weight_files_bytes(args.model)
    check_gpu_budget(total, utilization, weights, peak)
    budget = cuda_kv_budget_bytes(total, utilization, weights, peak)
    lines = [
        f"GPU memory: {total / GIB:.2f} GiB x {utilization:g} utilization = "
        f"{int(total * utilization) / GIB:.2f} GiB",
        f"  minus weights: {weights / GIB:.2f} GiB",
        f"  minus activation peak: {peak / GIB:.2f} GiB",
        f"  = KV cache budget: {budget / GIB:.2f} GiB",
    ]
    return budget, lines, "--gpu-memory-utilization"


def check_gpu_budget(total: int, utilization: float, weights: int, peak: int) -> None:
    """ValueError, in kv-plan's own flags, when nothing is left for the KV cache: the
    utilization that would leave some, or, when weights and activation peak fill the whole
    card, that no utilization can."""
    fixed = weights + peak
    allowed = int(total * utilization)
    if allowed > fixed:
        return
    terms = (
        f"no memory left for the KV cache: weights ({weights / GIB:.2f} GiB) plus activation "
        f"peak ({peak / GIB:.2f} GiB) = {fixed / GIB:.2f} GiB"
    )
    if fixed >= total:
        raise ValueError(
            f"{terms}, which fills the whole card ({total / GIB:.2f} GiB), so no "
            "--gpu-memory-utilization can help: use a smaller model, a quantized one, or a GPU "
            "with more memory"
        )
    raise ValueError(
        f"{terms}, which fills the {utilization:g} x {total / GIB:.2f} GiB = "
        f"{allowed / GIB:.2f} GiB the engine may use; "
        f"raise --gpu-memory-utilization to {least_utilization(total, fixed):.2f} or more, or "
        "lower the activation peak (`iterscope serve` with a smaller --max-num-batched-tokens, "
        "then pass the peak it logs as --activation-peak)"
    )


def least_utilization(total: int, fixed: int) -> float:
    """The smallest utilization in hundredths that leaves memory beyond ``fixed`` (< total)."""
    hundredths = math.floor(fixed * 100 / total)
    while int(total * (hundredths / 100)) <= fixed:  # as cuda_kv_budget_bytes rounds
        hundredths += 1
    return hundredths / 100


def checked_max_model_len(shape: ModelShape, args: argparse.Namespace) -> int:
    """The max model length to plan for (--max-model-len, else the model's), refusing one
    above the model's own limit and a --request-len above it, as the engine refuses both."""
    max_model_len = args.max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len:,} is above the model's own limit "
            f"(max_position_embeddings {shape.max_position_embeddings:,}); the engine refuses it"
        )
    if args.request_len is not None and args.request_len > max_model_len:
        default = "" if args.max_model_len else " (its default: the model's)"
        raise ValueError(
            f"--request-len {args.request_len:,} is above --max-model-len {max_model_len:,}"
            f"{default}; the engine refuses a request longer than its max model length"
        )
    return max_model_len


def planned_device(args: argparse.Namespace) -> str:
    """serve's --device: cpu unless said, cuda with --gpu-memory (which plans a GPU)."""
    if args.gpu_memory is None:
        return args.device or "cpu"
    if args.device == "cpu":
        raise ValueError("--gpu-memory plans the engine on a GPU; drop --device cpu")
    return "cuda"


def kv_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """(the KV cache's dtype, why): --dtype, or what serve's --dtype auto picks on the device:
    on a CPU this machine's rule (engine/auto_dtype.py); on a GPU, which this machine may not
    have, bfloat16 from compute capability 8.0 and float16 before, the same 2 bytes."""
    if args.dtype != "auto":
        return args.dtype, f"--dtype {args.dtype}"
    if planned_device(args) == "cuda":
        return "bfloat16", (
            "--dtype auto on a GPU: bfloat16 from compute capability 8.0, float16 before it, "
            "2 bytes either way"
        )
    dtype, reason = auto_dtype("cpu")
    return dtype, f"--dtype auto here: {reason}"


def plan_lines(shape: ModelShape, args: argparse.Namespace) -> tuple[list[str], str]:
    """The report, and why max_model_len does not fit ("" when it does)."""
    dtype, why_dtype = kv_dtype(args)
    available, budget_lines, memory_flag = kv_budget(args)
    max_model_len = checked_max_model_len(shape, args)
    bytes_per_token = kv_bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, DTYPE_BYTES[dtype]
    )
    lines = [
        f"Model: {shape.name} ({shape.num_layers} layers, {shape.num_kv_heads} KV heads, "
        f"head_dim {shape.head_dim}, max_position_embeddings "
        f"{shape.max_position_embeddings:,})",
        f"KV cache dtype: {dtype} ({why_dtype})",
        f"KV bytes per token: {bytes_per_token:,} (2 x {shape.num_layers} layers x "
        f"{shape.num_kv_heads} KV heads x {shape.head_dim} head_dim x {DTYPE_BYTES[dtype]} "
        "bytes)",
        *budget_lines,
    ]
    num_blocks = available // (args.block_size * bytes_per_token)
    capacity = KvPlan(bytes_per_token, args.block_size, available, num_blocks, max_model_len)
    lines += capacity.startup_lines(args.request_len)
    largest = estimate_max_model_len(
        bytes_per_token, available, args.block_size, shape.max_position_embeddings
    )
    lines.append(f"Largest max model length that fits: {largest:,}")
    try:
        plan_kv_cache(bytes_per_token, available, args.block_size, max_model_len, memory_flag)
    except ValueError as error:
        return lines, str(error)
    return lines, ""


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        lines, not_fitting = plan_lines(read_model_shape(args.model), args)
    except (ValueError, FileNotFoundError) as error:
        print(f"iterscope kv-plan: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if not_fitting:
        print(f"iterscope kv-plan: {not_fitting}", file=sys.stderr)
        return 1
    return 0
