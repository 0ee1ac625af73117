"""Lazy CUDA graphs are the default where start-up is what a user waits for (engine-serve,
AsyncEngine: the engine-core process's options) and off for LLM, unless asked."""

from pagecast.runtime.core_process import core_options
from pagecast.runtime.engine_core import EngineOptions


def test_online_engines_capture_graphs_lazily_by_default() -> None:
    assert core_options({}).lazy_graphs_on
    assert not core_options({"lazy_graphs": False}).lazy_graphs_on


def test_offline_engines_capture_graphs_at_start_by_default() -> None:
    assert not EngineOptions().lazy_graphs_on
    assert EngineOptions(lazy_graphs=True).lazy_graphs_on
