"""The artifact's tokenizer loads without AutoTokenizer when its config names the tokenizers-library
class (a faster start for the server), and is then the tokenizer AutoTokenizer gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


def test_direct_load_is_what_autotokenizer_gives(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from pagecast.runtime.loader import load_artifact_tokenizer
    from tiny_models import tokenizer_dir

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir() / name).is_file():
            shutil.copy(tokenizer_dir() / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        pytest.skip(f"this tokenizer's class is {config.get('tokenizer_class')}")
    ours = load_artifact_tokenizer(tmp_path)
    auto = AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    text = "Héllo <|im_start|>wörld\n\n  1234 🙂 tokens"
    assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    assert ours.encode(text) == auto.encode(text)
    ids = auto.encode(text)
    assert ours.decode(ids) == auto.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (
        auto.bos_token, auto.eos_token, auto.unk_token, auto.pad_token)  # fmt: skip
    assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
