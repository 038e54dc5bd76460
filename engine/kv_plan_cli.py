"""`iterscope kv-plan`: how many tokens and requests fit in a KV budget, before launch.

    iterscope kv-plan --model DIR|FILE.gguf|smollm2 --memory 4.5GiB --max-model-len 40960

``--memory`` is the memory the KV cache gets (on a GPU: the card's share minus weights and
activations). The model's shape comes from its config.json (no weights are read) or from a
GGUF file's metadata. Uses the engine's own planning code, so the lines and the error are the
ones the engine prints at start-up; exits 1 when max_model_len does not fit.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import DTYPE_ALIASES, parse_memory_size
from engine.kv_planning import KvPlan, estimate_max_model_len, kv_bytes_per_token, plan_kv_cache

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str  # the checkpoint's own dtype, "bfloat16" when it says nothing


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
            dtype=DTYPE_ALIASES.get(str(hf.get("torch_dtype") or hf.get("dtype")), "bfloat16"),
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
        description="How many tokens and concurrent requests fit in a KV cache budget.",
    )
    parser.add_argument("--model", required=True, help="HF directory, .gguf file or smollm2")
    parser.add_argument(
        "--memory", required=True, help="memory for the KV cache, e.g. 4.5GiB, 24GiB, 512MiB"
    )
    parser.add_argument(
        "--max-model-len", type=int, help="tokens per request to plan for (default: the model's)"
    )
    parser.add_argument(
        "--dtype", help="KV dtype: bf16, fp16 or fp32 (default: the checkpoint's, else bf16)"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--request-len", type=int, help="request length for the concurrency line")
    return parser


def plan_lines(shape: ModelShape, args: argparse.Namespace) -> tuple[list[str], bool]:
    """The report, and whether max_model_len fits."""
    dtype = DTYPE_ALIASES.get((args.dtype or shape.dtype).lower())
    if dtype is None or dtype == "auto":
        raise ValueError(f"--dtype {args.dtype!r} is not one of bf16, fp16, fp32")
    available = parse_memory_size(args.memory)
    max_model_len = args.max_model_len or shape.max_position_embeddings
    bytes_per_token = kv_bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, DTYPE_BYTES[dtype]
    )
    lines = [
        f"Model: {shape.name} ({shape.num_layers} layers, {shape.num_kv_heads} KV heads, "
        f"head_dim {shape.head_dim}, {dtype}, max_position_embeddings "
        f"{shape.max_position_embeddings:,})",
        f"KV bytes per token: {bytes_per_token:,} (2 x {shape.num_layers} layers x "
        f"{shape.num_kv_heads} KV heads x {shape.head_dim} head_dim x {DTYPE_BYTES[dtype]} "
        "bytes)",
    ]
    num_blocks = available // (args.block_size * bytes_per_token)
    capacity = KvPlan(bytes_per_token, args.block_size, available, num_blocks, max_model_len)
    lines += capacity.startup_lines(args.request_len)
    largest = estimate_max_model_len(
        bytes_per_token, available, args.block_size, shape.max_position_embeddings
    )
    lines.append(f"Largest max model length that fits: {largest:,}")
    try:
        plan_kv_cache(bytes_per_token, available, args.block_size, max_model_len, "--memory")
    except ValueError as error:
        return [*lines, str(error)], False
    return lines, True


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("block_size", "max_model_len", "request_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    try:
        lines, fits = plan_lines(read_model_shape(args.model), args)
    except (ValueError, FileNotFoundError) as error:
        print(f"iterscope kv-plan: {error}")
        return 2
    print("\n".join(lines))
    return 0 if fits else 1
