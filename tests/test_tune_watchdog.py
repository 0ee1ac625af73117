"""The build's tuning subprocess under a watchdog (builder/tune.py run_watched): the tuner reports
each bucket and config on stderr as it goes, and a tuner that falls silent (a launch that never
returns: no budget ends it) is stopped with a message naming where it was, instead of hanging the
build for ever. The tuner itself runs only on a GPU; here stand-in processes."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from pagecast.builder import tune as tune_pass
from pagecast.kernels import tuning
from pagecast.runtime.errors import BuildError

ENV = dict(os.environ)


def script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def test_a_process_that_reports_as_it_goes_runs_to_its_end_and_its_outputs_come_back() -> None:
    rc, out, err = tune_pass.run_watched(
        script(
            """
            import sys, time
            for i in range(4):
                print(f"bucket {i}", file=sys.stderr, flush=True)
                time.sleep(0.6)
            print('{"table": 1}')
            """
        ),
        ENV, stall_s=1.5, what="kernel tuning",
    )  # fmt: skip
    assert rc == 0 and out.strip() == '{"table": 1}'
    assert err.splitlines() == [f"bucket {i}" for i in range(4)]  # 2.4 s in all, never 1.5 s silent


def test_a_silent_process_is_stopped_and_the_error_names_the_last_thing_it_reported() -> None:
    t0 = time.monotonic()
    with pytest.raises(BuildError, match=r"no progress for 2 s") as caught:
        tune_pass.run_watched(
            script(
                """
                import sys, time
                print("fused_moe t256: 12 configs", file=sys.stderr, flush=True)
                print("fused_moe t256 {'BLOCK_M': 128, 'WS': 1}", file=sys.stderr, flush=True)
                time.sleep(120)
                """
            ),
            ENV, stall_s=2.0, what="kernel tuning",
        )  # fmt: skip
    assert time.monotonic() - t0 < 30
    assert "fused_moe t256 {'BLOCK_M': 128, 'WS': 1}" in str(caught.value)


def test_a_failing_process_gives_its_exit_code_and_stderr() -> None:
    rc, _, err = tune_pass.run_watched(script("import sys; sys.exit('no GPU')"), ENV, stall_s=5, what="x")
    assert rc == 1 and "no GPU" in err


def test_the_tuner_reports_every_bucket_and_config_before_it_launches_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat the watchdog reads: a bucket's line before its configs are compiled, and each
    config's line before its first launch, so a hang is named to the config."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    import types

    from pagecast.kernels import problems

    problem = types.SimpleNamespace(launches_per_sample=lambda: 1, launch=lambda cfg, i: None, reference=None,
                                    marks={}, variants=None, apart=None)  # fmt: skip
    monkeypatch.setattr(problems, "make_problem", lambda *args, **kwargs: problem)
    monkeypatch.setattr(tuning, "time_launches", lambda launch, launches, reps: 10.0)
    logged: list[str] = []
    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16, "float32")
    table = tuning.tune(["silu_and_mul"], shapes, budget_s=1e9, device="cpu", log=logged.append)
    for bucket, entry in table["kernels"]["silu_and_mul"].items():
        begins = [i for i, line in enumerate(logged) if line.startswith(f"silu_and_mul {bucket}: ") and "configs" in line]
        config_lines = [i for i, line in enumerate(logged) if line.startswith(f"silu_and_mul {bucket} {{")]
        assert begins and config_lines and begins[0] < config_lines[0], logged
        assert f"silu_and_mul {bucket} {entry['config']}" in logged
