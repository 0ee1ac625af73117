"""enginebuild's progress: which pass runs now, what it does, and how long it has taken.

On a terminal a spinner with the elapsed time stays on screen while a pass runs (load and
trace take 15-25 s on an 8B model with no other sign of life); elsewhere (CI logs, pipes) a
line is printed when each pass starts. Either way a line with the pass's time follows it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

# What each pass is doing, in the words a user waiting on it needs (short: one terminal line).
DESCRIPTIONS = {
    "load": "reading the checkpoint (a GGUF once)",
    "trace": "torch.export of the model, on meta",
    "lower": "matching the decoder pattern",
    "plan": "dtype, weight layout, KV memory",
    "tune": "kernel configs for the target",
    "render": "writing model.py",
    "pack": "writing the weights",
    "speculative": "the drafter (--speculative-config)",
    "emit": "hashing files, writing the manifest",
}


class PassProgress:
    """``with progress.running(i, n, name): ...`` around each pass."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)

    @contextlib.contextmanager
    def running(self, index: int, total: int, name: str) -> Iterator[None]:
        label = f"[{index}/{total}] {name}: {DESCRIPTIONS.get(name, name)}"
        if not self.console.is_terminal:
            self.console.print(label, highlight=False, markup=False)
            yield
            return
        columns = (SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True) as progress:
            progress.add_task(label, total=None)
            yield
