"""ONNX Clip as TVM's importer emits it -> ``R.clip``.

The importer lowers Clip(x, lo, hi) straight to two TE kernels, ``call_tir(maximum, (x, lo))``
then ``call_tir(minimum, (., hi))``, which no Relax-level fusion can see through. The frontend
marks the two kernels (``kernels.CLIP_KERNELS``), so no other maximum or minimum is taken for a
Clip. With constant bounds (after FoldConstant) this is exactly ``R.clip(x, lo, hi)`` (Relu6
when lo=0, hi=6).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, is_tuple, wildcard

from ..kernels import CLIP_KERNELS
from .base import RewriteRule, dtype_of, non_float_reason, scalar_constant


class Clip(RewriteRule):
    name = "clip"
    description = "call_tir(minimum, call_tir(maximum, x, lo), hi) with constant bounds -> clip"
    kernels = CLIP_KERNELS

    def variants(self):
        x, lo, hi, maximum, minimum = wildcard(), is_const(), is_const(), wildcard(), wildcard()
        lower = is_op("relax.call_tir")(maximum, is_tuple([x, lo]))
        root = is_op("relax.call_tir")(minimum, is_tuple([lower, hi]))
        return [(root, {"x": x, "lo": lo, "hi": hi, "maximum": maximum, "minimum": minimum})]

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        lo, hi = scalar_constant(matched["lo"]), scalar_constant(matched["hi"])
        if lo is None or hi is None:
            return "clip bounds are not scalar constants"
        if lo > hi:
            return f"lower bound {lo} is above upper bound {hi}"
        return None

    def rewrite(self, matched):
        lo, hi = scalar_constant(matched["lo"]), scalar_constant(matched["hi"])
        dtype = dtype_of(matched["x"])
        return relax.op.clip(matched["x"], relax.prim_value(tvm.tirx.FloatImm(dtype, lo)),
                             relax.prim_value(tvm.tirx.FloatImm(dtype, hi)))
