"""Benchmarks built through benchmarks/variant_runs.py say when the tuning budget left buckets
untuned (every Qwen3-30B-A3B W4 before 2026-12-03 measured untuned experts without saying so)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import variant_runs


def test_cut_off_buckets_are_counted_and_recorded(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    table = {"kernels": {
        "fused_moe": {"t1": {"budget_spent": True}, "t2": {"budget_spent": True}, "t4": {"tuned": True}},
        "rms_norm": {"t8": {"tuned": True}},
    }}  # fmt: skip
    (tmp_path / "tuning.json").write_text(json.dumps(table))
    assert variant_runs.cut_off_buckets(tmp_path) == {"fused_moe": 2}
    assert variant_runs.cut_off_buckets(tmp_path / "no-artifact") == {}
    rows: list[dict] = []  # type: ignore[type-arg]
    variant_runs.record_cut_off(tmp_path, "moe", lambda **row: rows.append(row))  # type: ignore[arg-type]
    assert rows == [{"variant": "moe", "figure": "tuning_cut_off", "value": 2, "buckets": {"fused_moe": 2}}]
    assert "cut off 2 buckets" in capsys.readouterr().out
