"""`iterscope kv-plan`: story 5 from a config.json, and the embedded model from its GGUF."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.entrypoints.kv_plan import main
from engine.kv_planning import GIB, cuda_kv_budget_bytes

REPO = Path(__file__).resolve().parents[1]

STORY5_CONFIG = {  # the shape of the 8B model in USER_STORIES story 5 (no weights needed)
    "model_type": "qwen3",
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def story5_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(STORY5_CONFIG))
    return tmp_path


def test_story5_does_not_fit_and_says_why(story5_dir, capsys):
    code = main(["--model", str(story5_dir), "--memory", "4.5GiB", "--max-model-len", "40960"])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert code == 1 and len(lines) == 6
    assert lines[1] == (
        "KV bytes per token: 147,456 (2 x 36 layers x 8 KV heads x 128 head_dim x 2 bytes)"
    )
    assert lines[2:6] == [
        "Available KV cache memory: 4.50 GiB",
        "KV cache size: 32,768 tokens",
        "Maximum concurrency for 40,960 tokens per request: 0.80x",
        "Largest max model length that fits: 32,768",
    ]
    assert err.startswith(
        "iterscope kv-plan: To serve at least one request with the model's max seq len "
        "(40960), 5.62 GiB KV cache is needed, which is larger than the available KV cache "
        "memory (4.50 GiB)."
    )
    assert "estimated maximum model length is 32768" in err
    assert "Try increasing --memory or decreasing max_model_len (--max-model-len)" in err


def test_story5_fits_with_a_shorter_max_len(story5_dir, capsys):
    argv = ["--model", str(story5_dir), "--memory", "4.5GiB", "--max-model-len", "8192"]
    assert main([*argv, "--request-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "Maximum concurrency for 4,096 tokens per request: 8.00x" in out
    assert "To serve" not in out


def test_fp32_doubles_bytes_per_token(story5_dir, capsys):
    main(["--model", str(story5_dir), "--memory", "24GiB", "--dtype", "fp32"])
    assert "KV bytes per token: 294,912" in capsys.readouterr().out


@pytest.mark.live
def test_embedded_model_is_read_from_its_gguf(capsys):
    assert main(["--model", "smollm2", "--memory", "512MiB", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "(30 layers, 3 KV heads, head_dim 64, float32" in out
    assert "KV bytes per token: 46,080" in out
    assert "KV cache size: 11,648 tokens" in out  # 512 MiB / (16 x 46,080 B) = 728 blocks


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--memory", "1GiB"]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(STORY5_CONFIG))
    assert main(["--model", str(tmp_path), "--memory", "lots"]) == 2
    out, err = capsys.readouterr()
    assert "cannot read memory size 'lots'" in err and out == ""


def test_max_model_len_above_the_models_is_refused(story5_dir, capsys):
    argv = ["--model", str(story5_dir), "--memory", "80GiB", "--max-model-len", "40961"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "above the model's own limit (max_position_embeddings 40,960)" in err


def test_gpu_budget_subtracts_weights_and_activation_peak_like_the_engine(story5_dir, capsys):
    (story5_dir / "model.safetensors").write_bytes(b"\0" * 4096)
    argv = [
        "--model",
        str(story5_dir),
        "--gpu-memory",
        "10GiB",
        "--gpu-memory-utilization",
        "0.5",
        "--activation-peak",
        "1GiB",
        "--max-model-len",
        "1024",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    budget = cuda_kv_budget_bytes(10 * GIB, 0.5, 4096, GIB)
    assert budget == 4 * GIB - 4096  # 10 x 0.5 - weights - activation peak
    assert "GPU memory: 10.00 GiB x 0.5 utilization = 5.00 GiB" in out
    assert "minus weights: 0.00 GiB" in out and "minus activation peak: 1.00 GiB" in out
    assert f"Available KV cache memory: {budget / GIB:.2f} GiB" in out
    assert main([*argv[:-2], "--weights", "4.5GiB"]) == 2  # nothing left for the KV cache
    assert "raise gpu_memory_utilization (--gpu-memory-utilization)" in capsys.readouterr().err
    assert main(argv[:6]) == 2
    assert "--gpu-memory needs --activation-peak" in capsys.readouterr().err


@pytest.mark.live
def test_console_command_dispatches(story5_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.entrypoints.cli",
            "kv-plan",
            "--model",
            str(story5_dir),
            "--memory",
            "24GiB",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "Maximum concurrency for 40,960 tokens per request:" in result.stdout


@pytest.mark.live
def test_console_command_does_not_fit_exits_1_with_the_error_on_stderr(story5_dir):
    command = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "kv-plan",
        "--model",
        str(story5_dir),
        "--memory",
        "1GiB",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 1
    assert "To serve at least one request" in result.stderr
    assert "To serve" not in result.stdout
