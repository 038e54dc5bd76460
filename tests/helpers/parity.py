"""Our decoder against transformers on tiny random models: the reference model, requests
with their KV blocks, and prefill in chunks (tests/test_model_parity.py and
tests/test_half_precision.py)."""

from __future__ import annotations

import random

import torch
import transformers

from engine.request import Request, SamplingParams
from engine.runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 96
SEQ_LEN = 37


def hf_model(hf_config: dict, state_dict: dict) -> torch.nn.Module:
    kwargs = dict(hf_config)
    kwargs.pop("model_type")
    if hf_config["model_type"] == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected
    assert all(name == "lm_head.weight" for name in missing)  # tied to the embeddings
    return model.float().eval()


def make_request(name: str, token_ids: list[int], free_blocks: list[int]) -> Request:
    num_blocks = (len(token_ids) + BLOCK_SIZE - 1) // BLOCK_SIZE
    request = Request(name, token_ids, SamplingParams(temperature=0, max_tokens=1))
    request.block_ids = [free_blocks.pop() for _ in range(num_blocks)]
    return request


def random_tokens(seed: int, n: int = SEQ_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 320) for _ in range(n)]


def shuffled_blocks(seed: int) -> list[int]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return blocks


def run_in_chunks(runner: ModelRunner, request: Request, chunks: list[int]) -> torch.Tensor:
    outputs = []
    for n in chunks:
        (logits,) = runner.compute_logits([(request, n)])
        outputs.append(logits)
        request.num_computed_tokens += n
    return torch.cat(outputs)
