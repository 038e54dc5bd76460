"""`iterscope bench`: the dataset, the concurrency limit, the figures, and a real run whose
token counts must agree with what the sidecar counted from the engine's own records."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import httpx
import pytest

from engine.entrypoints import bench_client, bench_load, bench_summary
from engine.entrypoints.bench_backends import BenchRequest, HttpBackend, RequestResult
from engine.entrypoints.serve_args import TINY_MODEL
from telemetry.lane.record import IterationRecord
from telemetry.lane.recording import read_recording
from tests.helpers import REPO
from tests.helpers.flags import flags_without_default, refusal
from tests.helpers.prom import scrape, total
from tests.helpers.serve import ServerProcess
from tests.helpers.wait import wait_until


def test_random_dataset_is_seeded_and_exact():
    first = bench_load.random_dataset(20, 50, 7, vocab_size=300, seed=3)
    assert first == bench_load.random_dataset(20, 50, 7, vocab_size=300, seed=3)
    assert first != bench_load.random_dataset(20, 50, 7, vocab_size=300, seed=4)
    assert all(len(r.prompt_token_ids) == 50 and r.max_tokens == 7 for r in first)
    assert all(0 <= t < 300 for r in first for t in r.prompt_token_ids)


def test_random_dataset_range_ratio():
    requests = bench_load.random_dataset(200, 100, 10, vocab_size=50, seed=0, range_ratio=0.5)
    input_lens = {len(r.prompt_token_ids) for r in requests}
    assert min(input_lens) >= 50 and max(input_lens) <= 150 and len(input_lens) > 20
    assert {r.max_tokens for r in requests} <= set(range(5, 16))
    with pytest.raises(ValueError, match="range_ratio"):
        bench_load.random_dataset(2, 10, 10, vocab_size=50, range_ratio=1.0)
    with pytest.raises(ValueError, match="at least 1"):
        bench_load.random_dataset(0, 10, 10, vocab_size=50)


def test_vocab_size_from_the_card_or_the_model_directory_it_names(tmp_path):
    """Ours reports vocab_size; vLLM's card does not, but names the model's directory (root)."""
    assert bench_client.card_vocab_size({"id": "m", "vocab_size": 49152}) == 49152
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    assert bench_client.card_vocab_size({"id": "m", "root": str(tmp_path)}) == 32000
    assert bench_client.card_vocab_size({"id": "m", "root": "HuggingFaceTB/SmolLM2"}) is None
    assert bench_client.card_vocab_size({"id": "m", "root": str(tmp_path / "none")}) is None
    assert bench_client.card_vocab_size({"id": "m"}) is None


def test_summary_figures():
    results = [
        RequestResult(True, "", 10, 3, ttft_time=0.1, itl_times=[0.02, 0.04], e2e_time=0.16),
        RequestResult(True, "", 20, 1, ttft_time=0.3, itl_times=[], e2e_time=0.3),
        RequestResult(False, "boom", 5, 0),
    ]
    metrics = bench_summary.summarize(results, duration_time=2.0)
    assert (metrics["num_completed"], metrics["num_failed"]) == (2, 1)
    assert (metrics["total_input_tokens"], metrics["total_output_tokens"]) == (30, 4)
    assert metrics["request_throughput"] == pytest.approx(1.0)
    assert metrics["output_throughput"] == pytest.approx(2.0)
    assert metrics["total_token_throughput"] == pytest.approx(17.0)
    assert metrics["mean_ttft_ms"] == pytest.approx(200.0)
    assert metrics["median_ttft_ms"] == pytest.approx(200.0)
    assert metrics["mean_itl_ms"] == pytest.approx(30.0)
    assert metrics["mean_tpot_ms"] == pytest.approx(30.0)  # (0.16 - 0.1) / 2; 1-token excluded
    assert metrics["mean_e2el_ms"] == pytest.approx(230.0)
    table = bench_summary.format_summary(metrics)
    assert "Successful requests:" in table and "P99 ITL (ms):" in table


class CountingBackend:
    """Answers after a short sleep and records how many requests were in flight at once."""

    def __init__(self) -> None:
        self.num_in_flight = 0
        self.max_in_flight = 0

    async def send(self, request: BenchRequest) -> RequestResult:
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        await asyncio.sleep(0.01)
        self.num_in_flight -= 1
        return RequestResult(
            True, "", len(request.prompt_token_ids), request.max_tokens, 0.005, [0.005], 0.01
        )


def test_max_concurrency_is_respected():
    backend = CountingBackend()
    requests = bench_load.random_dataset(30, 4, 2, vocab_size=10)
    results, _ = asyncio.run(
        bench_load.run_benchmark(backend, requests, concurrency_at=lambda _: 3, progress=False)
    )
    assert len(results) == 30 and all(r.success for r in results)
    assert backend.max_in_flight == 3


def test_queued_arrivals_are_sent_first_come_first_served_as_the_limit_rises():
    """Arrivals do not wait for a free slot (they queue on the client side, as in vLLM's
    benchmark); a limit that rises mid-run lets more through, still in arrival order."""
    backend = CountingBackend()
    sent = []
    send = backend.send

    async def recording_send(request):
        sent.append(request)
        return await send(request)

    backend.send = recording_send
    requests = bench_load.random_dataset(40, 4, 2, vocab_size=10, seed=3)
    results, _ = asyncio.run(
        bench_load.run_benchmark(
            backend,
            requests,
            concurrency_at=lambda elapsed: 1 if elapsed < 0.05 else 4,
            progress=False,
        )
    )
    assert len(results) == 40 and sent == requests
    assert backend.max_in_flight == 4


def test_poisson_rate_and_stop_sending_after():
    backend = CountingBackend()
    requests = bench_load.random_dataset(1000, 4, 2, vocab_size=10)
    results, _ = asyncio.run(
        bench_load.run_benchmark(
            backend, requests, request_rate=200.0, progress=False, stop_sending_after=0.2
        )
    )
    assert 0 < len(results) < 1000


@pytest.mark.live
def test_bench_token_counts_agree_with_the_sidecar(tmp_path):
    # 32 blocks of 16 tokens: about three of the 24 requests (5 to 15 blocks each) fit at once,
    # and each runs for at least 48 decode steps, so requests overlap even on a slow machine
    # where the client's 24 requests reach the server spread out.
    server = ServerProcess(
        tmp_path,
        "--model",
        TINY_MODEL,
        "--kv-cache-memory",
        "256KiB",
        "--max-model-len",
        "256",
        "--cpu-threads",
        "1",
    )
    num_prompts = 24
    try:
        result_path = tmp_path / "result.json"
        command = [
            sys.executable,
            "-m",
            "engine.entrypoints.cli",
            "bench",
            "--base-url",
            server.base_url,
            "--num-prompts",
            str(num_prompts),
            "--random-input-len",
            "64",
            "--random-output-len",
            "96",
            "--random-range-ratio",
            "0.5",
            "--max-concurrency",
            "24",
            "--result-file",
            str(result_path),
            "--no-progress",
        ]
        run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert re.search(rf"Successful requests:\s+{num_prompts}\n", run.stdout)
        result = json.loads(result_path.read_text())
        assert result["num_completed"] == num_prompts and len(result["requests"]) == num_prompts
        page = {}

        def all_finished() -> bool:
            page.clear()
            page.update(scrape(server.metrics_url))
            finished = total(page, "iterscope_requests_finished_total", finish_reason="length")
            return finished == num_prompts

        wait_until(
            all_finished, 20, lambda: f"{num_prompts} requests finished in /metrics", interval_s=0.2
        )
        assert total(page, "iterscope_request_prompt_tokens_sum") == result["total_input_tokens"]
        assert (
            total(page, "iterscope_request_generation_tokens_sum") == result["total_output_tokens"]
        )
        # 24 requests sent at once into room for about three: some had to wait for KV blocks.
        # The recording is written a little after /metrics is scraped, so wait for it too.
        server.wait_for_records(lambda records: any(r.num_waiting_kv_reqs for r in records))
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.live
def test_in_process_bench_writes_a_result(tmp_path, capsys):
    result_path = tmp_path / "result.json"
    status = bench_client.main(
        [
            "--in-process",
            "--model",
            TINY_MODEL,
            "--kv-cache-memory",
            "1MiB",
            "--no-sidecar",
            "--cpu-threads",
            "1",
            "--num-prompts",
            "6",
            "--random-input-len",
            "16",
            "--random-output-len",
            "5",
            "--result-file",
            str(result_path),
            "--no-progress",
        ]
    )
    assert status == 0
    result = json.loads(result_path.read_text())
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (96, 30)
    assert result["settings"]["model"] == TINY_MODEL and result["settings"]["block_size"] == 16
    assert all(len(r["itl_times"]) == 4 for r in result["requests"])
    assert "Benchmark result" in capsys.readouterr().out


@pytest.mark.live
def test_in_process_bench_takes_serves_sidecar_shortcuts(tmp_path):
    """--record as `serve` takes it: the recording holds the bench's own tokens."""
    recording = tmp_path / "run.jsonl"
    argv = ["--in-process", "--model", TINY_MODEL, "--kv-cache-memory", "1MiB"]
    argv += ["--cpu-threads", "1", "--num-prompts", "6", "--random-input-len", "16"]
    argv += ["--random-output-len", "5", "--no-progress", "--record", str(recording)]
    assert bench_client.main(argv) == 0
    records = [m for m in read_recording(recording) if isinstance(m, IterationRecord)]
    assert sum(r.num_prefill_tokens for r in records) == 96
    assert sum(r.num_decode_tokens for r in records) == 30 - 6  # first tokens come of prefill


@pytest.mark.parametrize(
    "options",
    [["--max-num-seqs", "4"], ["--record", "run.jsonl"], ["--no-sidecar"], ["--model", "x"]],
)
def test_engine_and_sidecar_options_over_http_are_refused_not_ignored(options, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_client.main(["--base-url", "http://127.0.0.1:9", *options])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"error: {options[0]}: options of the engine and sidecar that --in-process " in err


@pytest.mark.parametrize(
    ("options", "sidecar_arg"),
    [
        ([], ["--metrics-port=0"]),  # not the default port: a running serve's sidecar has it
        (["--metrics-port", "9999"], ["--metrics-port=9999"]),
        (["--sidecar-arg=--metrics-port=9998"], ["--metrics-port=9998"]),
        (["--record", "r.jsonl"], ["--metrics-port=0", "--record=r.jsonl"]),
        (["--no-sidecar"], []),
    ],
)
def test_the_in_process_sidecar_gets_a_free_metrics_port_unless_told(options, sidecar_arg):
    args = bench_client.build_parser().parse_args(["--in-process", *options])
    assert bench_client.sidecar_options(args) is None
    assert args.sidecar_arg == sidecar_arg


def test_unreachable_server_is_a_clear_error(capsys):
    assert bench_client.main(["--base-url", "http://127.0.0.1:9", "--no-progress"]) == 1
    assert "cannot read http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_every_flag_help_states_its_default():
    parser = bench_client.build_parser()
    assert flags_without_default(parser) == []
    help_text = " ".join(parser.format_help().split())
    for flag, default in (
        ("--num-prompts", 100),
        ("--random-input-len", 128),
        ("--random-output-len", 64),
        ("--seed", 0),
    ):
        assert re.search(rf"{flag} N .*?\(default {default}\)", help_text), flag


def refused(argv: list[str], capsys) -> str:
    return refusal(bench_client.build_parser(), argv, capsys)


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--num-prompts", "0", "a whole number >= 1"),
        ("--num-prompts", "many", "a whole number >= 1"),
        ("--random-input-len", "-3", "a whole number >= 1"),
        ("--random-output-len", "0", "a whole number >= 1"),
        ("--random-range-ratio", "1", "a number in [0, 1)"),
        ("--random-range-ratio", "-0.1", "a number in [0, 1)"),
        ("--seed", "-1", "a whole number >= 0"),
        ("--request-rate", "0", "a number > 0"),
        ("--max-concurrency", "0", "a whole number >= 1"),
        ("--vocab-size", "-5", "a whole number >= 1"),
        ("--vocab-size", "0", "a whole number >= 1"),
        ("--base-url", "127.0.0.1:8000", "an http:// or https:// URL"),
        ("--base-url", "http://host:port", "an http:// or https:// URL"),
    ],
)
def test_bad_values_name_flag_value_and_form(flag, value, expected, capsys):
    message = refused([flag, value], capsys)
    assert message.startswith("iterscope bench: error: argument ")
    assert flag in message and repr(value) in message and expected in message


def test_good_values_are_converted():
    args = bench_client.build_parser().parse_args(
        ["--base-url", "https://h:8443/", "--seed", "7", "--random-range-ratio", "0.5"]
    )
    assert (args.base_url, args.seed, args.random_range_ratio) == ("https://h:8443/", 7, 0.5)
    assert bench_client.build_parser().parse_args(["--request-rate", "inf"]).request_rate > 1e300


def test_a_result_file_that_cannot_be_written_is_refused_before_any_load(tmp_path, capsys):
    missing = tmp_path / "nodir" / "r.json"
    message = refused(["--result-file", str(missing)], capsys)
    assert "argument --result-file" in message and repr(str(missing)) in message
    assert "no folder" in message
    message = refused(["--result-file", str(tmp_path)], capsys)
    assert "argument --result-file" in message and "folder" in message
    # main refuses it too, before it reads the server (none listens on port 9)
    argv = ["--base-url", "http://127.0.0.1:9", "--result-file", str(missing)]
    with pytest.raises(SystemExit):
        bench_client.main(argv)
    assert "cannot read" not in capsys.readouterr().err


def test_a_writable_result_file_is_checked_without_a_trace(tmp_path):
    """The check opens the file; one that was not there is not left behind, one that was is
    kept as it was."""
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("before")
    parse = bench_client.build_parser().parse_args
    assert parse(["--result-file", str(new)]).result_file == str(new)
    assert parse(["--result-file", str(old)]).result_file == str(old)
    assert not new.exists() and old.read_text() == "before"


class FakeHttpBackend(CountingBackend):
    """HttpBackend's methods, answered here; ``on_card`` runs when the card is read."""

    on_card = staticmethod(lambda: None)

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        super().__init__()
        self.model = None

    async def model_card(self) -> dict:
        FakeHttpBackend.on_card()
        return {"id": "fake", "vocab_size": 100}

    async def close(self) -> None:
        pass


def test_a_result_file_that_fails_at_the_end_is_a_clear_error(tmp_path, capsys, monkeypatch):
    """The folder goes away during the run: the summary is printed, then one line says the
    file was not written."""
    folder = tmp_path / "gone"
    folder.mkdir()
    monkeypatch.setattr(bench_client, "HttpBackend", FakeHttpBackend)
    monkeypatch.setattr(FakeHttpBackend, "on_card", staticmethod(folder.rmdir))
    argv = ["--num-prompts", "3", "--no-progress", "--result-file", str(folder / "r.json")]
    assert bench_client.main(argv) == 1
    out, err = capsys.readouterr()
    assert "Successful requests:" in out
    assert err.strip().splitlines() == [
        f"iterscope bench: could not write --result-file {str(folder / 'r.json')!r}: "
        "No such file or directory (the summary printed above is this run's result)"
    ]


def test_a_result_file_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_client, "HttpBackend", FakeHttpBackend)
    path = tmp_path / "r.json"
    argv = ["--num-prompts", "3", "--no-progress", "--result-file", str(path)]
    assert bench_client.main(argv) == 0
    result = json.loads(path.read_text(), parse_constant=pytest.fail)  # strict: no Infinity
    assert result["num_completed"] == 3 and result["settings"]["result_file"] == str(path)
    assert result["settings"]["request_rate"] == "inf"  # the default, as vLLM writes it
    # the served model, and none of the engine's flags: over HTTP they did not apply
    assert result["settings"]["model"] == "fake"
    assert not {"dtype", "max_num_seqs", "block_size"} & set(result["settings"])


def mock_backend(handler) -> HttpBackend:
    """An HttpBackend for http://127.0.0.1:9470 whose answers come from ``handler``."""
    backend = HttpBackend("http://127.0.0.1:9470")
    backend.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return backend


async def read_card(backend: HttpBackend) -> dict:
    try:
        return await backend.model_card()
    finally:
        await backend.close()


@pytest.mark.parametrize(
    "status, body, shown",
    [
        (200, b"# HELP iterscope_requests_running ...\n", "'# HELP iterscope_requests_running"),
        (200, b'{"status": "ok"}', '{"status": "ok"}'),
        (200, b'{"data": []}', '{"data": []}'),
        (404, b"<html>\n<p>Not Found</p>", "HTTP 404"),
    ],
)
def test_a_server_that_is_not_openai_is_a_one_line_error(status, body, shown):
    backend = mock_backend(lambda request: httpx.Response(status, content=body))
    with pytest.raises(RuntimeError) as error:
        asyncio.run(read_card(backend))
    message = str(error.value)
    assert message.startswith("http://127.0.0.1:9470/v1/models does not answer like an OpenAI")
    assert 'expected HTTP 200 with JSON {"data": [{"id": ...}]}' in message
    assert shown in message and "\n" not in message


def test_the_api_key_is_sent_and_a_401_asks_for_it(monkeypatch):
    """A server started with --api-key answered 401, which read as no OpenAI server at all."""
    monkeypatch.setenv("ITERSCOPE_API_KEY", "from-env")
    assert bench_client.build_parser().parse_args([]).api_key == "from-env"
    backend = HttpBackend("http://127.0.0.1:9470", api_key="k")
    assert backend.http.headers["authorization"] == "Bearer k"
    asyncio.run(backend.close())
    backend = mock_backend(lambda request: httpx.Response(401, json={"error": {}}))
    with pytest.raises(RuntimeError) as error:
        asyncio.run(read_card(backend))
    assert str(error.value) == (
        "http://127.0.0.1:9470/v1/models answered 401: the server wants an API key; give --api-key"
    )


def test_the_first_model_card_is_read():
    card = {"id": "m", "vocab_size": 50}
    backend = mock_backend(lambda request: httpx.Response(200, json={"data": [card]}))
    assert asyncio.run(read_card(backend)) == card


def test_a_non_openai_server_stops_main_with_one_line(capsys, monkeypatch):
    def metrics_page(base_url: str, **_) -> HttpBackend:
        return mock_backend(lambda request: httpx.Response(200, text="# HELP x\nx 1\n"))

    monkeypatch.setattr(bench_client, "HttpBackend", metrics_page)
    assert bench_client.main(["--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("iterscope bench: http://127.0.0.1:9470/v1/models does not answer")
    assert err.count("\n") == 1 and "Expecting value" not in err


def test_completions_that_are_not_openai_fail_each_request_in_one_line():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return httpx.Response(200, text="data: not json\n\n")
        return httpx.Response(404, text="<html>\nno\n</html>")

    async def send_both() -> list[RequestResult]:
        backend = mock_backend(handler)
        try:
            first = await backend.send(BenchRequest([1, 2], 3))
            backend.base_url = "http://127.0.0.1:9470/elsewhere"
            return [first, await backend.send(BenchRequest([1, 2], 3))]
        finally:
            await backend.close()

    streamed, refused = asyncio.run(send_both())
    assert not streamed.success and not refused.success
    assert streamed.error == "expected server-sent events of JSON objects, got 'data: not json'"
    assert refused.error.startswith(
        "http://127.0.0.1:9470/elsewhere/v1/completions answered HTTP 404"
    )
    assert "\n" not in refused.error


def test_a_card_with_an_unusable_vocab_size_gives_none(tmp_path):
    (tmp_path / "config.json").write_text("not json")
    assert bench_client.card_vocab_size({"id": "m", "root": str(tmp_path)}) is None
    assert bench_client.card_vocab_size({"id": "m", "vocab_size": "many"}) is None
