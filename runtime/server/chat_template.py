"""engine-serve --chat-template FILE: a Jinja chat template that replaces the artifact's.

For checkpoints shipped without a template (base models) or with one that does not suit the
deployment. It is checked when the server starts, so a typo stops engine-serve with the line
at fault instead of failing every chat request.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def read_chat_template(path: Path) -> str:
    """The template in ``path``; ValueError (saying where) when it is not valid Jinja."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the chat template {path}: {exc}") from None
    if not text.strip():
        raise ValueError(f"the chat template {path} is empty")
    # transformers renders templates in a sandbox with loop controls; parse the same way.
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template {path} is not valid Jinja (line {exc.lineno}: {exc.message})") from None
    return text


def use_chat_template(engines: Mapping[str, Any], template: str) -> None:
    """Make ``template`` the chat template of every served model (what /v1/chat/completions
    and /tokenize with messages render with)."""
    for name, engine in engines.items():
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"model `{name}` has no tokenizer, so a chat template cannot apply to it")
        tokenizer.chat_template = template
