"""The EAGLE-3 draft head, converted for an artifact (``enginebuild --speculative-config
'{"method": "eagle3", "model": DIR}'``).

Reads a head in its published layout, checks it against the target's dims (runtime/eagle3_head.py
holds that knowledge, which the runtime also needs to load a raw head directory) and writes the
checked head as ``eagle3_head.safetensors`` + ``eagle3_head.json`` (the resolved config: the
auxiliary layers, rope and embedding sharing decided once, here). The weights keep their
checkpoint dtypes; the runtime casts them to the target's dtype on its device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagecast.runtime.eagle3_head import HEAD_CONFIG, HEAD_WEIGHTS, config_to_json, read_eagle3_head


def convert_eagle3_head(
    src_dir: str | Path, dst_dir: str | Path, target_dims: dict[str, Any]
) -> dict[str, Any]:
    """Convert the EAGLE-3 head in ``src_dir`` for a target of ``target_dims`` (the manifest's
    dims: hidden_size, vocab_size, num_layers) into ``dst_dir``; returns a summary for the build
    report. ValueError (naming the key and the mismatch) when the head does not fit the target."""
    from safetensors.torch import save_file

    head = read_eagle3_head(src_dir, target_dims)
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.weights.items()}, str(dst / HEAD_WEIGHTS))
    meta = config_to_json(head.config)
    meta["source"] = str(Path(src_dir).resolve())
    (dst / HEAD_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    cfg = head.config
    return {
        "method": "eagle3",
        "files": [HEAD_CONFIG, HEAD_WEIGHTS],
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "draft_vocab_size": cfg.draft_vocab_size,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "embedding": "own" if cfg.has_embedding else "shared with the target",
        "num_parameters": sum(t.numel() for k, t in head.weights.items() if k != "d2t"),
        "bytes": sum(t.numel() * t.element_size() for t in head.weights.values()),
    }
