"""Fixes for Triton's CPU interpreter (``TRITON_INTERPRET=1``), for running the kernels without a GPU.

- **Scalars as loop bounds.** triton 3.6's interpreter turns a scalar, which it holds as a
  1-element numpy array, into a loop bound with ``int(array)``; numpy >= 2.4 refuses ``int()`` of an
  array of ndim > 0, so a kernel whose ``range()`` bound is a scalar argument fails.
- **Conversions to e4m3.** Its float-to-fp8 conversion drops the carry when rounding up fills the
  mantissa (31.6 became 16, not 32; 124.7 became 64, not 128) and ignores the bits below the
  rounding bit (ties are not to even), so a kernel that quantises to e4m3 itself (the FP8 GEMMs'
  activation quantisation, the fused decode kernel, the FP8 KV cache writes) could not be checked
  against torch's rounding. The fix converts to and from e4m3 with torch instead: round to nearest
  even, saturating at +-448 as the GPU's ``cvt.rn.satfinite`` does (NaN stays NaN).

``interpreter_index_fix()`` applies both (its name is older than the second). Compiled kernels on a
GPU never go through the interpreter, so this matters only under ``TRITON_INTERPRET=1`` (the kernel
tests on the CPU, the benchmarks' dry runs). Importing this module does nothing and does not import
triton; call the function, once the interpreter is wanted (a second call is a no-op).
"""

from __future__ import annotations


def interpreter_index_fix() -> None:
    """Patch triton's interpreter: a 1-element array works as a loop bound, and float-to-e4m3
    conversions round as the GPU does (idempotent)."""
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_pagecast_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._convert_float = _e4m3_by_torch(interpreter._convert_float)
    interpreter._pagecast_index_fix = True


def _e4m3_by_torch(convert):  # type: ignore[no-untyped-def]
    """``convert`` (the interpreter's ``_convert_float``) with conversions between e4m3
    (``tl.float8e4nv``, held as uint8) and fp32, fp16 or bf16 (bf16 held as its uint16 bits) done by
    torch; every other conversion as before."""
    import numpy as np
    import torch
    import triton.language as tl

    from pagecast.kernels.reference import FP8_MAX

    floats = {  # triton type: (numpy type holding it, numpy type of the same width torch reads, torch type)
        tl.float32: (np.float32, np.float32, torch.float32),
        tl.float16: (np.float16, np.float16, torch.float16),
        tl.bfloat16: (np.uint16, np.int16, torch.bfloat16),
    }

    def fixed(data, input_dtype, output_dtype, rounding_mode):  # type: ignore[no-untyped-def]
        shape = np.shape(data)
        if output_dtype == tl.float8e4nv and input_dtype in floats:
            _, as_read, torch_type = floats[input_dtype]
            x = torch.from_numpy(np.ascontiguousarray(data).view(as_read).copy()).view(torch_type).float()
            q = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # clamp keeps NaN
            return q.view(torch.uint8).numpy().reshape(shape)
        if input_dtype == tl.float8e4nv and output_dtype in floats:
            held, as_read, torch_type = floats[output_dtype]
            q = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy()).view(torch.float8_e4m3fn)
            return q.to(torch_type).view(getattr(torch, as_read.__name__)).numpy().view(held).reshape(shape)
        return convert(data, input_dtype, output_dtype, rounding_mode)

    return fixed
