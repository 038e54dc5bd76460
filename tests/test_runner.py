"""ModelRunner on tiny random-weight models: batching never changes tokens, requests are read
only, bad schedules fail clearly, and HF directories load."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.model.loader import build_tiny_model, load_model, tiny_hf_config, tiny_state_dict
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 128


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request):
    return build_tiny_model(request.param, seed=3)


def new_request(name: str, num_prompt: int, params: SamplingParams, seed: int) -> Request:
    rng = random.Random(seed)
    return Request(name, [rng.randrange(0, 256) for _ in range(num_prompt)], params)


def generate(runner: ModelRunner, requests: list[Request], chunk: int, num_out: int) -> None:
    """A small engine loop: prefill in chunks of `chunk`, then decode all together."""
    free = list(range(NUM_BLOCKS))
    random.Random(len(requests)).shuffle(free)
    while any(r.num_output_tokens < num_out for r in requests):
        scheduled = []
        for r in requests:
            if r.num_output_tokens >= num_out:
                continue
            n = min(chunk, len(r.token_ids) - r.num_computed_tokens)
            while len(r.block_ids) * BLOCK_SIZE < r.num_computed_tokens + n:
                r.block_ids.append(free.pop())
            scheduled.append((r, n))
        tokens = runner.execute(scheduled)
        for (r, n), token in zip(scheduled, tokens, strict=True):
            r.num_computed_tokens += n
            if token is not None:
                r.token_ids.append(token)


def test_batching_and_chunking_do_not_change_tokens(tiny):
    greedy = SamplingParams(temperature=0)
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=5)
    specs = [(13, greedy), (30, seeded), (5, greedy), (22, seeded)]
    alone = []
    for i, (n, params) in enumerate(specs):
        request = new_request(f"r{i}", n, params, seed=i)
        generate(ModelRunner(tiny, NUM_BLOCKS, BLOCK_SIZE, "cpu"), [request], chunk=64, num_out=8)
        alone.append(request.output_token_ids)
    together = [new_request(f"r{i}", n, p, seed=i) for i, (n, p) in enumerate(specs)]
    generate(ModelRunner(tiny, NUM_BLOCKS, BLOCK_SIZE, "cpu"), together, chunk=7, num_out=8)
    assert [r.output_token_ids for r in together] == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fresh_prompts_of_close_lengths_share_one_padded_attention_call(dtype):
    """Prompts of 60, 56 and 63 tokens in one step are one span (padded to 63 in attention),
    and every position's logits are those of each prompt computed alone; 40 tokens is too
    short to pad to 63, so it gets a span of its own."""
    model = build_tiny_model("llama", seed=5, dtype=dtype)
    greedy = SamplingParams(temperature=0)
    lengths = (60, 56, 63, 40)

    def scheduled(runner: ModelRunner) -> list[tuple[Request, int]]:
        requests = [new_request(f"r{i}", n, greedy, seed=i) for i, n in enumerate(lengths)]
        for i, request in enumerate(requests):
            request.block_ids = list(range(20 * i, 20 * i + 16))
        return [(request, len(request.token_ids)) for request in requests]

    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    together = scheduled(runner)
    spans = runner.prepare(together).meta.prefills
    assert [span.lengths for span in spans] == [[60, 56, 63], [40]]
    batched = runner.compute_logits(together)
    alone = [ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, "cpu").compute_logits([one])[0]
             for one in scheduled(runner)]  # fmt: skip
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    for got, want in zip(batched, alone, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_execute_reads_requests_without_changing_them(tiny):
    runner = ModelRunner(tiny, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    request = new_request("a", 10, SamplingParams(temperature=0), seed=0)
    request.block_ids = [7, 3, 9]
    assert runner.execute([(request, 6)]) == [None]  # a chunk: nothing sampled
    assert request.num_computed_tokens == 0
    assert (len(request.token_ids), request.block_ids) == (10, [7, 3, 9])
    request.num_computed_tokens = 6
    (token,) = runner.execute([(request, 4)])
    assert isinstance(token, int) and 0 <= token < tiny.config.vocab_size
    assert (request.num_computed_tokens, len(request.token_ids)) == (6, 10)


def test_bad_schedules_fail_clearly(tiny):
    runner = ModelRunner(tiny, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    request = new_request("a", 10, SamplingParams(temperature=0), seed=0)
    request.block_ids = [0, 1]
    with pytest.raises(ValueError, match="cannot hold 10 positions"):
        runner.execute([(request, 10)])
    request.block_ids = [0, 1, 2]
    with pytest.raises(ValueError, match="cannot compute 11 tokens"):
        runner.execute([(request, 11)])
    with pytest.raises(ValueError, match="num_blocks"):
        ModelRunner(tiny, 0, BLOCK_SIZE, "cpu")


def test_tiny_model_interface(tiny):
    cfg = tiny.config
    assert cfg.eos_token_ids == (257,) and cfg.dtype == torch.float32
    assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.num_layers == 2
    assert tiny.tokenizer.decode(tiny.tokenizer.encode("héllo")) == "héllo"
    assert tiny.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unknown_model_and_architecture_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(str(tmp_path))


def write_hf_dir(path, architecture: str) -> dict:
    """config.json + model.safetensors + a word-level tokenizer.json + chat template."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_config = tiny_hf_config(architecture)
    (path / "config.json").write_text(json.dumps(hf_config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 258]}))
    state_dict = tiny_state_dict(hf_config, seed=4)
    save_file(state_dict, str(path / "model.safetensors"))
    vocab = {"<unk>": 0, "hello": 1, "world": 2, "user": 3, ":": 4, "<s>": 256}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": "<s>", "add_bos_token": True})
    )
    return state_dict


def test_hf_directory_loads_weights_config_and_tokenizer(tmp_path):
    write_hf_dir(tmp_path, "qwen3")
    loaded = load_model(str(tmp_path), dtype="float32")
    reference = build_tiny_model("qwen3", seed=4)
    assert loaded.config.eos_token_ids == (257, 258)
    assert loaded.tokenizer.encode("hello world") == [256, 1, 2]
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat == [3, 4, 1]
    request = new_request("a", 12, SamplingParams(temperature=0), seed=1)
    request.block_ids = [0, 1, 2]
    got = ModelRunner(loaded, 8, BLOCK_SIZE, "cpu").compute_logits([(request, 12)])[0]
    want = ModelRunner(reference, 8, BLOCK_SIZE, "cpu").compute_logits([(request, 12)])[0]
    torch.testing.assert_close(got, want)
    bf16 = load_model(str(tmp_path), dtype="bfloat16")
    assert bf16.decoder.embed_tokens.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, [256, 1, 2]),  # no add_bos_token: tokenizer.json's post-processor adds BOS
        ({"add_bos_token": False}, [1, 2]),  # the config says no: it wins, as in transformers
        ({"add_bos_token": True}, [256, 1, 2]),
    ],
)
def test_plain_prompts_get_the_special_tokens_transformers_would_give(tmp_path, config, expected):
    """Llama 3's tokenizer_config.json has no add_bos_token; its tokenizer.json adds
    <|begin_of_text|> through a TemplateProcessing post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from engine.model.tokenizer import load_hf_tokenizer

    vocab = {"<unk>": 0, "hello": 1, "world": 2, "<s>": 256}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 256)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", **config}))
    assert load_hf_tokenizer(tmp_path).encode("hello world") == expected


def cpu_packs_bf16_weights() -> bool:
    """oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere it raises."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16), 32)
    except RuntimeError:
        return False
    return True


def test_prepared_bf16_weights_match_plain_linear(monkeypatch, onednn_linears):
    """bfloat16 weights are packed for oneDNN on CPUs that can, widened to float32 on the
    others; either way the logits must not change."""
    packed = build_tiny_model("llama", seed=5, dtype="bfloat16")
    qkv_proj = packed.decoder.layers[0].qkv_proj
    assert qkv_proj.weight is None
    if cpu_packs_bf16_weights():
        assert qkv_proj.packed is not None and qkv_proj.widened is None
    else:
        assert qkv_proj.packed is None and qkv_proj.widened.dtype == torch.float32
    monkeypatch.setenv("ITERSCOPE_PACK_WEIGHTS", "0")
    plain = build_tiny_model("llama", seed=5, dtype="bfloat16")
    assert plain.decoder.layers[0].qkv_proj.weight is not None
    request = new_request("a", 12, SamplingParams(temperature=0), seed=2)
    request.block_ids = [0, 1, 2]
    step = [(request, 12)]
    got = ModelRunner(packed, 8, BLOCK_SIZE, "cpu").compute_logits(step)[0]
    want = ModelRunner(plain, 8, BLOCK_SIZE, "cpu").compute_logits(step)[0]
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)


def test_packed_float32_linear_is_f_linear_up_to_the_order_of_sums(monkeypatch, onednn_linears):
    from engine.model import linear

    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(1536, 576, generator=generator) * 0.05
    bias = torch.randn(1536, generator=generator)
    layer = linear.Linear(weight, bias)
    assert layer.weight is None and layer.packed is not None
    for num_rows in (1, 16, 48, 300):
        x = torch.randn(num_rows, 576, generator=generator)
        want = (x.double() @ weight.double().T + bias.double()).float()
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("ITERSCOPE_PACK_WEIGHTS", "0")
    assert linear.Linear(weight, bias).packed is None


def test_widened_bf16_linear_is_a_bf16_matmul(monkeypatch, onednn_linears):
    """Where oneDNN cannot pack bf16 (AVX2 CPUs), the weight is widened to float32: the same
    products and float32 sums as a bf16 GEMM, so the result is the float64 product of the
    bf16 values rounded once to bf16 (give or take one rounding step)."""
    from engine.model import linear

    def refuse(weight):
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(linear, "pack_weight", refuse)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=generator).bfloat16()
    bias = torch.randn(48, generator=generator).bfloat16()
    x = torch.randn(5, 64, generator=generator).bfloat16()
    layer = linear.Linear(weight, bias)
    assert layer.weight is None and layer.packed is None
    assert layer.widened.dtype == torch.float32 and layer.bias.dtype == torch.float32
    got = layer(x)
    want = (x.double() @ weight.double().T + bias.double()).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)


def test_gguf_rope_scaling_is_honoured_or_refused():
    from engine.model.gguf_file import _hf_name, gguf_rope_scaling

    assert gguf_rope_scaling({}, "llama") is None
    assert gguf_rope_scaling({"llama.rope.scaling.type": "none"}, "llama") is None
    linear = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert gguf_rope_scaling(linear, "llama") == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):
        gguf_rope_scaling({"llama.rope.scaling.type": "yarn"}, "llama")
    with pytest.raises(ValueError, match="rope_freqs"):
        _hf_name("rope_freqs.weight")


def test_gguf_of_another_architecture_is_refused_clearly():
    from types import SimpleNamespace

    from engine.model.gguf_file import gguf_hf_config

    reader = SimpleNamespace(fields={"general.architecture": "gemma"})  # a parsed GGUFFile
    with pytest.raises(ValueError, match="GGUF architecture 'gemma' is not supported"):
        gguf_hf_config(reader)
