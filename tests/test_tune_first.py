"""enginebuild --tune-first: the kernels a build tunes before the others, so a budget that runs
out cuts off the kernels its workload needs least (the tuner itself runs only on a GPU; here the
order it is handed, and the option's checks)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pagecast.builder import tune as tune_pass
from pagecast.builder.cli import main as enginebuild
from pagecast.builder.ir import BuildOptions
from pagecast.kernels import tuning


def test_kernel_order_puts_the_named_kernels_first_and_keeps_every_kernel_once() -> None:
    order = tune_pass.kernel_order(False, ("paged_prefill_attention", "fp8_gemm"))
    assert order[:2] == ("paged_prefill_attention", "fp8_gemm")
    assert sorted(order) == sorted(tuning.KERNELS)
    assert tune_pass.kernel_order(False) == tuning.KERNELS


def test_a_moe_model_tunes_its_experts_right_after_the_named_kernels() -> None:
    order = tune_pass.kernel_order(True, ("skinny_gemm",))
    assert order[0] == "skinny_gemm"
    assert order[1 : 1 + len(tuning.MOE_KERNELS)] == tuning.MOE_KERNELS
    assert sorted(order) == sorted(tuning.KERNELS + tuning.MOE_KERNELS)


def test_the_order_reaches_the_tuner(monkeypatch: pytest.MonkeyPatch) -> None:
    """_tune_main (the subprocess a GPU build runs) hands tuning.tune the kernels in that order."""
    handed: list[tuple[str, ...]] = []

    class Stop(Exception):
        pass

    def fake_tune(kernels, shapes, budget_s, device, pinned=None, log=None):
        handed.append(tuple(kernels))
        assert budget_s == 12.0
        raise Stop

    monkeypatch.setattr(tuning, "tune", fake_tune)
    shapes = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden": 64, "intermediate": 128, "block_size": 16}
    with pytest.raises(Stop):
        tune_pass._tune_main(json.dumps(shapes), "12", "paged_prefill_attention")
    assert handed[0][0] == "paged_prefill_attention"
    assert sorted(handed[0]) == sorted(tuning.KERNELS)


def test_build_options_read_the_command_lines_list_and_refuse_an_unknown_kernel() -> None:
    options = BuildOptions(model="m", tune_first="paged_prefill_attention, paged_decode_attention")  # type: ignore[arg-type]
    assert options.tune_first == ("paged_prefill_attention", "paged_decode_attention")
    with pytest.raises(ValueError, match="unknown kernel 'attention'.*paged_prefill_attention"):
        BuildOptions(model="m", tune_first=("attention",))


def test_enginebuild_says_which_kernel_it_does_not_know(tmp_path) -> None:
    result = CliRunner().invoke(enginebuild, ["--model", str(tmp_path), "--tune-first", "prefill"])
    assert result.exit_code == 2
    assert "--tune-first: unknown kernel 'prefill'" in result.output
