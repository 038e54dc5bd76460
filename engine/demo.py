"""`iterscope demo` (interim, until the frontend lands): the engine core in-process on the
embedded default model with a small workload; prints the start-up KV lines, the generated
text and what the per-iteration records counted."""

from __future__ import annotations

import argparse
import time

from engine.config import EngineConfig, parse_memory_size
from engine.core import build_engine_core
from engine.request import Request, SamplingParams
from telemetry.record import IterationRecord

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a KV cache is in one sentence.",
    "List three primary colors.",
    "What is 12 times 12?",
    "Give me a tip for writing clean Python code.",
]


class CountingPublisher:
    """Sums what the iteration records say, in place of the telemetry lane."""

    def __init__(self) -> None:
        self.num_iterations = 0
        self.num_context_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.max_running_reqs = 0

    def publish(self, record: IterationRecord) -> None:
        self.num_iterations += 1
        self.num_context_tokens += record.num_context_tokens
        self.num_generation_tokens += record.num_generation_tokens
        self.num_preemptions += record.num_preemptions
        self.max_running_reqs = max(self.max_running_reqs, record.num_running_reqs)

    def note_queues(self, num_waiting: int, num_running: int) -> None:
        pass

    def close(self) -> None:
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterscope demo", description=__doc__)
    parser.add_argument("--model", default="smollm2", help="HF directory, .gguf or smollm2")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="512MiB", help="KV budget, e.g. 512MiB")
    parser.add_argument("--max-model-len", type=int, default=2048)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.num_requests <= len(PROMPTS):
        print(f"iterscope demo: --num-requests must be in 1..{len(PROMPTS)}")
        return 2
    config = EngineConfig(
        model=args.model,
        kv_cache_memory_bytes=parse_memory_size(args.kv_cache_memory),
        max_model_len=args.max_model_len,
    )
    print(f"Loading {config.model} ({config.torch_dtype_name}, {config.device}) ...", flush=True)
    publisher = CountingPublisher()
    core, model = build_engine_core(config, publisher=publisher)
    print("\n".join(core.startup_lines()), flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for index, prompt in enumerate(PROMPTS[: args.num_requests]):
        token_ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        core.add_request(Request(f"demo-{index}", token_ids, params))
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while core.has_work:
        for output in core.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    elapsed = time.perf_counter() - start
    for index, prompt in enumerate(PROMPTS[: args.num_requests]):
        text = model.tokenizer.decode(outputs.get(f"demo-{index}", []))
        print(f"\n> {prompt}\n{text.strip()}")
    print(
        f"\n{publisher.num_iterations} iterations in {elapsed:.1f} s: "
        f"{publisher.num_context_tokens} prompt tokens, {publisher.num_generation_tokens} "
        f"generated tokens ({publisher.num_generation_tokens / elapsed:.1f} tokens/s), "
        f"up to {publisher.max_running_reqs} requests per batch, "
        f"{publisher.num_preemptions} preemptions"
    )
    return 0
