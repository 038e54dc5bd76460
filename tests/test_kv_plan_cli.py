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
    """Story 5 ran on a GPU: --dtype auto there is 2 bytes (bfloat16 or float16)."""
    argv = ["--model", str(story5_dir), "--memory", "4.5GiB", "--max-model-len", "40960"]
    code = main([*argv, "--device", "cuda"])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert code == 1 and len(lines) == 7
    assert lines[1].startswith("KV cache dtype: bfloat16 (--dtype auto on a GPU: ")
    assert lines[2] == (
        "KV bytes per token: 147,456 (2 x 36 layers x 8 KV heads x 128 head_dim x 2 bytes)"
    )
    assert lines[3:7] == [
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
    argv += ["--dtype", "bf16"]
    assert main([*argv, "--request-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "Maximum concurrency for 4,096 tokens per request: 8.00x" in out
    assert "To serve" not in out


def test_fp32_doubles_bytes_per_token(story5_dir, capsys):
    main(["--model", str(story5_dir), "--memory", "24GiB", "--dtype", "fp32"])
    assert "KV bytes per token: 294,912" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "dtype", "bytes_per_token"),
    [
        ("fpu avx2 avx512f avx512_bf16", "bfloat16", "147,456"),
        ("fpu avx2 amx_bf16", "bfloat16", "147,456"),
        ("fpu avx2 avx512f", "float32", "294,912"),
    ],
)
def test_the_default_dtype_is_the_one_serve_picks_on_this_cpu(
    story5_dir, tmp_path, monkeypatch, flags, dtype, bytes_per_token, capsys
):
    """Not the checkpoint's bfloat16: `serve --dtype auto` runs float32 on a CPU without
    native bfloat16, where a bfloat16 plan would promise twice the cache there is."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr("engine.auto_dtype.CPUINFO", cpuinfo)
    assert main(["--model", str(story5_dir), "--memory", "24GiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"KV cache dtype: {dtype} (--dtype auto here: the CPU ")
    assert lines[2].startswith(f"KV bytes per token: {bytes_per_token} ")


def test_a_gpu_budget_on_a_cpu_is_refused(story5_dir, capsys):
    argv = ["--model", str(story5_dir), "--gpu-memory", "24GiB", "--activation-peak", "1GiB"]
    assert main([*argv, "--weights", "1GiB", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "iterscope kv-plan: --gpu-memory plans the engine on a GPU; drop --device cpu\n"
    )


@pytest.mark.live
def test_an_embedded_models_weights_are_its_gguf(capsys):
    """--gpu-memory without --weights sizes the embedded model's own file."""
    argv = ["--model", "smollm2", "--gpu-memory", "8GiB", "--activation-peak", "1GiB"]
    assert main([*argv, "--max-model-len", "2048"]) == 0
    assert "  minus weights: 0.09 GiB" in capsys.readouterr().out


@pytest.mark.live
def test_embedded_model_is_read_from_its_gguf(capsys):
    assert main(["--model", "smollm2", "--memory", "512MiB", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "(30 layers, 3 KV heads, head_dim 64, max_position_embeddings 8,192)" in out
    assert "KV cache dtype: float32 (--dtype float32)" in out
    assert "KV bytes per token: 46,080" in out
    assert "KV cache size: 11,648 tokens" in out  # 512 MiB / (16 x 46,080 B) = 728 blocks


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--memory", "1GiB"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        (
            "--memory",
            "lots",
            "expected a size with its unit, e.g. 512MiB, 4GiB or 4.5GB, got 'lots'",
        ),
        ("--memory", "512", "got '512': it has no unit (write 512B for bytes)"),
        ("--memory", "0MiB", "got '0MiB': it is not above 0 bytes"),
        ("--weights", "16", "got '16': it has no unit"),
        ("--block-size", "7", "expected a power of two up to 256 (e.g. 16), got '7'"),
        ("--block-size", "512", "expected a power of two up to 256 (e.g. 16), got '512'"),
        ("--max-model-len", "0", "expected a whole number >= 1, got '0'"),
        ("--gpu-memory-utilization", "90", "expected a fraction in (0, 1], e.g. 0.9, got '90'"),
    ],
)
def test_values_the_engine_refuses_are_refused_in_serves_words(
    story5_dir, flag, value, expected, capsys
):
    """The same rule as `iterscope serve`'s flag (engine/settings.py), so no plan is printed
    for a value the engine would not start with."""
    budget = [] if flag == "--memory" else ["--memory", "1GiB"]
    argv = ["--model", str(story5_dir), *budget, flag, value]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert f"iterscope kv-plan: error: argument {flag}: " in err and expected in err


def test_every_block_size_the_engine_takes_is_planned(story5_dir, capsys):
    argv = ["--model", str(story5_dir), "--memory", "4.5GiB", "--max-model-len", "1024"]
    for block_size in (1, 32, 256):
        assert main([*argv, "--block-size", str(block_size)]) == 0
        assert "KV cache size: 32,768 tokens" in capsys.readouterr().out


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
    assert "raise --gpu-memory-utilization to 0.56 or more" in capsys.readouterr().err
    assert main(argv[:6]) == 2
    assert "--gpu-memory needs --activation-peak" in capsys.readouterr().err


def test_no_memory_left_names_kv_plans_flags_and_the_engines(story5_dir, capsys):
    argv = ["--model", str(story5_dir), "--gpu-memory", "24GiB", "--gpu-memory-utilization"]
    assert main([*argv, "0.5", "--weights", "15GiB", "--activation-peak", "1GiB"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err == (
        "iterscope kv-plan: no memory left for the KV cache: weights (15.00 GiB) plus "
        "activation peak (1.00 GiB) = 16.00 GiB, which fills the 0.5 x 24.00 GiB = 12.00 GiB "
        "the engine may use; raise --gpu-memory-utilization to 0.67 or more, or lower the "
        "activation peak (`iterscope serve` with a smaller --max-num-batched-tokens, then "
        "pass the peak it logs as --activation-peak)\n"
    )
    argv += ["0.67", "--weights", "15GiB", "--activation-peak", "1GiB", "--max-model-len", "512"]
    assert main(argv) == 0


@pytest.mark.parametrize(("weights", "peak"), [("1GiB", "1GiB"), ("0.5GiB", "0.5GiB")])
def test_weights_and_activations_that_fill_the_card_need_another_model_or_gpu(
    story5_dir, weights, peak, capsys
):
    argv = ["--model", str(story5_dir), "--gpu-memory", "1GiB", "--gpu-memory-utilization", "1"]
    assert main([*argv, "--weights", weights, "--activation-peak", peak]) == 2
    err = capsys.readouterr().err
    assert "which fills the whole card (1.00 GiB), so no --gpu-memory-utilization can help" in err
    assert err.endswith("use a smaller model, a quantized one, or a GPU with more memory\n")
    assert "--max-num-batched-tokens" not in err


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


@pytest.mark.parametrize(
    ("max_len", "said"),
    [(["--max-model-len", "40960"], "40,960"), ([], "40,960 (its default: the model's)")],
)
def test_a_request_longer_than_the_max_model_len_is_refused(story5_dir, max_len, said, capsys):
    """The engine refuses a request above max_model_len, so no concurrency is printed for it."""
    argv = ["--model", str(story5_dir), "--memory", "45.94GiB", *max_len]
    assert main([*argv, "--request-len", "80800"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err == (
        f"iterscope kv-plan: --request-len 80,800 is above --max-model-len {said}; the engine "
        "refuses a request longer than its max model length\n"
    )
    assert main([*argv, "--request-len", "40960"]) == 0
    assert "Maximum concurrency for 40,960 tokens per request:" in capsys.readouterr().out
