"""A fix for Triton's CPU interpreter (``TRITON_INTERPRET=1``), for running the kernels without a GPU.

triton 3.6's interpreter turns a scalar, which it holds as a 1-element numpy array, into a loop
bound with ``int(array)``; numpy >= 2.4 refuses ``int()`` of an array of ndim > 0, so a kernel whose
``range()`` bound is a scalar argument fails under the interpreter. ``interpreter_index_fix()``
patches the interpreter's tensors to read the element instead. Compiled kernels on a GPU never go
through the interpreter, so this matters only under ``TRITON_INTERPRET=1`` (the kernel tests on the
CPU, ``benchmarks/long_context.py --dry-run``).

Importing this module does nothing and does not import triton; call the function, once the
interpreter is wanted, to apply the patch (a second call is a no-op).
"""

from __future__ import annotations


def interpreter_index_fix() -> None:
    """Patch triton's interpreter so a 1-element array works as a loop bound (idempotent)."""
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_pagecast_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._pagecast_index_fix = True
