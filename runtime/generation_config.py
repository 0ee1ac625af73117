"""Default sampling from the checkpoint's ``generation_config.json``, as its authors meant it.

A model's authors often ship recommended sampling settings (Llama 3 Instruct: temperature 0.6,
top_p 0.9; Qwen2.5: a repetition penalty). enginebuild copies the sampling keys into the
artifact's ``generation_config.json`` under pagecast's names; ``LLM`` and ``engine-serve``
use them for every field a request leaves unset, as vLLM does. A request that sets a field
always wins.

    {"sampling_defaults": {"temperature": 0.6, "top_p": 0.9}, "ignored": {}}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from pagecast.runtime.sampling_params import SamplingParams

FILENAME = "generation_config.json"


# Hugging Face generation-config key -> SamplingParams field. Only keys that change which
# tokens are sampled or how many: the stop tokens are in the manifest already.
HF_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What enginebuild records: the sampling keys of a Hugging Face generation config,
    renamed to SamplingParams fields. A value SamplingParams refuses is set aside under
    ``ignored`` (with the reason) instead of failing the build or every request later."""
    defaults: dict[str, Any] = {}
    ignored: dict[str, str] = {}
    for hf_key, name in HF_SAMPLING_KEYS.items():
        value = raw.get(hf_key)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as exc:
            ignored[hf_key] = f"{value!r}: {exc}"
            continue
        defaults[name] = value
    return {"sampling_defaults": defaults, "ignored": ignored}


def load_defaults(artifact_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The artifact's default sampling fields; empty for artifacts built before they were
    recorded, or for checkpoints that ship none."""
    path = Path(artifact_dir) / FILENAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    known = {f.name for f in fields(SamplingParams)}
    return {k: v for k, v in (data.get("sampling_defaults") or {}).items() if k in known}


def default_sampling_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams with the artifact's defaults where it has them, pagecast's elsewhere."""
    return SamplingParams(**defaults)


def engine_defaults(engine: Any) -> dict[str, Any]:
    """The defaults of the artifact ``engine`` serves: its ``generation_defaults``, read from
    the artifact once when the engine was made (LLMEngine, AsyncEngine); none for other objects."""
    return dict(getattr(engine, "generation_defaults", None) or {})


# Request fields (None when the client left them out) that a generation config may default.
REQUEST_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def for_request(params: SamplingParams, request: Any, engine: Any, prompt_lens: list[int]) -> SamplingParams:
    """The server's SamplingParams of ``request`` with the artifact's defaults for the sampling
    fields the client left out. ``max_tokens`` takes the default only where the endpoint's own
    default is "up to the context" (chat without max_tokens), capped at the room the longest
    prompt leaves; /v1/completions keeps OpenAI's default of 16."""
    defaults = engine_defaults(engine)
    if not defaults:
        return params
    unset = {name for name in REQUEST_SAMPLING_FIELDS if getattr(request, name, None) is None}
    changes = {name: defaults[name] for name in unset if name in defaults}
    if params.max_tokens is None and "max_tokens" in defaults and prompt_lens:
        room = int(engine.max_model_len) - max(prompt_lens)
        changes["max_tokens"] = max(1, min(int(defaults["max_tokens"]), room))
    return replace(params, **changes) if changes else params
