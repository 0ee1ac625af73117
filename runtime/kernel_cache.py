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
import importlib.abc
import importlib.util
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


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

        self._previous = knobs.compilation.listener
        knobs.compilation.listener = self._listen

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
    executed, then this runs), and removes itself."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then
        exec_module = loader.exec_module

        def exec_then(module: Any) -> None:
            exec_module(module)
            then()

        loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec


_process_compiles: TritonCompiles | None = None


def process_compiles() -> TritonCompiles:
    """One recorder for this process, installed at the first call (so engines made one after
    another share it rather than chain a listener each)."""
    global _process_compiles
    if _process_compiles is None:
        _process_compiles = TritonCompiles()
    return _process_compiles
