"""benchmarks/gpu_queue.py, the runner of the GPU measurements still owed, on the CPU with stand-in
steps: each step's log and JSON line, a failing step does not stop the queue, a hanging one costs
its timeout only, a step whose timeout does not fit the budget left is skipped with the --from that
resumes it, and every step of the real queue names a file that exists."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import gpu_queue  # noqa: E402


def _fake(out: Path) -> list[gpu_queue.Step]:
    py = sys.executable
    return [
        gpu_queue.Step("ok", [py, "-c", "print('measured')"], 30, "a step that works"),
        gpu_queue.Step("fails", [py, "-c", "raise SystemExit(3)"], 30, "a step that fails"),
        gpu_queue.Step("hangs", [py, "-c", "import time; time.sleep(60)"], 2, "a step that hangs"),
        gpu_queue.Step("too_long", [py, "-c", "print('never')"], 10_000, "a step the budget cannot hold"),
        gpu_queue.Step("after", [py, "-c", "print('never')"], 1, "after the skipped one"),
    ]


def test_the_queue_runs_steps_under_their_timeouts_and_stops_where_the_budget_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_queue, "steps", _fake)
    monkeypatch.setattr(sys, "argv", ["gpu_queue.py", "--out", str(tmp_path), "--budget", "120"])
    gpu_queue.main()
    rows = [json.loads(line) for line in (tmp_path / "queue.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ["ok", "fails", "hangs", "too_long"]
    assert (rows[0]["rc"], rows[1]["rc"], rows[2]["rc"]) == (0, 3, None)
    assert rows[2]["timed_out"] and rows[2]["seconds"] < 30
    assert "--from too_long" in rows[3]["skipped"]
    assert (tmp_path / "ok.log").read_text().strip() == "measured"
    monkeypatch.setattr(sys, "argv", ["gpu_queue.py", "--out", str(tmp_path), "--from", "nope"])
    with pytest.raises(SystemExit, match="no step 'nope'"):
        gpu_queue.main()


def test_every_step_of_the_real_queue_names_files_that_exist(tmp_path: Path) -> None:
    root = Path(__file__).parents[1]
    for step in gpu_queue.steps(tmp_path):
        files = [a for a in step.command if a.endswith(".py")]
        assert files, step.name
        for f in files:
            assert (root / f).is_file() or Path(f).is_file(), (step.name, f)


def test_fit_starts_a_step_whose_share_fits_and_cuts_it_to_what_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    py = sys.executable
    queue = [gpu_queue.Step("long", [py, "-c", "import time; time.sleep(60)"], 20, "longer than the budget")]
    monkeypatch.setattr(gpu_queue, "steps", lambda out: queue)
    monkeypatch.setattr(sys, "argv", ["gpu_queue.py", "--out", str(tmp_path), "--budget", "3", "--fit", "0.1"])
    gpu_queue.main()
    (row,) = [json.loads(line) for line in (tmp_path / "queue.jsonl").read_text().splitlines()]
    assert row["timed_out"] and row["seconds"] < 10


def test_the_queue_ends_by_bundling_its_folders_so_tuning_tables_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    art = tmp_path / "model-bf16"
    (art / "triton_cache" / "ABC").mkdir(parents=True)
    (art / "triton_cache" / "ABC" / "k.cubin").write_bytes(b"x" * 10)
    (art / "report.md").write_text("# report")
    (art / "tuning.json").write_text('{"kernels": {}}')
    monkeypatch.setattr(gpu_queue, "KEEP_BYTES", 50)
    (art / "weights.bin").write_bytes(b"x" * 100)
    py = sys.executable
    monkeypatch.setattr(gpu_queue, "steps", lambda out: [gpu_queue.Step("ok", [py, "-c", "print(1)"], 30, "")])
    monkeypatch.setattr(sys, "argv", ["gpu_queue.py", "--out", str(tmp_path), "--budget", "60"])
    gpu_queue.main()
    # what comes back: the log, queue.jsonl and one bundle, whatever the folders held
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle.tar.gz", "ok.log", "queue.jsonl"]
    with tarfile.open(tmp_path / "bundle.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["model-bf16/report.md", "model-bf16/tuning.json"]
        assert tar.extractfile("model-bf16/report.md").read() == b"# report"  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (tmp_path / "queue.jsonl").read_text().splitlines()]
    assert rows[-1]["left_out"] == ["model-bf16/triton_cache/ABC/k.cubin", "model-bf16/weights.bin"]


def test_at_commit_runs_a_benchmark_against_the_other_trees_package(tmp_path: Path) -> None:
    """benchmarks/at_commit.py (the queue's baseline steps): the script runs in the tree, importing
    the tree's pagecast, with its arguments, and its exit status comes back; a tree that lacks the
    package is refused with what to do."""
    import subprocess

    tree = tmp_path / "tree"
    for d in ("builder", "kernels", "runtime", "templates", "benchmarks"):
        (tree / d).mkdir(parents=True)
    (tree / "kernels" / "__init__.py").write_text("KERNEL_ABI = 99\n")
    (tree / "benchmarks" / "probe.py").write_text(
        "import os, sys\nimport pagecast.kernels as k\nprint(k.KERNEL_ABI, os.getcwd(), sys.argv[1:])\nsys.exit(7)\n"
    )
    script = Path(__file__).parents[1] / "benchmarks" / "at_commit.py"
    run = subprocess.run([sys.executable, str(script), "--tree", str(tree), "benchmarks/probe.py", "--out", "x"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert run.returncode == 7, run.stderr
    assert run.stdout.strip() == f"99 {tree.resolve()} ['--out', 'x']"
    (tree / "runtime").rmdir()
    run = subprocess.run([sys.executable, str(script), "--tree", str(tree), "benchmarks/probe.py"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert run.returncode != 0 and "lacks runtime" in run.stderr and "git archive" in run.stderr


def test_a_step_whose_artifact_an_earlier_step_builds_is_skipped_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps that serve another step's artifact are skipped, saying which, when that step did not
    run in this call (it builds under OUT, bundled and deleted at the end); the queue goes on."""
    py = sys.executable
    art = tmp_path / "out" / "a" / "engine"

    def fake(out: Path) -> list[gpu_queue.Step]:
        build = f"import pathlib; pathlib.Path({str(art)!r}).mkdir(parents=True)"
        return [
            gpu_queue.Step("build", [py, "-c", build], 30, "builds the artifact"),
            gpu_queue.Step("serve", [py, "-c", "print('served')", "--artifact", str(art)], 30, "serves it"),
            gpu_queue.Step("after", [py, "-c", "print('after')"], 30, "a step after it"),
        ]

    monkeypatch.setattr(gpu_queue, "steps", fake)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["gpu_queue.py", "--out", str(out), "--only", "serve,after"])
    gpu_queue.main()
    rows = [json.loads(line) for line in (out / "queue.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ["serve", "after"]
    assert str(art) in rows[0]["skipped"] and rows[1]["rc"] == 0
    (out / "queue.jsonl").unlink()
    monkeypatch.setattr(sys, "argv", ["gpu_queue.py", "--out", str(out)])
    gpu_queue.main()
    rows = [json.loads(line) for line in (out / "queue.jsonl").read_text().splitlines()]
    assert [r.get("rc") for r in rows if "step" in r] == [0, 0, 0]
    assert (out / "serve.log").read_text().strip() == "served"
