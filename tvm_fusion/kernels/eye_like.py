"""ONNX EyeLike as a kernel on its input (as ONNX Runtime runs it), not a stored identity.

TVM imports EyeLike as ``R.eye_like``, which constant-folding turns into an n x m tensor baked
into the library. The frontend emits ``call_tir(eye_like, (x,))`` instead; the
``eye_like_add`` pattern fuses it with the add that consumes it.
"""

from __future__ import annotations

from tvm import relax, te, tirx

from . import kernel_attrs

KERNEL_NAME = "eye_like"


def eye_like_kernel(x: te.Tensor, k: int, dtype: str) -> te.Tensor:
    """ONNX EyeLike: ones where column - row == k, zeros elsewhere, in ``dtype``, shaped like x."""
    return te.compute(
        x.shape,
        lambda i, j: tirx.Select(j - i == k, tirx.const(1, dtype), tirx.const(0, dtype)),
        name="eye_like")


def emit_eye_like(bb: relax.BlockBuilder, x: relax.Expr, k: int, dtype: str) -> relax.Expr:
    """``call_tir(eye_like, (x,))``; x is an argument so that it is not folded into a constant."""
    return bb.call_te(eye_like_kernel, x, k, dtype, primfunc_name_hint=KERNEL_NAME,
                      primfunc_attrs=kernel_attrs(KERNEL_NAME))
