"""engine/model/hf_export.py: the embedded GGUF as an HF directory that this project's loader
and transformers (and so vLLM, in test_vllm_live.py) load into the same model and tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from engine.model.hf_export import _replace, export_hf_directory, main
from engine.model.loader import LoadedModel, load_model
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Explain how a bicycle works."}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return export_hf_directory("smollm2", tmp_path_factory.mktemp("export") / "smollm2-hf")


@pytest.fixture(scope="module")
def gguf(smollm2):
    """The embedded GGUF as our loader reads it, float32 (conftest.py: one copy per session)."""
    return smollm2


@pytest.fixture(scope="module")
def exported(hf_dir):
    return load_model(str(hf_dir), dtype="float32")


def last_logits(model: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    """Our engine's float32 logits at the prompt's last position (one prefill)."""
    runner = ModelRunner(model, num_blocks=4, block_size=16, device="cpu")
    request = Request("r", token_ids, SamplingParams(temperature=0, max_tokens=1))
    request.block_ids = [0]
    (logits,) = runner.compute_logits([(request, len(token_ids))])
    return logits[-1]


def assert_close_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bfloat16 storage of the dequantized weights: the same model, not the same bits."""
    assert int(actual.argmax()) == int(expected.argmax())
    assert torch.nn.functional.cosine_similarity(actual, expected, dim=0) > 0.999
    assert (actual - expected).abs().max() < 0.5  # logits here span about 40


@pytest.mark.live
def test_the_directory_holds_what_vllm_reads(hf_dir):
    names = {path.name for path in hf_dir.iterdir()}
    assert all(path.stat().st_mode & 0o777 == 0o644 for path in hf_dir.iterdir())  # any user
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert "quantization_config" not in json.loads((hf_dir / "config.json").read_text())
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in names and len(names) == 2 + 9 * 30
    special = json.loads((hf_dir / "special_tokens_map.json").read_text())
    assert special == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    }


@pytest.mark.live
def test_both_loaders_tokenize_like_the_gguf(hf_dir, gguf, exported):
    ours = exported.tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    expected = gguf.tokenizer.encode(PROMPT)
    assert ours.encode(PROMPT) == theirs(PROMPT)["input_ids"] == expected
    expected_chat = gguf.tokenizer.apply_chat_template(CHAT)
    assert ours.apply_chat_template(CHAT) == expected_chat
    assert theirs.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False) == (
        expected_chat
    )
    assert theirs.eos_token == "<|im_end|>"


@pytest.mark.live
def test_exported_weights_give_the_ggufs_logits(hf_dir, gguf, exported):
    ids = gguf.tokenizer.encode(PROMPT)
    expected = last_logits(gguf, ids)
    assert_close_logits(last_logits(exported, ids), expected)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert_close_logits(model(torch.tensor([ids])).logits[0, -1], expected)


@pytest.mark.live
def test_no_staging_directory_is_left_behind(hf_dir):
    assert [p.name for p in hf_dir.parent.iterdir()] == [hf_dir.name]


def test_an_earlier_export_is_replaced_whole(tmp_path):
    old, new = tmp_path / "model", tmp_path / ".staging"
    for path, name in ((old, "stale.bin"), (new, "config.json")):
        path.mkdir()
        (path / name).write_text("{}")
    _replace(new, old)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in old.iterdir()] == ["config.json"]


def test_bad_arguments_are_clear_errors(tmp_path, capsys):
    assert main(["no-such-model", str(tmp_path / "out")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert main(["smollm2", str(tmp_path / "mine")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
