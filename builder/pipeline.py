"""The builder: a list of passes, run in order over the BuildState.

    load -> trace -> lower -> plan -> tune -> render -> pack -> speculative -> emit

Each pass is one module with a ``run(state) -> state``. ``dump_ir`` writes the IR after each
pass, for debugging a build.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from pagecast.builder import emit, load, lower, pack, plan, render, speculative, trace, tune
from pagecast.builder.ir import BuildOptions, BuildState
from pagecast.runtime.errors import BuildError

PASSES: list[tuple[str, Callable[[BuildState], BuildState]]] = [
    ("load", load.run),
    ("trace", trace.run),
    ("lower", lower.run),
    ("plan", plan.run),
    ("tune", tune.run),
    ("render", render.run),
    ("pack", pack.run),
    ("speculative", speculative.run),  # a no-op without --speculative-config
    ("emit", emit.run),
]


def default_output(options: BuildOptions) -> Path:
    name = Path(options.model.rstrip("/")).name
    name = name.removesuffix(".gguf")
    return Path("artifacts") / name


def build(
    options: BuildOptions,
    dump_ir: Path | None = None,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int, str], AbstractContextManager[object]] | None = None,
) -> Path:
    """Build an artifact; returns its directory. Raises BuildError with an actionable message.

    ``log`` gets one line per finished pass (its time); ``progress(index, total, name)`` is
    entered around each pass, to show what runs now (builder/progress.py)."""
    output = (options.output or default_output(options)).resolve()
    if output.exists() and not options.force:
        raise BuildError(f"{output} already exists; pass --force to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    state = BuildState(options=options, staging_dir=staging, output_dir=output)
    try:
        for index, (name, run) in enumerate(PASSES, start=1):
            start = time.perf_counter()
            with progress(index, len(PASSES), name) if progress is not None else contextlib.nullcontext():
                state = run(state)
            if log is not None:
                log(f"{name:<11} {time.perf_counter() - start:6.2f} s")
            if dump_ir is not None:
                dump_ir.mkdir(parents=True, exist_ok=True)
                (dump_ir / f"{len(list(dump_ir.iterdir())):02d}-{name}.json").write_text(
                    json.dumps(state.describe(), indent=2, default=str)
                )
    except BuildError:
        raise
    except (OSError, ValueError) as e:
        raise BuildError(str(e)) from e
    finally:
        if state.staging_dir is not None:
            shutil.rmtree(state.staging_dir, ignore_errors=True)
        if state.checkpoint is not None:
            state.checkpoint.close()
    return output
