"""`serve` and `demo` flags: every help names its default, every bad value is refused with
the flag, the value and the form expected, before anything starts."""

from __future__ import annotations

import pytest

from engine.entrypoints import demo, serve_args
from tests.helpers.flags import flags_without_default, options, refusal


@pytest.mark.parametrize(
    "parser", [serve_args.build_parser(), demo.build_parser()], ids=["serve", "demo"]
)
def test_every_flag_help_states_its_default(parser):
    assert flags_without_default(parser) == []


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--kv-cache-memory", "lots", "e.g. 512MiB, 4GiB"),
        ("--kv-cache-memory", "12 parsecs", "e.g. 512MiB, 4GiB"),
        ("--max-num-seqs", "0", "a whole number >= 1"),
        ("--max-num-seqs", "many", "a whole number >= 1"),
        ("--max-model-len", "-5", "a whole number >= 1"),
        ("--block-size", "24", "a power of two up to 256"),
        ("--gpu-memory-utilization", "90", "a fraction in (0, 1]"),
        ("--engine-index", "5000", "a whole number in 0..4095"),
        ("--port", "80000", "a port number 0-65535"),
        ("--dtype", "int4", "auto, float32, bfloat16 or float16"),
        ("--cpu-threads", "0", "a whole number >= 1"),
    ],
)
def test_serve_bad_values_name_flag_value_and_form(flag, value, expected, capsys):
    message = refusal(serve_args.build_parser(), [flag, value], capsys)
    assert message.startswith("iterscope serve: error: argument ")
    assert flag in message and repr(value) in message and expected in message


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--duration", "0", "a number > 0"),
        ("--ramp", "1,x", "whole numbers >= 1 separated by commas"),
        ("--kv-cache-memory", "24", "it has no unit (write 24B for bytes)"),
        ("--kv-cache-memory", "24 MiBs", "e.g. 512MiB, 4GiB"),
        ("--metrics-port", "-1", "a port number 0-65535"),
    ],
)
def test_demo_bad_values_name_flag_value_and_form(flag, value, expected, capsys):
    message = refusal(demo.build_parser(), [flag, value], capsys)
    assert flag in message and repr(value) in message and expected in message


def test_good_values_are_converted():
    args = serve_args.build_parser().parse_args(
        [
            "smollm2",
            "--kv-cache-memory",
            "4GiB",
            "--dtype",
            "bf16",
            "--block-size",
            "32",
            "--gpu-memory-utilization",
            "0.5",
            "--port",
            "0",
        ]
    )
    assert (args.kv_cache_memory_bytes, args.dtype, args.block_size) == (4 << 30, "bfloat16", 32)
    assert (args.gpu_memory_utilization, args.port, args.model_positional) == (0.5, 0, "smollm2")
    assert demo.build_parser().parse_args([]).kv_cache_memory == 24 << 20


def test_the_api_key_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("ITERSCOPE_API_KEY", "from-env")
    assert serve_args.build_parser().parse_args([]).api_key == "from-env"
    assert serve_args.build_parser().parse_args(["--api-key", "given"]).api_key == "given"
    monkeypatch.delenv("ITERSCOPE_API_KEY")
    assert serve_args.build_parser().parse_args([]).api_key is None


def test_the_engine_flags_are_the_configs_fields_with_its_defaults():
    """One statement of the engine's settings: every flag `serve` gives the engine is an
    EngineConfig field's (engine/config.py), its default is the field's, and parsing no flag
    at all gives the config's defaults."""
    from dataclasses import fields

    from engine.config import EngineConfig, flag_of

    parser = serve_args.build_parser()
    by_flag = {action.option_strings[0]: action for action in options(parser)}
    flagged = [f for f in fields(EngineConfig) if flag_of(f.name)]
    assert len(flagged) >= 15
    for setting in flagged:
        action = by_flag[flag_of(setting.name)]
        assert action.dest == setting.name
        assert action.default == setting.default, setting.name
    args = parser.parse_args([])
    assert serve_args.engine_config(args, None) == EngineConfig()


def test_max_num_seqs_defaults_by_device_unless_given():
    """32 on CPU, 256 on CUDA (a GPU step costs about the same at either batch); a value
    given is kept on either device."""
    parser = serve_args.build_parser()

    def seqs(*argv: str) -> int:
        return serve_args.engine_config(parser.parse_args(list(argv)), None).max_num_seqs

    assert (seqs(), seqs("--device", "cuda")) == (32, 256)
    assert seqs("--device", "cuda", "--max-num-seqs", "8") == 8
    assert seqs("--max-num-seqs", "300", "--max-num-batched-tokens", "4096") == 300


def test_a_flag_and_the_config_refuse_a_value_with_the_same_words(capsys):
    """The CLI reads a flag with the kind the config checks the field with."""
    from engine.config import EngineConfig

    for flag, field, text, value in (
        ("--max-num-seqs", "max_num_seqs", "0", 0),
        ("--block-size", "block_size", "24", 24),
        ("--gpu-memory-utilization", "gpu_memory_utilization", "1.5", 1.5),
    ):
        message = refusal(serve_args.build_parser(), [flag, text], capsys)
        with pytest.raises(ValueError) as error:
            EngineConfig(**{field: value})
        expected = message.split("expected ", 1)[1].rsplit(", got", 1)[0]
        assert f"must be {expected}, got" in str(error.value), (message, error.value)


def test_serve_refuses_a_model_it_cannot_find_before_starting_anything(
    tmp_path, capsys, monkeypatch
):
    """No sidecar is started (and so no /metrics, no recording) for a model that is not there."""
    from engine.entrypoints import serve
    from telemetry.sidecar import process as sidecar_process

    def no_sidecar(args):
        raise AssertionError("a sidecar was started")

    monkeypatch.setattr(sidecar_process, "start_from_args", no_sidecar)
    monkeypatch.setattr(serve.signal, "signal", lambda *_: None)  # keep pytest's SIGTERM
    assert serve.main([str(tmp_path / "no-such-model")]) == 1
    assert "not found: give smollm2, a .gguf file, or a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--no-sidecar", "--record", "run.jsonl"],
            "--record=run.jsonl: options of the sidecar started here, and --no-sidecar starts "
            "none; drop --no-sidecar to start one",
        ),
        (
            ["--telemetry-address", "ipc:///tmp/s.sock", "--metrics-port", "9", "--record", "r"],
            "--metrics-port=9 --record=r: options of the sidecar started here, and "
            "--telemetry-address starts none; give them to the sidecar at that address",
        ),
        (
            ["--telemetry-address", "foo://x"],
            "--telemetry-address must be ipc://PATH or tcp://HOST:PORT, got 'foo://x'",
        ),
        (
            ["--no-sidecar", "--telemetry-address", "ipc:///tmp/s.sock"],
            "--no-sidecar turns telemetry off and --telemetry-address sends it on: give one",
        ),
    ],
)
def test_serve_refuses_telemetry_options_it_would_ignore_before_starting_anything(
    flags, expected, capsys, monkeypatch
):
    """A --record without the sidecar that would write it lost the recording in silence."""
    from engine.entrypoints import serve

    def load(model):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(serve, "load_tokenizer", load)
    with pytest.raises(SystemExit) as exit_:
        serve.main(flags)
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def test_iterscope_without_a_command_says_its_usage_and_fails(capsys):
    from engine.entrypoints.cli import main as iterscope

    assert iterscope([]) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("usage: iterscope <command> [options]")
    assert iterscope(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: iterscope <command> [options]")
