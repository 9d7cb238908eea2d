"""Power spectrum: a matmul, its even and odd columns squared and summed, as one kernel.

An STFT front end's power ``re^2 + im^2`` pairs each real DFT filter's column with its
imaginary one. ``passes/interleave_power_spectrum.py`` puts the two side by side (column
``2j`` and ``2j + 1``), so the power is computed in the product's kernel (``MatmulEpilogue``:
on each tile, or after the tiles where a packed weight puts a pair across a panel's lanes): the
power is no kernel of its own reading the product back. A magnitude's square root or a log after
it joins as an element-wise tail.
"""

from __future__ import annotations

from tvm.relax.dpl import is_op, wildcard

from .base import FusionRule, non_float_reason, static_shape, strided_slice_fields


class PowerSpectrum(FusionRule):
    name = "power_spectrum"
    description = "matmul -> even columns^2 + odd columns^2 (an STFT's power spectrum, its filters interleaved)"
    absorbs_elementwise_tail = True
    runs_before = ("gemm_epilogue",)

    def variants(self):
        lhs, rhs = wildcard(), wildcard()
        matmul = is_op("relax.matmul")(lhs, rhs)
        even = is_op("relax.strided_slice")(matmul, varg_default_wildcard=True)
        odd = is_op("relax.strided_slice")(matmul, varg_default_wildcard=True)
        power = is_op("relax.add")(is_op("relax.multiply")(even, even), is_op("relax.multiply")(odd, odd))
        return [("matmul_even_odd_squares", power,
                 {"lhs": lhs, "rhs": rhs, "matmul": matmul, "even": even, "odd": odd, "power": power})]

    def anchor(self, context):
        return context.annotated_expr["matmul"]

    def check(self, context):
        found = context.annotated_expr
        reason = non_float_reason(found["matmul"])
        if reason:
            return reason
        shape = static_shape(found["matmul"])
        if shape is None:
            return "the matmul's shape is not static"
        rank, columns = len(shape), shape[-1]
        slices = [strided_slice_fields(found[name]) for name in ("even", "odd")]
        taken = sorted([[axis % rank for axis in axes], begin, end, strides]
                       for axes, begin, end, strides in filter(None, slices))
        if taken != [[[rank - 1], [start], [columns], [2]] for start in (0, 1)]:
            return "the squares are not of the product's even and odd columns (step 2 along its last axis)"
        return None
