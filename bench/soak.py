"""Soak `iterscope serve`: good and hostile requests for N minutes, then check nothing was lost.

    .venv/bin/python bench/soak.py --minutes 30 [--concurrency 4] [--seed 0]
        [--rss-margin-mib 64]

Not part of the tests: it runs for --minutes. It starts `serve` on the tiny model with its
sidecar (body and header timeouts 2 s, so slow clients resolve quickly) and runs
--concurrency workers, each sending a random mix of

- good requests, each answer checked: completions and chat, whole and streamed (with usage),
  completions with n=2 (one choice per index, finish reasons and token counts consistent, a
  stream ends with [DONE]);
- bad ones, each answer checked too: oversize bodies (413), malformed JSON (400), bodies that
  stall (408), unknown fields (400), max_tokens far past the model (400), 3 MiB prompts that
  can never fit (400), and streams the client drops after their first chunk.

Then, with the server idle, it checks: /health answers ok; the API port's /metrics counts
requests by route and status class exactly as the clients saw them; every KV block of the
engine is free again; the sidecar's records_dropped_total is 0; the frontend's RSS is back
within --rss-margin-mib of its size after warm-up; the sidecar's live findings opened no fault
(stall, spinning, leak, dead) and each opened once per condition: by kind, as many (within 5%,
FINDINGS_SLACK) as `explain` finds episodes in the run's recording (none flapped). The last
line of output is one JSON object with the figures; the exit status is 0 when every check
held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vllm_server import stop_server  # noqa: E402
from telemetry.analysis.episodes import detect_episodes  # noqa: E402
from telemetry.analysis.live_findings import finding_kind  # noqa: E402
from telemetry.analysis.timeline import read_timelines  # noqa: E402

MODEL = "tiny-llama"
BODY_TIMEOUT_S = 2
SERVE_FLAGS = (
    "--model",
    MODEL,
    "--kv-cache-memory",
    "4MiB",
    "--cpu-threads",
    "1",
    "--port",
    "0",
    "--metrics-port",
    "0",
    "--request-body-timeout",
    str(BODY_TIMEOUT_S),
    "--request-header-timeout",
    "2",
)
OVERSIZE_BYTES = 5 << 20  # over serve's default --max-request-body of 4 MiB
LARGE_PROMPT_BYTES = 3 << 20  # under it, and far over the tiny model's 1024 tokens
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_FAILURES_SHOWN = 20


class WrongAnswer(AssertionError):
    """The server answered a request otherwise than it should have."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise WrongAnswer(message)


@dataclass
class Tally:
    """What the clients did and saw."""

    runs: Counter = field(default_factory=Counter)  # case name -> times run
    seen: Counter = field(default_factory=Counter)  # (route, status class) -> responses
    failures: list[str] = field(default_factory=list)  # the first MAX_FAILURES_SHOWN
    num_failures: int = 0

    def saw(self, route: str, status: int) -> None:
        self.seen[(route, f"{status // 100}xx")] += 1

    def fail(self, case: str, error: BaseException) -> None:
        self.num_failures += 1
        if len(self.failures) < MAX_FAILURES_SHOWN:
            self.failures.append(f"{case}: {type(error).__name__}: {error}")


@dataclass
class Context:
    http: httpx.AsyncClient
    base_url: str
    rng: random.Random
    tally: Tally

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.base_url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)


# Good requests -----------------------------------------------------------------------------


def prompt(rng: random.Random) -> str:
    words = ("the", "engine", "keeps", "every", "block", "it", "frees", "in", "order")
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))


def check_usage(usage: dict, n: int, max_tokens: int, finish_reasons: list[str]) -> None:
    expect(len(finish_reasons) == n, f"{len(finish_reasons)} finish reasons for n={n}")
    expect(set(finish_reasons) <= {"length", "stop"}, f"finish reasons {finish_reasons}")
    completion_tokens = usage["completion_tokens"]
    expect(1 <= completion_tokens <= n * max_tokens, f"{completion_tokens} completion tokens")
    if all(reason == "length" for reason in finish_reasons):
        expect(
            completion_tokens == n * max_tokens,
            f"{completion_tokens} tokens, all finished by length {max_tokens} x {n}",
        )
    expect(usage["prompt_tokens"] > 0, f"usage {usage}")


async def post_whole(ctx: Context, route: str, body: dict) -> dict:
    response = await ctx.http.post(f"{ctx.base_url}{route}", json=body)
    ctx.tally.saw(route, response.status_code)
    expect(response.status_code == 200, f"{response.status_code} {response.text[:200]}")
    return response.json()


def sampling(ctx: Context, n: int = 1) -> dict:
    greedy = n == 1 and ctx.rng.random() < 0.5
    return {
        "model": MODEL,
        "max_tokens": ctx.rng.randint(1, 16),
        "n": n,
        "temperature": 0.0 if greedy else 0.8,
        "seed": ctx.rng.randrange(1 << 30),
    }


async def completion(ctx: Context, n: int = 1) -> None:
    body = {**sampling(ctx, n), "prompt": prompt(ctx.rng)}
    answer = await post_whole(ctx, COMPLETIONS, body)
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    expect([choice["index"] for choice in choices] == list(range(n)), f"choices {choices}")
    expect(all(isinstance(choice["text"], str) for choice in choices), "text not a string")
    check_usage(answer["usage"], n, body["max_tokens"], [c["finish_reason"] for c in choices])


async def completion_n2(ctx: Context) -> None:
    await completion(ctx, n=2)


async def chat(ctx: Context) -> None:
    body = {**sampling(ctx), "messages": [{"role": "user", "content": prompt(ctx.rng)}]}
    answer = await post_whole(ctx, CHAT, body)
    [choice] = answer["choices"]
    expect(choice["message"]["role"] == "assistant", f"message {choice['message']}")
    expect(isinstance(choice["message"]["content"], str), "content not a string")
    check_usage(answer["usage"], 1, body["max_tokens"], [choice["finish_reason"]])


async def streamed(ctx: Context, route: str, body: dict) -> list[dict]:
    """The events of a streamed answer, checked to end with [DONE]."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with ctx.http.stream("POST", f"{ctx.base_url}{route}", json=body) as response:
        ctx.tally.saw(route, response.status_code)
        expect(response.status_code == 200, f"{response.status_code}")
        datas = [
            line[len("data: ") :]
            async for line in response.aiter_lines()
            if line.startswith("data: ")
        ]
    expect(bool(datas) and datas[-1] == "[DONE]", f"stream ended with {datas[-1:]}")
    events = [json.loads(data) for data in datas[:-1]]
    expect(all("error" not in event for event in events), f"error event {events[-1]}")
    return events


async def stream_completion(ctx: Context) -> None:
    body = {**sampling(ctx), "prompt": prompt(ctx.rng)}
    events = await streamed(ctx, COMPLETIONS, body)
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    check_usage(events[-1]["usage"], 1, body["max_tokens"], reasons)


async def stream_chat(ctx: Context) -> None:
    body = {**sampling(ctx), "messages": [{"role": "user", "content": prompt(ctx.rng)}]}
    events = await streamed(ctx, CHAT, body)
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    expect(events[0]["choices"][0]["delta"].get("role") == "assistant", "no role first")
    check_usage(events[-1]["usage"], 1, body["max_tokens"], reasons)


# Bad requests ------------------------------------------------------------------------------


async def refused(ctx: Context, body: dict | bytes, status: int, words: str) -> None:
    """POST ``body`` to the completions route; it must be refused with ``status``, the error
    message holding ``words``."""
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    response = await ctx.http.post(f"{ctx.base_url}{COMPLETIONS}", **kwargs)
    ctx.tally.saw(COMPLETIONS, response.status_code)
    expect(response.status_code == status, f"{response.status_code}, not {status}")
    message = response.json()["error"]["message"]
    expect(words in message, f"{message!r} does not say {words!r}")


async def malformed_json(ctx: Context) -> None:
    await refused(ctx, b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": ', 400, "JSON")


async def unknown_field(ctx: Context) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "frobnicate": True}
    await refused(ctx, body, 400, "frobnicate is not supported")


async def huge_max_tokens(ctx: Context) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}
    await refused(ctx, body, 400, "max_model_len")


async def large_prompt(ctx: Context) -> None:
    """A body under the limit whose prompt can never fit the model: parsed, tokenized and
    refused (the frontend's memory must come back afterwards)."""
    body = {"model": MODEL, "prompt": "x" * LARGE_PROMPT_BYTES}
    await refused(ctx, body, 400, "max_model_len")


async def raw_exchange(ctx: Context, head: bytes, timeout_s: float) -> int:
    """Send ``head`` (request line, headers, maybe part of a body) on a connection of its
    own and read until the server closes it; the answer's status."""
    reader, writer = await asyncio.open_connection(*ctx.host_port)
    try:
        writer.write(head)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    expect(match is not None, f"no HTTP status in {answer[:80]!r}")
    ctx.tally.saw(COMPLETIONS, int(match.group(1)))
    return int(match.group(1))


def request_head(content_length: int, body_start: bytes) -> bytes:
    return (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    ).encode() + body_start


async def oversize_body(ctx: Context) -> None:
    status = await raw_exchange(ctx, request_head(OVERSIZE_BYTES, b'{"prompt": "'), 30)
    expect(status == 413, f"{status} for a {OVERSIZE_BYTES:,}-byte body")


async def slow_body(ctx: Context) -> None:
    status = await raw_exchange(ctx, request_head(200, b'{"prompt": "'), BODY_TIMEOUT_S + 30)
    expect(status == 408, f"{status} for a body that stalled")


async def dropped_stream(ctx: Context) -> None:
    """A stream the client leaves after its first chunk (the server aborts the request)."""
    body = {
        "model": MODEL,
        "prompt": prompt(ctx.rng),
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    async with ctx.http.stream("POST", f"{ctx.base_url}{COMPLETIONS}", json=body) as response:
        ctx.tally.saw(COMPLETIONS, response.status_code)
        expect(response.status_code == 200, f"{response.status_code}")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream


Case = Callable[[Context], Awaitable[None]]
CASES: dict[str, tuple[Case, int]] = {  # name -> (case, weight)
    "completion": (completion, 6),
    "chat": (chat, 6),
    "completion_n2": (completion_n2, 3),
    "stream_completion": (stream_completion, 5),
    "stream_chat": (stream_chat, 5),
    "oversize_body": (oversize_body, 2),
    "malformed_json": (malformed_json, 2),
    "slow_body": (slow_body, 1),
    "unknown_field": (unknown_field, 2),
    "huge_max_tokens": (huge_max_tokens, 2),
    "dropped_stream": (dropped_stream, 3),
    "large_prompt": (large_prompt, 1),
}


async def worker(ctx: Context, deadline: float) -> None:
    names = list(CASES)
    weights = [CASES[name][1] for name in names]
    while time.monotonic() < deadline:
        name = ctx.rng.choices(names, weights)[0]
        ctx.tally.runs[name] += 1
        try:
            await CASES[name][0](ctx)
        except Exception as error:  # a wrong answer of any shape is counted; the load goes on
            ctx.tally.fail(name, error)


# The server and what it reports ------------------------------------------------------------


def start_serve(
    log_path: Path, record_path: Path, timeout_s: float = 180
) -> tuple[subprocess.Popen, str]:
    """`iterscope serve` on the tiny model, in a session of its own, its sidecar recording to
    ``record_path``; (process, base URL)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "serve",
        *SERVE_FLAGS,
        "--record",
        str(record_path),
    ]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(r"on (http://\S+)/v1\n", log_path.read_text(errors="replace"))
        if match:
            return server, match.group(1)
        if server.poll() is not None:
            break
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"serve did not start:\n{log_path.read_text(errors='replace')[-3000:]}")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def scrape(base_url: str) -> list:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def counted_requests(samples: list) -> Counter:
    """(route, status class) -> requests, as the API port's /metrics counts them."""
    return Counter(
        {
            (s.labels["handler"], s.labels["status"]): int(s.value)
            for s in samples
            if s.name == "http_requests_total"
        }
    )


def engine_series(samples: list, name: str) -> float | None:
    values = [s.value for s in samples if s.name == name and s.labels.get("engine") == "0"]
    return values[0] if values else None


def wait_idle(base_url: str, timeout_s: float = 60) -> dict:
    """/health's body once the engine is idle with nothing in flight (or the last seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{base_url}/health", timeout=10)
        body = {**response.json(), "http_status": response.status_code}
        idle = body.get("engine") == "idle" and body.get("num_requests_in_flight") == 0
        if idle or time.monotonic() > deadline:
            return body
        time.sleep(0.2)


def poll(read: Callable[[], object], done: Callable[[object], bool], timeout_s: float):
    """``read()`` until ``done`` holds of it or ``timeout_s`` passes; the last value read."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


# The run -----------------------------------------------------------------------------------


async def sample_rss(pid: int, peak: list[int], start: float, tally: Tally) -> None:
    """Keep peak[0] the highest RSS seen; a progress line every 30 s."""
    last_line = start
    while True:
        peak[0] = max(peak[0], rss_bytes(pid))
        if time.monotonic() - last_line >= 30:
            last_line = time.monotonic()
            print(
                f"{last_line - start:6.0f} s: {sum(tally.runs.values())} requests, "
                f"{tally.num_failures} wrong, RSS {rss_bytes(pid) >> 20} MiB",
                flush=True,
            )
        await asyncio.sleep(1)


async def load(base_url: str, pid: int, args: argparse.Namespace, tally: Tally) -> tuple:
    """Warm up, note the resting RSS, run the workers; (baseline RSS, peak RSS)."""
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    seeds = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        contexts = [
            Context(http, base_url, random.Random(seeds.random()), tally)
            for _ in range(args.concurrency)
        ]
        for warm_up in (completion, chat, stream_completion):
            tally.runs[warm_up.__name__] += 1
            await warm_up(contexts[0])
        baseline = rss_bytes(pid)
        peak = [baseline]
        start = time.monotonic()
        sampler = asyncio.ensure_future(sample_rss(pid, peak, start, tally))
        try:
            await asyncio.gather(
                *(worker(context, start + args.minutes * 60) for context in contexts)
            )
        finally:
            sampler.cancel()
    return baseline, peak[0]


def final_checks(
    base_url: str, pid: int, tally: Tally, baseline: int, margin: int, record_path: Path
) -> dict:
    """The figures of the idle server after the load, and which checks held."""
    health = wait_idle(base_url)
    counted = poll(lambda: counted_requests(scrape(base_url)), lambda c: c == tally.seen, 10)
    samples = poll(
        lambda: scrape(base_url),
        lambda s: (
            engine_series(s, "iterscope_kv_blocks_free")
            == engine_series(s, "iterscope_kv_blocks_capacity")
        ),
        10,
    )
    kv_free = engine_series(samples, "iterscope_kv_blocks_free")
    kv_capacity = engine_series(samples, "iterscope_kv_blocks_capacity")
    dropped = engine_series(samples, "iterscope_records_dropped_total")
    rss_end = poll(lambda: rss_bytes(pid), lambda rss: rss <= baseline + margin, 15)
    checks = {
        "answers_right": tally.num_failures == 0,
        "healthy": health["http_status"] == 200 and health.get("status") == "ok",
        "counts_match": counted == tally.seen,
        "kv_blocks_all_free": kv_capacity is not None and kv_free == kv_capacity,
        "no_records_dropped": dropped == 0,
        "rss_within_margin": rss_end <= baseline + margin,
    }
    findings = finding_checks(samples, record_path)
    checks.update(findings.pop("checks"))
    return {
        **findings,
        "health": health,
        "kv_blocks_free": kv_free,
        "kv_blocks_capacity": kv_capacity,
        "records_dropped": dropped,
        "rss_end_mib": round(rss_end / 2**20, 1),
        "status_seen": by_route(tally.seen),
        "status_counted": by_route(counted),
        "checks": checks,
    }


FAULT_KINDS = ("stall", "spinning", "kv_leak", "dead")  # a healthy run must open none
# Live and explain may differ by this share of a kind's findings: a long prefill's baseline is
# the median decode-only iteration of the live window, of the whole recording for explain
# (docs/diagnosis.md, "Live findings"). A finding that flapped would open about twice as often.
FINDINGS_SLACK = 0.05


def live_finding_counts(samples: list) -> dict[str, int]:
    """Live findings the sidecar opened over the run, by kind (iterscope_findings_total)."""
    return {
        s.labels["kind"]: int(s.value)
        for s in samples
        if s.name == "iterscope_findings_total" and s.labels.get("engine") == "0" and s.value
    }


def explained_counts(record_path: Path) -> dict[str, int]:
    """explain's problem episodes in the run's recording, by the kind the sidecar names them:
    one live finding per episode means none opened twice for one condition (no flapping)."""
    counts: Counter = Counter()
    for timeline in read_timelines([record_path])[0].values():
        for episode in detect_episodes(timeline):
            if episode.severity == "info":
                continue
            counts[finding_kind(episode)] += 1
    return dict(sorted(counts.items()))


def finding_checks(samples: list, record_path: Path) -> dict:
    live, explained = live_finding_counts(samples), explained_counts(record_path)
    return {
        "live_findings": dict(sorted(live.items())),
        "explained_findings": explained,
        "checks": {
            "no_fault_findings": not set(live) & set(FAULT_KINDS),
            "findings_as_explain": all(
                abs(live.get(kind, 0) - explained.get(kind, 0)) <= FINDINGS_SLACK * count + 1
                for kind, count in {**live, **explained}.items()
            ),
        },
    }


def by_route(counts: Counter) -> dict[str, int]:
    return {f"{route} {status}": count for (route, status), count in sorted(counts.items())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="how long the load runs (default %(default)s)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=4, help="clients at once (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the request mix (default 0)")
    parser.add_argument(
        "--rss-margin-mib",
        type=float,
        default=64.0,
        help="the frontend's RSS may end this far above its size after "
        "warm-up (default %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="iterscope-soak-") as directory:
        log_path = Path(directory) / "serve.log"
        record_path = Path(directory) / "soak.jsonl"
        server, base_url = start_serve(log_path, record_path)
        print(
            f"serve on {base_url} (pid {server.pid}); {args.minutes:g} minutes, "
            f"{args.concurrency} clients",
            flush=True,
        )
        try:
            baseline, peak = asyncio.run(load(base_url, server.pid, args, tally))
            figures = final_checks(
                base_url,
                server.pid,
                tally,
                baseline,
                int(args.rss_margin_mib * 2**20),
                record_path,
            )
        finally:
            stop_server(server)
        tracebacks = log_path.read_text(errors="replace").count("Traceback")
    figures["checks"]["serve_exited_cleanly"] = server.returncode == 0 and tracebacks == 0
    result = {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "requests": sum(tally.runs.values()),
        "runs": dict(sorted(tally.runs.items())),
        "wrong_answers": tally.num_failures,
        "wrong_examples": tally.failures,
        "rss_baseline_mib": round(baseline / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "serve_exit_status": server.returncode,
        "serve_tracebacks": tracebacks,
        **figures,
        "passed": all(figures["checks"].values()),
    }
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
