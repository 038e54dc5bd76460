"""Render an HF chat template (Jinja) the way transformers does, in a sandbox."""

from __future__ import annotations

import functools
from typing import Any


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    bos_token: str | None = None,
    eos_token: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """messages: [{'role': 'system' | 'user' | 'assistant', 'content': str}, ...] -> prompt text."""
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"each chat message needs 'role' and 'content', got {message!r}")
    return _compile(template).render(
        messages=messages,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
        add_generation_prompt=add_generation_prompt,
    )
