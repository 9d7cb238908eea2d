"""A matmul with a constant float32 weight as a bf16 x bf16 -> float32 kernel (``--precision bf16``).

The weight is rounded to bfloat16 at build time (round to nearest even) and packed in the
layout that AMX-BF16's ``tdpbf16ps`` reads as its B tile: ``[N/16, K/2, 16, 2]``, 16 output
columns by 2 consecutive k (``schedules/cpu/bf16_matmul_amx.py`` tensorizes it); K is padded
to a multiple of 2 and N to one of 16 with zeros, which add nothing. The float32 activation
is rounded to bfloat16 by a prologue block of the same kernel (no cast kernel, no bf16
tensor in the graph), and the products are summed in float32. What feeds and follows the
matmul (norms, softmax, residual adds) stays float32, and so do the model's inputs and outputs.

Both operands are uint16 tensors of bf16 bits, not TVM's ``bfloat16``: TVM 0.27's
BF16ComputeLegalize widens every bfloat16 buffer a kernel allocates to float32 (the prologue's
output would then not be bf16 in memory, which AMX tiles read), and its LLVM backend cannot
form a bfloat vector (it crashes compiling one). Bits are exact and make the rounding
explicit (``bf16_bits``, ``bf16_value``). AMX tiles read them from memory
(``schedules/cpu/bf16_matmul_amx.py``); AVX512_BF16's ``vdpbf16ps`` takes them as 32-bit pairs
through a few lines of imported LLVM IR (``kernels/avx512_bf16.py``,
``schedules/cpu/bf16_matmul_avx512.py``). Where neither rule takes it, it runs as written, each
bf16 widened to float32 by a shift, under the generic rules: far slower than the float32
kernels (``benchmarks/bench_bf16.py``), which is why ``passes/bf16_matmuls.py`` emits it only
for targets with one of the two.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from tvm import relax, te
from tvm.relax import op as R

from .packed_weights import COLUMN_BLOCK, pack_panels, packed_shape, round_up

# The tile layout (packed_weights.py): 16 float32 lanes of output columns, each summing 2 consecutive k.
DEPTH_BLOCK = 2
KERNEL_NAME = "bf16_matmul"  # the sum block's name: the schedule rules look for it
PROLOGUE_NAME = "bf16_activation"


def pack_weight(weight: np.ndarray) -> np.ndarray:
    """``[K, N]`` float32 rounded to bf16 as ``[N16/16, K2/2, 16, 2]`` uint16 (the bf16 bits),
    zero-padded: ``packed[j, q, c, r] = bf16(weight[2q + r, 16j + c])``."""
    return pack_panels(weight.astype(ml_dtypes.bfloat16), DEPTH_BLOCK).view(np.uint16)


def packed_weight_shape(weight_shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """What ``pack_weight`` makes of a weight of this shape."""
    return packed_shape(*weight_shape, DEPTH_BLOCK)


def bf16_bits(value: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
    """A float32's bf16 rounding (to nearest even; a NaN stays a NaN) as its 16 bits. A
    ``Select``, not an ``if_then_else``: TVM vectorizes a loop of selects, and scalarizes one
    whose ``if_then_else`` has a vector condition."""
    bits = tvm.tirx.reinterpret("uint32", value)
    rounded = (bits + (tvm.tirx.const(0x7FFF, "uint32") + ((bits >> 16) & tvm.tirx.const(1, "uint32")))) >> 16
    return tvm.tirx.Select(value != value, tvm.tirx.const(0x7FC0, "uint16"), rounded.astype("uint16"))


def bf16_value(bits: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
    """16 bits of a bf16 as the float32 they stand for (exact)."""
    return tvm.tirx.reinterpret("float32", bits.astype("uint32") << 16)


def activation_te(data: te.Tensor, depth: int, rows: int | None = None) -> te.Tensor:
    """``data`` rounded to bf16 (its bits), zero-padded along the last axis to ``depth`` and,
    with ``rows``, a 2-D ``data`` along its first to ``rows`` (the reads are clamped inside
    ``data``, so the padding is a ``Select`` that vectorizes)."""
    real = data.shape[-1]
    shape = (*data.shape[:-1], depth) if rows is None else (rows, depth)

    def compute(*index):
        inside = index[-1] < real
        row = index[:-1]
        if rows is not None:
            inside = tvm.tirx.all(inside, index[0] < data.shape[0])
            row = (tvm.tirx.min(index[0], data.shape[0] - 1),)
        value = data[(*row, tvm.tirx.min(index[-1], real - 1))]
        return tvm.tirx.Select(inside, bf16_bits(value), tvm.tirx.const(0, "uint16"))

    return te.compute(shape, compute, name=PROLOGUE_NAME)


def sum_te(data: te.Tensor, packed: te.Tensor) -> te.Tensor:
    """``C[.., m, n] = sum_k f32(data[.., m, k]) * f32(packed[n/16, k/2, n%16, k%2])`` over the
    padded N and K (the form of the tile intrinsics' descriptions), both operands bf16 bits."""
    k = te.reduce_axis((0, data.shape[-1]), name="k")
    columns = packed.shape[0] * COLUMN_BLOCK

    def compute(*index):
        *rows, n = index
        weight = packed[n // COLUMN_BLOCK, k // DEPTH_BLOCK, n % COLUMN_BLOCK, k % DEPTH_BLOCK]
        return te.sum(bf16_value(data[(*rows, k)]) * bf16_value(weight), axis=k)

    return te.compute((*data.shape[:-1], columns), compute, name=KERNEL_NAME)


def kernel_te(data: te.Tensor, packed: te.Tensor, depth: int, rows: int | None = None) -> te.Tensor:
    """The activation's rounding (padded to ``depth``, and to ``rows`` rows) and the sum, in one
    kernel: a cast kernel of its own would write the bf16 activation to memory and read it back."""
    return sum_te(activation_te(data, depth, rows), packed)


def emit_bf16_matmul(bb: relax.BlockBuilder, data: relax.Expr, weight: np.ndarray,
                     packed: relax.Expr | None = None, name: str = "", row_multiple: int = 1) -> relax.Expr:
    """``data @ weight`` with bf16 operands and a float32 sum, shaped like ``data`` with its
    last axis N: ``data`` float32 of rank >= 1 with a static last axis K, ``weight`` the
    constant ``[K, N]`` (``bf16_matmul_applies``); ``packed`` what holds ``pack_weight(weight)``
    (a composite function's parameter: no constant may be inside one), default a constant;
    ``name`` the kernel call's binding (the matmul's, so that its kernel traces back to its node).
    Static leading axes are merged into one row axis: the tiles then see all rows at once (a
    batch of 197-row items is 394 rows, not two prime row counts). With ``row_multiple`` (the
    register tiles' rows), a static row count past it that it does not divide is padded to its
    multiple in the kernel (197 rows: 50 tiles of 4, not 197 tiles of 1), the padding rows
    sliced off."""
    depth, columns = weight.shape
    *leading, _ = data.ty.shape.values
    rows = data
    if data.ty.ndim != 2 and all(isinstance(d, tvm.tirx.IntImm) for d in leading):
        rows = bb.emit(R.reshape(data, [int(np.prod([int(d) for d in leading])), depth]))
    if packed is None:
        packed = relax.const(tvm.runtime.tensor(pack_weight(weight)))
    count = rows.ty.shape.values[0] if rows.ty.ndim == 2 else None
    padded = None
    if isinstance(count, tvm.tirx.IntImm) and int(count) > row_multiple and int(count) % row_multiple:
        padded = round_up(int(count), row_multiple)
    total = bb.emit_te(kernel_te, rows, packed, round_up(depth, DEPTH_BLOCK), padded, primfunc_name_hint=KERNEL_NAME,
                       name_hint=name)
    if round_up(columns, COLUMN_BLOCK) != columns or padded is not None:
        axes, ends = [rows.ty.ndim - 1], [columns]
        if padded is not None:
            axes, ends = [0, *axes], [int(count), *ends]
        total = bb.emit(R.strided_slice(total, axes=axes, begin=[0] * len(axes), end=ends))
    return total if rows is data else bb.emit(R.reshape(total, [*leading, columns]))


def bf16_matmul_declines(data: relax.Expr, weight: np.ndarray | None) -> str | None:
    """Why the bf16 kernel cannot compute ``data @ weight``, or None when it can: it takes a
    2-D float32 constant weight and a float32 activation of known rank whose last axis is
    static and equals the weight's K."""
    if weight is None:
        return "the weight is not a constant"
    if weight.ndim != 2 or weight.size == 0:
        return f"the weight has shape {list(weight.shape)}, not [K, N]"
    if weight.dtype != np.float32 or str(data.ty.dtype) != "float32":
        return f"the operands are {data.ty.dtype} x {weight.dtype}, not float32"
    shape = data.ty.shape
    if data.ty.ndim < 1 or not isinstance(shape, relax.ShapeExpr):
        return "the activation's rank or shape is unknown"
    last = shape.values[-1]
    if not isinstance(last, tvm.tirx.IntImm) or int(last) != weight.shape[0]:
        return f"the activation's last axis ({last}) is not static or not K = {weight.shape[0]}"
    return None


def bf16_matmul_applies(data: relax.Expr, weight: np.ndarray | None) -> bool:
    """Whether ``emit_bf16_matmul`` takes these operands (``bf16_matmul_declines`` says why not)."""
    return bf16_matmul_declines(data, weight) is None
