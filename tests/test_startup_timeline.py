"""The start-up timeline: both processes stamp their phases on engine-serve's clock, and
benchmarks/online.py reads the lines back from the log."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time

import pytest

from pagecast.runtime import startup

# A child as the engine-core process is one: started by the server, which exported its origin.
CHILD = """
import logging, sys
from pagecast.runtime import startup
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
startup.begin("core").mark("spawn")
"""


def test_the_core_stamps_on_the_servers_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(startup.START_ENV, raising=False)
    monkeypatch.setattr(startup, "_timeline", None)  # this process's timeline, put back afterwards
    own_start = startup.process_start_epoch()
    assert own_start is not None and own_start <= time.time()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("pagecast.startup")
    # setLevel, not an assignment: it clears the logger's isEnabledFor cache, which an earlier test
    # in this process may have filled at the default level. dictConfig (uvicorn's) may also have
    # disabled the loggers that existed then.
    monkeypatch.setattr(log, "disabled", False)
    old_level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        # A server whose process started 5 s ago: its stamps say so, and its children inherit it.
        server = startup.begin("server", origin=time.time() - 5.0)
        startup.mark("imports")
        assert os.environ[startup.START_ENV] == repr(server.origin)
        child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
        startup.mark("listening")
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    assert child.returncode == 0, child.stderr
    lines = startup.parse_log(stream.getvalue() + child.stderr)
    assert [(process, phase) for process, phase, _ in lines] == [
        ("server", "imports"), ("server", "listening"), ("core", "spawn")
    ]
    at = {phase: seconds for _, phase, seconds in lines}
    # The child's stamp is on the server's clock (5 s and more), not on its own (a second or so).
    assert 5.0 <= at["imports"] <= at["spawn"] <= at["listening"] < 5.0 + 120


def test_without_a_server_a_process_stamps_from_its_own_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(startup.START_ENV, raising=False)
    timeline = startup.Timeline("core")
    own_start = startup.process_start_epoch()
    assert own_start is not None and abs(timeline.origin - own_start) < 0.05  # /proc/uptime: 10 ms steps
    assert 0.0 < timeline.mark("import") < time.time() - own_start + 1.0


def test_a_process_start_is_read_to_the_clock_tick() -> None:
    """A child's start, read from /proc, is within a few clock ticks of the moment it was spawned
    (read through /proc/stat's whole-second boot time it was up to a second late: every stamp of
    the timeline then was)."""
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    after = time.time()
    try:
        start = startup.process_start_epoch(child.pid)
    finally:
        child.kill()
        child.wait()
    assert start is not None
    assert before - 0.05 <= start <= after + 0.05, (before, start, after)


def test_a_package_without_cached_bytecode_is_named_with_what_to_do(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """Where a module's bytecode is not cached (PYTHONDONTWRITEBYTECODE, or an install made with
    --no-compile), every start compiles its source again: the core warns, naming the fix. Once
    the bytecode exists (here written by py_compile, where Python would look for it), nothing."""
    import importlib.util
    import py_compile
    import types

    source = tmp_path / "pkg" / "__init__.py"
    source.parent.mkdir()
    source.write_text("x = 1\n")
    module = types.ModuleType("pkg")
    module.__file__ = str(source)
    cached = importlib.util.cache_from_source(str(source))
    assert startup.bytecode_missing(module) == cached
    with caplog.at_level(logging.WARNING, logger="pagecast.startup"):
        startup.warn_if_uncached(module)
    assert "pkg's bytecode is not cached" in caplog.text and "compileall" in caplog.text
    py_compile.compile(str(source), cfile=cached)
    caplog.clear()
    assert startup.bytecode_missing(module) is None
    startup.warn_if_uncached(module)
    assert caplog.text == ""
    assert startup.bytecode_missing(types.ModuleType("builtin_like")) is None  # no file: nothing to say
