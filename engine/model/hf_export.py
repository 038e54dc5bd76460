"""Write a GGUF model (the embedded SmolLM2 by default) as a Hugging Face model directory.

    python -m engine.model.hf_export smollm2 .models/smollm2-hf

vLLM and transformers load the result: model.safetensors (bfloat16, dequantized, Q/K rows in
HF order), config.json, generation_config.json, tokenizer.json, tokenizer_config.json with the
chat template, special_tokens_map.json. Tied embeddings are stored once, as
``model.embed_tokens.weight`` (what vLLM loads). The directory is written under a temporary
name and renamed, so a half-written one is never left behind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine.model.gguf_file import (
    gguf_hf_config,
    gguf_tokenizer_fields,
    load_gguf_state_dict,
    open_gguf,
    read_gguf_metadata,
)
from engine.model.paths import resolve_model_path
from engine.model.tokenizer import build_gguf_tokenizer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def export_hf_directory(model: str, out_dir: Path) -> Path:
    """Convert ``model`` (an embedded name or a .gguf path) into ``out_dir``; returns it.

    An existing ``out_dir`` is replaced only if it is an earlier export (holds config.json).
    """
    import torch
    from safetensors.torch import save_file

    path = resolve_model_path(model)
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file or an embedded model name")
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir / "config.json").exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir}: exists and is not a model directory; not replacing it")
    reader = open_gguf(path)
    config = gguf_hf_config(reader)
    state_dict = load_gguf_state_dict(reader, config)  # sets tie_word_embeddings
    fields = gguf_tokenizer_fields(reader)
    special = _special_tokens(fields, read_gguf_metadata(reader))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in state_dict.items()}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        _write_json(staging / "config.json", _hf_config(config))
        _write_json(
            staging / "generation_config.json",
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": config["eos_token_id"],
            },
        )
        build_gguf_tokenizer(fields).backend.save(str(staging / "tokenizer.json"))
        _write_json(staging / "special_tokens_map.json", special)
        _write_json(
            staging / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": fields["chat_template"],
                "add_bos_token": fields["add_bos_token"],
                "model_max_length": config["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                **special,
            },
        )
        for file in staging.iterdir():  # mkdtemp and safetensors make them private (0600)
            file.chmod(0o644)
        staging.chmod(0o755)
        _replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _replace(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``; an old ``target`` is moved aside first, then deleted."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        target.rename(old / target.name)
    new.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers writes it for this architecture, in bfloat16."""
    return {
        **config,
        "architectures": [ARCHITECTURES[config["model_type"]]],
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def _special_tokens(fields: dict[str, Any], meta: dict[str, Any]) -> dict[str, str]:
    """bos/eos/unk/pad as token strings; unk and pad fall back to EOS if the GGUF names none."""
    ids = {
        "bos_token": fields["bos_token_id"],
        "eos_token": fields["eos_token_id"],
        "unk_token": meta.get("tokenizer.ggml.unknown_token_id", fields["eos_token_id"]),
        "pad_token": meta.get("tokenizer.ggml.padding_token_id", fields["eos_token_id"]),
    }
    return {name: fields["tokens"][i] for name, i in ids.items() if i is not None}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.model.hf_export MODEL OUT_DIR``; 0 on success, 2 on a bad argument."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.model.hf_export", description=__doc__.splitlines()[0]
    )
    parser.add_argument("model", help="an embedded model name (smollm2) or a .gguf file")
    parser.add_argument("out_dir", type=Path, help="the HF directory to write")
    args = parser.parse_args(argv)
    try:
        out_dir = export_hf_directory(args.model, args.out_dir)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
