"""The artifact's compiled Triton kernels at serve time: a private copy of its cache that Triton
can actually hit, and a count of the kernels Triton compiled anyway.

Triton keeps each compiled kernel as a group file (``__grp__<kernel>.json``) listing its members
(cubin, metadata, IRs) by absolute path, the path it wrote them at. The build writes the cache
inside its staging directory, which is renamed into the artifact at the end, so every recorded
path is gone by serving time. Triton drops members whose path does not exist and treats the
kernel as a miss: without relinking, every kernel compiles again at each start (measured on an
H200: 20 kernels, 5.5 s of an 8B engine's 7.4 s start) while the cache's file count stays the same
(the compile rewrites the same file names), so counting files cannot see it. Triton's own
compilation listener can, and ``TritonCompiles`` uses it.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import json
import logging
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def private_cache_copy(source: Path) -> Path:
    """A private copy of ``source`` with its groups relinked to it (removed at exit). Triton
    rewrites cache files when it loads kernels; serving from a copy leaves the artifact exactly
    as built, so its hashes keep matching."""
    private = Path(tempfile.mkdtemp(prefix="pagecast-triton-"))
    atexit.register(shutil.rmtree, private, True)
    shutil.copytree(source, private, dirs_exist_ok=True)
    relink_groups(private)
    return private


def relink_groups(cache: Path) -> int:
    """Point every group file under ``cache`` at the members beside it; returns how many groups
    were rewritten. A member is found by its file name in the group's own directory, which is
    where Triton puts it."""
    relinked = 0
    for group in cache.rglob("__grp__*"):
        try:
            data = json.loads(group.read_text())
        except (OSError, ValueError):
            continue  # not a group Triton could read either: it will miss and compile
        children = data.get("child_paths") if isinstance(data, dict) else None
        if not isinstance(children, dict):
            continue
        data["child_paths"] = {name: str(group.parent / Path(path).name) for name, path in children.items()}
        group.write_text(json.dumps(data))
        relinked += 1
    return relinked


def prime_triton(artifact_dir: str | Path) -> threading.Thread | None:
    """For an artifact built for a GPU: import Triton and compute Triton's own cache key on a
    daemon thread, beside the artifact's load (call it once torch is imported). That key
    (``triton_key``) hashes Triton's compiler sources and its shared library, once per process,
    when the first kernel is loaded: 0.36 s on the H200 host, which the warm-up paid on the
    start's critical path. The hashing releases the GIL, so it overlaps. Returns the thread, or None for a CPU artifact (the CPU
    engine never imports Triton) or one whose manifest cannot be read (the load says why)."""
    try:
        target = json.loads((Path(artifact_dir) / "manifest.json").read_text()).get("target") or {}
    except (OSError, ValueError):
        return None
    if not isinstance(target, dict) or target.get("kind") in (None, "cpu"):
        return None

    def prime() -> None:
        try:
            from triton.runtime.cache import triton_key

            triton_key()
        except Exception:  # an optimisation only: the first kernel load computes it anyway
            logger.debug("priming Triton's cache key failed", exc_info=True)

    thread = threading.Thread(target=prime, name="pagecast-prime-triton", daemon=True)
    thread.start()
    return thread


class TritonCompiles:
    """Records every kernel Triton compiles in this process (a cache miss), by kernel name, from
    the moment it is created. Any listener installed before keeps being called.

    Where Triton is not imported yet (a CPU engine never imports it: 0.6 s of a 2-core machine's
    start), the listener is installed when it is: nothing compiles before Triton is imported."""

    def __init__(self) -> None:
        self.names: list[str] = []
        # Per compile (same order as names): the kernel's specialisation, as Triton keys its
        # cache - which arguments were 16-byte aligned or divisible by 16 (attrs) and the
        # constexpr values; what tells two variants of one kernel apart.
        self.details: list[dict[str, str]] = []
        # Every kernel Triton found in its cache (a hit: loaded from disk at its first launch in
        # this process), by name and specialisation: a load while serving is a first request
        # paying for a variant the warm-up did not run.
        self.loads: list[dict[str, str]] = []
        self._previous: Any = None
        if "triton" in sys.modules:
            self._install()
        else:
            sys.meta_path.insert(0, _AfterImport("triton", self._install))

    def _install(self) -> None:
        from triton import knobs

        if self._called_by(knobs.compilation.listener):
            return
        self._previous = knobs.compilation.listener
        knobs.compilation.listener = self._listen

    def _called_by(self, listener: Any) -> bool:
        """Whether ``listener`` is this recorder's, or a recorder's that calls on to it (a
        recorder made later chains the one before: installing this one again on top of it
        would make a loop)."""
        seen: set[int] = set()
        while listener is not None and id(listener) not in seen:
            seen.add(id(listener))
            owner = getattr(listener, "__self__", None)
            if owner is self:
                return True
            listener = owner._previous if isinstance(owner, TritonCompiles) else None
        return False

    @property
    def installed(self) -> bool:
        """Triton is imported and calls this recorder (as its listener, or through one that calls
        on to it)."""
        if "triton" not in sys.modules:
            return False
        from triton import knobs

        return self._called_by(knobs.compilation.listener)

    def ensure_installed(self) -> bool:
        """Make this recorder Triton's compile listener (or one that calls on to it) where Triton
        is imported and it is not; returns True when it had to (compiles and loads before now were
        not recorded)."""
        if "triton" not in sys.modules or self.installed:
            return False
        self._install()
        return True

    def _listen(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        if not cache_hit:
            self.names.append(str(getattr(src, "name", src)))
            self.details.append(specialisation(src, metadata))
        else:
            self.loads.append(specialisation(src))
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    @property
    def count(self) -> int:
        return len(self.names)


def specialisation(src: Any, metadata: Any = None) -> dict[str, str]:
    """A compiled kernel's variant: its name, the specialised arguments (by name: aligned /
    divisible by 16, or equal to 1), its constexprs and argument types, from Triton's ASTSource;
    with the compile's ``metadata``, the cache hash and the options that enter it."""
    fn = getattr(src, "fn", None)
    names = [p.name for p in getattr(fn, "params", [])]

    def arg(path: Any) -> str:
        index = path[0] if isinstance(path, tuple) and path else path
        return names[index] if isinstance(index, int) and index < len(names) else repr(path)

    attrs = getattr(src, "attrs", {}) or {}
    constants = getattr(src, "constants", {}) or {}
    return {
        "name": str(getattr(src, "name", src)),
        "attrs": "; ".join(f"{arg(k)}={v}" for k, v in sorted(attrs.items(), key=lambda kv: repr(kv[0]))),
        "constants": "; ".join(f"{arg(k)}={v}" for k, v in sorted(constants.items(), key=lambda kv: repr(kv[0]))),
        "signature": "; ".join(f"{k}={v}" for k, v in (getattr(src, "signature", {}) or {}).items()),
        "metadata": "; ".join(f"{k}={v}" for k, v in sorted(metadata.items()) if k in _KEYED_OPTIONS)
        if isinstance(metadata, dict)
        else "",
    }


# The compile options that enter Triton's cache key, besides the source and its specialisation.
_KEYED_OPTIONS = ("hash", "target", "num_warps", "num_ctas", "num_stages", "debug", "enable_fp_fusion", "maxnreg",
                  "sanitize_overflow", "arch", "backend_name")  # fmt: skip


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then()`` once module ``name`` has been imported (found by the other finders,
    executed, then this runs), and removes itself.

    It stays in ``sys.meta_path`` until the module has really been executed: a caller that only
    looks the module up (``importlib.util.find_spec("triton")``, as torch does to learn whether
    Triton is installed) gets a spec that is never executed, and the import that follows asks
    again. (Removing itself at the first lookup missed every import on the H200 host: the engine
    core ran without its listener from 2026-12-02 to 2026-12-03.)"""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name = name
        self.then = then
        self._fired = False
        self._lock = threading.Lock()
        self._asking = threading.local()  # this thread is inside find_spec (another hook asked back)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or getattr(self._asking, "active", False):
            return None
        self._asking.active = True
        try:
            spec = None
            for finder in list(sys.meta_path):  # the others: importlib.util.find_spec would ask this one again
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._asking.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module: Any) -> None:
            exec_module(module)
            self._fire()

        spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec

    def _fire(self) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        self.then()


_process_compiles: TritonCompiles | None = None


def process_compiles() -> TritonCompiles:
    """One recorder for this process, installed at the first call (so engines made one after
    another share it rather than chain a listener each)."""
    global _process_compiles
    if _process_compiles is None:
        _process_compiles = TritonCompiles()
    return _process_compiles
