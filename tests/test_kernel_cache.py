"""The artifact's Triton cache is hit at serve time: a kernel compiled while the artifact was
being built (in its staging directory, renamed afterwards) loads from the artifact without being
compiled again. Triton's group files record absolute member paths, so without relinking every
kernel compiled again at every start (5.5 s of an 8B engine's start on an H200)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

# A child process: the test session runs Triton in interpreter mode, which compiles nothing.
# It compiles one small kernel for sm_90 (no GPU needed) with TRITON_CACHE_DIR as given and
# prints how many kernels Triton compiled (cache misses), as the engine core counts them.
CHILD = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import keyed_noise
    from pagecast.kernels.reference import PHILOX_GROUP
    from pagecast.runtime.kernel_cache import TritonCompiles

    compiles = TritonCompiles()
    signature = {"out_ptr": "*fp32", "keys_ptr": "*i64", "offsets_ptr": "*i64", "stride_out": "i32",
                 "vocab": "i32", "GROUP": "constexpr"}
    src = ASTSource(keyed_noise._keyed_exponential_kernel, signature=signature, constexprs={"GROUP": PHILOX_GROUP})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print(compiles.count, compiles.names)
    """
)


def compiles_with_cache(cache: Path) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[0])


def test_kernel_compiled_in_staging_is_a_hit_after_the_rename(tmp_path: Path) -> None:
    from pagecast.runtime.kernel_cache import private_cache_copy

    staging = tmp_path / ".artifact.tmp-1234" / "triton_cache"
    assert compiles_with_cache(staging) == 1  # the build compiles it
    assert compiles_with_cache(staging) == 0  # and Triton hits its own cache where it wrote it
    artifact = tmp_path / "artifact"
    (tmp_path / ".artifact.tmp-1234").rename(artifact)  # the build's final rename

    # The artifact's cache as it is: the groups point into the vanished staging directory.
    groups = list((artifact / "triton_cache").rglob("__grp__*"))
    assert groups and all(
        str(staging) in path for g in groups for path in json.loads(g.read_text())["child_paths"].values()
    )
    private = private_cache_copy(artifact / "triton_cache")
    assert compiles_with_cache(private) == 0
    # The artifact itself is left exactly as built.
    assert all(str(staging) in g.read_text() for g in groups)


def test_relinking_ignores_files_that_are_not_groups(tmp_path: Path) -> None:
    from pagecast.runtime.kernel_cache import relink_groups

    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "__grp__k.json").write_text("not json")
    (tmp_path / "abc" / "__grp__j.json").write_text(json.dumps({"child_paths": {"j.cubin": "/gone/abc/j.cubin"}}))
    assert relink_groups(tmp_path) == 1
    assert json.loads((tmp_path / "abc" / "__grp__j.json").read_text()) == {
        "child_paths": {"j.cubin": str(tmp_path / "abc" / "j.cubin")}
    }


def test_the_build_runs_the_grammar_mask_kernel_at_every_specialisation(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """enginebuild runs xgrammar's mask kernel (apply_token_bitmask_inplace_kernel) through the
    sampler so that it lands in the artifact's Triton cache: every Triton specialisation a server
    can launch must be among those runs, or the first constrained requests compile it while
    serving. Here on the CPU, the sampler's calls are recorded, and each is specialised the way
    Triton would specialise the kernel's arguments for it."""
    pytest.importorskip("xgrammar")
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from pagecast.builder import tune
    from pagecast.runtime import structured_output

    calls = []
    monkeypatch.setattr(structured_output, "apply_bitmask", lambda logits, bitmask: calls.append((logits, bitmask)))
    tune.compile_grammar_mask_kernels("cpu")

    def spec(arg):  # type: ignore[no-untyped-def]
        return native_specialize_impl(BaseBackend, arg, False, True, True)

    keys = set()
    for logits, bitmask in calls:
        # The kernel's arguments as xgrammar's launcher passes them (no row indices; the bitmask
        # copied to the device, contiguous): pointers, rows, vocabulary, the two row strides.
        device_bitmask = bitmask.contiguous()
        vocab = min(logits.shape[-1], device_bitmask.shape[-1] * 32)
        args = (logits, device_bitmask, logits.shape[0], vocab, logits.stride(0), device_bitmask.stride(0))
        keys.add(tuple(spec(a) for a in args))
    # The sampler masks an fp32 copy whatever the logits' dtype: fp32 is what the kernel gets.
    assert {k[0][0] for k in keys} == {"*fp32"} and all(k[1] == ("*i32", "D") for k in keys)
    ints = {(k[2], k[3], k[4], k[5]) for k in keys}
    rows = [("constexpr", 1), ("i32", "D"), ("i32", "")]
    for num_rows in rows:
        for vocab in (("i32", "D"), ("i32", "")):
            for words in (("i32", "D"), ("i32", "")):
                assert (num_rows, vocab, vocab, words) in ints, (num_rows, vocab, words)


def test_engine_stats_and_metrics_count_kernels_compiled_once_it_is_ready(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    """A kernel compiled while serving (the artifact's cache and the warm-up missed it) shows in
    the engine's statistics and in /metrics as pagecast_kernel_compiles_total; a cache hit does
    not count. Triton reports each kernel to its compilation listener (the child above shows a
    real compile reaching TritonCompiles); here the engine's listener is called as Triton calls it,
    since this session's interpreter mode compiles nothing."""
    from triton import knobs

    from pagecast.runtime.engine import LLMEngine
    from pagecast.runtime.server.metrics import ServerMetrics

    engine = LLMEngine(tiny_llama_artifact)
    # the server's view of an engine (AsyncEngine): alive, and its core's statistics
    metrics = ServerMetrics({"tiny": SimpleNamespace(is_alive=lambda: True, stats=engine.stats)})
    line = 'pagecast_kernel_compiles_total{model_name="tiny"}'
    assert engine.stats().num_kernel_compiles == 0
    assert f"{line} 0.0" in metrics.exposition().decode()
    for hit in (False, True):
        knobs.compilation.listener(
            src=type("Src", (), {"name": "_late_kernel"})(), metadata=None, metadata_group=None, times=None,
            cache_hit=hit,
        )  # fmt: skip
    assert engine.stats().num_kernel_compiles == 1
    assert f"{line} 1.0" in metrics.exposition().decode()


def test_a_compile_names_the_arguments_its_variant_is_specialised_on() -> None:
    """What the start-up GPU test prints when a kernel compiles while serving: which arguments
    were aligned / divisible by 16 and the constexprs, by name (two variants of one kernel differ
    there and nowhere else)."""
    from triton.compiler import ASTSource

    from pagecast.kernels import keyed_noise
    from pagecast.runtime.kernel_cache import specialisation

    from triton.runtime.jit import JITFunction

    # The session runs Triton's interpreter, whose kernels wrap the plain function: rewrap it.
    kernel = JITFunction(getattr(keyed_noise._keyed_exponential_kernel, "fn", keyed_noise._keyed_exponential_kernel))
    names = [p.name for p in kernel.params]
    signature = {name: "constexpr" if p.is_constexpr else "i64" for name, p in zip(names, kernel.params)}
    first_int = next(i for i, p in enumerate(kernel.params) if not p.is_constexpr)
    constexpr = next(i for i, p in enumerate(kernel.params) if p.is_constexpr)
    src = ASTSource(kernel, signature, constexprs={(constexpr,): 64}, attrs={(first_int,): [["tt.divisibility", 16]]})
    got = specialisation(src)
    assert got["name"] == "_keyed_exponential_kernel"
    assert got["attrs"] == f"{names[first_int]}=[['tt.divisibility', 16]]"
    assert got["constants"] == f"{names[constexpr]}=64"
    assert f"{names[first_int]}=i64" in got["signature"].split("; ")


# A child process: every Triton kernel and helper defined in pagecast.kernels, their cache keys
# computed in the order given (by name, forwards or backwards), printed as JSON.
KEYS_IN_ORDER = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    from triton.runtime.jit import JITFunction
    import pagecast.kernels

    functions = {}
    for info in pkgutil.iter_modules(pagecast.kernels.__path__):
        module = importlib.import_module(f"pagecast.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.__module__ == module.__name__:
                functions[f"{info.name}.{name}"] = obj
    order = sorted(functions, reverse=sys.argv[1] == "backwards")
    print(json.dumps({name: functions[name].cache_key for name in order}))
    """
)


def test_kernel_cache_keys_do_not_depend_on_which_kernel_a_process_launches_first() -> None:
    """Triton folds a helper's constexpr globals into a caller's cache key only when the helper's
    key was computed first. A build that launched the seeded-noise kernel before the sampler's
    race kernel (both call philox4x32_10) wrote a race kernel the server, launching it first,
    never found: it compiled at every H200 start. Every kernel's key must be the same whichever
    order a process computes them in."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    keys = []
    for direction in ("forwards", "backwards"):
        proc = subprocess.run([sys.executable, "-c", KEYS_IN_ORDER, direction], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        keys.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "sampling._race_kernel" in keys[0] and len(keys[0]) > 20
    assert [name for name in keys[0] if keys[0][name] != keys[1][name]] == []


# The engine core's order: the recorder is made before Triton is imported, and something looks
# Triton up without importing it (torch's "is Triton installed" check) before the real import.
LOOKED_UP_FIRST = textwrap.dedent(
    """
    import importlib.util, sys
    from pagecast.runtime.kernel_cache import process_compiles

    from pagecast.runtime.kernel_cache import TritonCompiles

    first = TritonCompiles()  # a user's or a test's, also made before the import
    compiles = process_compiles()
    assert "triton" not in sys.modules
    assert importlib.util.find_spec("triton") is not None
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import keyed_noise
    from pagecast.kernels.reference import PHILOX_GROUP

    signature = {"out_ptr": "*fp32", "keys_ptr": "*i64", "offsets_ptr": "*i64", "stride_out": "i32",
                 "vocab": "i32", "GROUP": "constexpr"}
    src = ASTSource(keyed_noise._keyed_exponential_kernel, signature=signature, constexprs={"GROUP": PHILOX_GROUP})
    for _ in range(2):
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print(compiles.count, len(compiles.loads), compiles.ensure_installed(), first.count)
    """
)


def test_the_recorder_counts_compiles_when_triton_was_looked_up_before_its_import(tmp_path: Path) -> None:
    """A recorder made before Triton's import installs itself as Triton's compile listener at that
    import (two such recorders both do), even when Triton was looked up first without being imported (on the H200 host the
    engine core's recorder missed the import this way, and counted nothing: every "0 compiles" it
    reported could not have been otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-c", LOOKED_UP_FIRST], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled, loaded, had_to_install, first_compiled = proc.stdout.split()
    assert (compiled, loaded, had_to_install) == ("1", "1", "False")  # the compile, then the cache hit
    assert first_compiled == "1"  # two recorders waiting for the import: both installed


def test_triton_is_primed_on_a_thread_for_a_gpu_artifact_only(tmp_path: Path) -> None:
    """prime_triton computes Triton's own cache key (hashing its compiler and library, 0.36 s on
    the H200 host) on a thread for an artifact built for a GPU; a CPU artifact never imports
    Triton, so nothing starts for one."""
    from pagecast.runtime.kernel_cache import prime_triton

    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    for path, kind in ((cpu, "cpu"), (gpu, "gpu")):
        path.mkdir()
        (path / "manifest.json").write_text(json.dumps({"target": {"kind": kind, "name": "h200"}}))
    from triton.runtime.cache import triton_key

    triton_key.cache_clear()  # computed by nothing but the thread below
    assert prime_triton(cpu) is None
    assert prime_triton(tmp_path / "missing") is None
    assert triton_key.cache_info().currsize == 0
    thread = prime_triton(gpu)
    assert thread is not None
    thread.join(timeout=120)
    assert triton_key.cache_info().currsize == 1


def test_a_recorder_made_later_chains_the_process_one_and_nothing_loops() -> None:
    """A recorder made after the engine's (a test's, a user's) calls on to it; the engine's check
    that its recorder is installed then finds it in that chain and installs nothing more (which
    would make the two call each other for ever)."""
    from triton import knobs

    from pagecast.runtime.kernel_cache import TritonCompiles, process_compiles

    engine = process_compiles()
    engine.ensure_installed()
    before = engine.count
    later = TritonCompiles()
    try:
        assert not engine.ensure_installed()
        knobs.compilation.listener(
            src=type("Src", (), {"name": "_chained_kernel"})(), metadata=None, metadata_group=None, times=None,
            cache_hit=False,
        )  # fmt: skip
        assert later.names == ["_chained_kernel"] and engine.names[before:] == ["_chained_kernel"]
    finally:
        knobs.compilation.listener = later._previous  # the engine's again, for the tests after this
