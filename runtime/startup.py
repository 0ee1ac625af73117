"""The start-up timeline: one log line per phase of engine-serve's start, in both processes, on
one clock.

Every stamp is wall-clock seconds since engine-serve's own process started (read from the
kernel, so the interpreter's start is counted too), also in the engine-core process, which
learns that instant from the environment (``PAGECAST_START_EPOCH``, set by the server and
inherited by the processes it starts). A line reads

    start-up core: weights at 4.12 s (+1.30 s)

the phase that ended, when, and how long since the process's previous stamp.
``benchmarks/online.py --phases start`` reads these lines back (``parse_log``) to print the
timeline of each start.

Stamps are cheap (a clock read and a log line) and never raise: a timeline is for people,
never a reason for a start to fail.
"""

from __future__ import annotations

import logging
import os
import re
import time

logger = logging.getLogger("pagecast.startup")

START_ENV = "PAGECAST_START_EPOCH"
LINE = re.compile(r"start-up (?P<process>[\w-]+): (?P<phase>.+?) at (?P<at>[\d.]+) s")


def process_start_epoch(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, as ``time.time()`` would have read then;
    None where /proc cannot say (not Linux). Resolution: the kernel's clock tick (10 ms).

    The start is read in ticks since boot and placed on the wall clock through the uptime read
    now (/proc/uptime, to 10 ms), not through /proc/stat's ``btime``: that is whole seconds, and
    would put every stamp up to a second late (0.4 s on the development machine)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            # Field 22 (starttime, in ticks since boot) comes after the command name, which is in
            # parentheses and may itself contain spaces and parentheses.
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])
        now = time.time()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return now - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    """The phases of one process's start: ``mark(phase)`` when a phase ends."""

    def __init__(self, process: str, origin: float | None = None):
        self.process = process
        # engine-serve's start when this process inherited it, else this process's own.
        if origin is None:
            inherited = os.environ.get(START_ENV)
            origin = float(inherited) if inherited else process_start_epoch()
        self.origin = origin if origin is not None else time.time()
        self.stamps: dict[str, float] = {}
        self._last = self.origin

    def mark(self, phase: str) -> float:
        """Stamp the end of ``phase`` now and log it; returns the seconds since the origin."""
        now = time.time()
        at = now - self.origin
        self.stamps[phase] = round(at, 3)
        logger.info("start-up %s: %s at %.2f s (+%.2f s)", self.process, phase, at, now - self._last)
        self._last = now
        return at


_timeline: Timeline | None = None


def begin(process: str, origin: float | None = None) -> Timeline:
    """Make this process's timeline (the server: also the origin its children inherit)."""
    global _timeline
    _timeline = Timeline(process, origin)
    if process == "server":
        os.environ[START_ENV] = repr(_timeline.origin)
    return _timeline


def mark(phase: str) -> None:
    """Stamp ``phase`` on this process's timeline, when it has one (engine-serve and its core;
    ``LLM`` in a script has none, and stamps nothing)."""
    if _timeline is not None:
        _timeline.mark(phase)


def bytecode_missing(module: object) -> str | None:
    """The bytecode file ``module`` would load from, where it does not exist (else None): where
    a package's bytecode is not cached (PYTHONDONTWRITEBYTECODE, or a read-only install made with
    pip's --no-compile), every process compiles its Python source again. For torch that is 2-4 s
    of every start (measured on the H200 machine, 2026-12-03), the largest phase of the core's."""
    import importlib.util

    source = getattr(module, "__file__", None)
    if not source or not source.endswith(".py"):
        return None
    cached = importlib.util.cache_from_source(source)  # honours PYTHONPYCACHEPREFIX and -O
    return None if os.path.exists(cached) else cached


def warn_if_uncached(module: object) -> None:
    """A warning with what to do, where ``module``'s bytecode is missing (see bytecode_missing)."""
    missing = bytecode_missing(module)
    if missing is not None:
        name = getattr(module, "__name__", "?")
        logger.warning(
            "%s's bytecode is not cached (no %s): every start compiles its source again, seconds of the "
            "start-up; run `python -m compileall -q %s` once where it is installed, or unset "
            "PYTHONDONTWRITEBYTECODE (or set PYTHONPYCACHEPREFIX to a writable directory)",
            name, missing, os.path.dirname(getattr(module, "__file__", "")),
        )  # fmt: skip


def parse_log(text: str) -> list[tuple[str, str, float]]:
    """(process, phase, seconds since engine-serve's start) of every start-up line in ``text``,
    in log order."""
    return [(m["process"], m["phase"], float(m["at"])) for m in LINE.finditer(text)]
