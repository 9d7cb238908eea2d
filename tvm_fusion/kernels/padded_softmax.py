"""Softmax over a last axis that whole vectors do not divide (a CTC head over 18385 characters):
its max and sum reduce over the axis padded to a multiple of ``PADDED_TO``.

The Softmax rule splits each reduction into vector lanes (``rfactor``): over a padded axis the
split divides, each padding element a ``Select`` of the reduction's identity (-inf for the max,
0 for the sum) that vectorizes, and the reads stay inside the row (clamped). A split that does
not divide leaves a predicate that TVM 0.27's ``rfactor`` drops, reading past the row; a row
left whole is one vector operation of thousands of lanes, which LLVM expands into straight-line
code. The element-wise blocks keep the real width.
"""

from __future__ import annotations

import tvm
from tvm import te, tirx, topi

PADDED_TO = 16  # float32 lanes of an AVX-512 register; two AVX2 registers
# A row of up to this many elements stays one vector operation (the Softmax rule's own limit).
MIN_WIDTH = 64


def pads(width) -> bool:
    """Whether a softmax over a last axis of ``width`` takes the padded reductions."""
    return isinstance(width, (int, tirx.IntImm)) and int(width) > MIN_WIDTH and int(width) % PADDED_TO != 0


def padded_width(width: int) -> int:
    """The length the reductions of a row of ``width`` run over: a multiple of ``PADDED_TO``."""
    return -(-width // PADDED_TO) * PADDED_TO


def padded_softmax(x: te.Tensor) -> te.Tensor:
    """Softmax of ``x`` over its last axis (static, ``pads``), with ``topi.fast_exp``."""
    *rows, width = x.shape
    width = int(width)
    padded = padded_width(width)

    def inside(row: tuple, k) -> tuple:
        """The reduction's index into a row: ``k`` clamped to the row's last element."""
        return (*row, tirx.min(k.var, width - 1))

    k_max = te.reduce_axis((0, padded), name="k")
    lowest = tvm.tirx.min_value(x.dtype)
    maxelem = te.compute(rows, lambda *row: te.max(
        tirx.Select(k_max.var < width, x[inside(row, k_max)], lowest), axis=k_max), name="T_softmax_maxelem")
    delta = te.compute(x.shape, lambda *index: x[index] - maxelem[index[:-1]], name="T_softmax_delta")
    exp = topi.fast_exp(delta)
    k_sum = te.reduce_axis((0, padded), name="k")
    expsum = te.compute(rows, lambda *row: te.sum(
        tirx.Select(k_sum.var < width, exp[inside(row, k_sum)], tirx.const(0, x.dtype)), axis=k_sum),
        name="T_softmax_expsum")
    return te.compute(x.shape, lambda *index: exp[index] / expsum[index[:-1]], name="T_softmax_norm")
