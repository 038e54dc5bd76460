"""Tokenizers: from an HF directory (tokenizer.json), from a GGUF vocabulary, or bytes (tests).

All three offer encode(text), decode(ids) and apply_chat_template(messages); the chat template
is the model's own Jinja template, rendered the way transformers does (generation prompt added),
then encoded without adding special tokens again.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from engine.model.chat_template import render_chat_template

# How llama.cpp names each vocabulary's pre-tokenizer -> the split regex its merges were learned
# with (None: GPT-2's own byte-level regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Stands in for a message's content while the template renders: private-use characters that
# no template or tokenizer gives a meaning to.
CONTENT_SENTINEL = "\ue000{}\ue001"
CONTENT_SENTINEL_PATTERN = re.compile("\ue000([0-9]+)\ue001")
GGUF_PRE_TOKENIZERS = {
    "default": None,
    "gpt2": None,
    "smollm": None,  # plus single digits, added below
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's chat template and special tokens."""

    def __init__(
        self,
        backend: Any,
        chat_template: str | None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = False,
    ) -> None:
        """``add_bos_token`` None: the tokenizer's own post-processor decides what special
        tokens a plain prompt gets, as transformers does when tokenizer_config.json does not
        say (Llama 3's tokenizer.json adds <|begin_of_text|> that way)."""
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.use_post_processor = add_bos_token is None
        self.add_bos_token = bool(add_bos_token) and self.bos_token_id is not None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if self.use_post_processor:
            return self._ids(text, add_special_tokens=True)
        ids = self._ids(text, add_special_tokens=False)
        return [self.bos_token_id, *ids] if self.add_bos_token else ids

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text``. encode_batch_fast lets go of the GIL while it works and
        skips the offsets nobody reads; ``encode`` holds the GIL throughout (12 s for 4 MB of
        text), which would stop every other thread of the frontend, its event loop included."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render the conversation with a generation prompt and encode it. The template's own
        special tokens are special; the same text inside a message is text, so a user cannot
        forge a turn by writing "<|im_start|>system"."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt")
        if any(self._holds_special_text(message["content"]) for message in messages):
            return self._ids_with_literal_contents(messages)
        return self._ids(self._render(messages), add_special_tokens=False)

    def _render(self, messages: list[dict[str, Any]]) -> str:
        return render_chat_template(
            self.chat_template, messages, bos_token=self.bos_token, eos_token=self.eos_token
        )

    def _holds_special_text(self, text: str) -> bool:
        return any(special in text for special in self._special_texts)

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        added = self.backend.get_added_tokens_decoder().values()
        return tuple(token.content for token in added if token.special)

    @functools.cached_property
    def _literal_backend(self) -> Any:
        """A copy of the backend that reads special tokens' text as plain text."""
        literal = type(self.backend).from_str(self.backend.to_str())
        literal.encode_special_tokens = True
        return literal

    def _ids_with_literal_contents(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render with a sentinel in place of each message's content; the template's pieces
        are encoded as usual, each content with the literal backend. (Only conversations
        holding special tokens' text come here, so every other one is encoded exactly as the
        model's own tokenizer does.)"""
        masked = [
            {**message, "content": CONTENT_SENTINEL.format(index)}
            for index, message in enumerate(messages)
        ]
        ids: list[int] = []
        pieces = CONTENT_SENTINEL_PATTERN.split(self._render(masked))
        for position, piece in enumerate(pieces):  # template, index, template, index, ...
            if position % 2:
                content = messages[int(piece)]["content"]
                ids += self._literal_backend.encode_batch_fast([content], add_special_tokens=False)[
                    0
                ].ids
            elif piece:
                ids += self._ids(piece, add_special_tokens=False)
        return ids


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or {'content': ...} dicts."""
    return value.get("content") if isinstance(value, dict) else value


def load_hf_tokenizer(model_dir: str | Path) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of an HF model directory."""
    from tokenizers import Tokenizer as Backend

    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json (only fast tokenizers work)")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_path = model_dir / "chat_template.jinja"
    if template is None and jinja_path.exists():
        template = jinja_path.read_text()
    return Tokenizer(
        Backend.from_file(str(path)),
        template,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        add_bos_token=config.get("add_bos_token"),  # None: tokenizer.json's post-processor
    )


def build_gguf_tokenizer(fields: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE tokenizer from a GGUF vocabulary (tokenizer.ggml.model == 'gpt2')."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    if fields["model"] != "gpt2":
        raise ValueError(
            f"GGUF tokenizer type {fields['model']!r} is not supported (byte-level BPE 'gpt2')"
        )
    pre = fields["pre"] or "default"
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported: {list(GGUF_PRE_TOKENIZERS)}"
        )
    tokens = fields["tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in fields["merges"]]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = GGUF_PRE_TOKENIZERS[pre]
    steps = []
    if pre == "smollm":
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, fields["token_type"], strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    )
    backend.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == _USER_DEFINED])
    bos_id, eos_id = fields["bos_token_id"], fields["eos_token_id"]
    return Tokenizer(
        backend,
        fields["chat_template"],
        bos_token=None if bos_id is None else tokens[bos_id],
        eos_token=None if eos_id is None else tokens[eos_id],
        add_bos_token=fields["add_bos_token"],
    )


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (for tiny random-weight models in tests).

    Ids >= 256 (special or unused) decode to nothing. The chat template is `role: content` lines.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.vocab_size = vocab_size
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        lines = [f"{m['role']}: {m['content']}\n" for m in messages]
        return self.encode("".join(lines) + "assistant: ")
