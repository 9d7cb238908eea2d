"""ONNX Dropout in training mode, drawn with the Philox-4x32-10 counter-based generator.

Whether element ``i`` is kept is a pure function of (seed, flat index ``i``): Philox with the
index as counter and the seed as key. No state, no sequence: the mask does not depend on how
a kernel is tiled, vectorized or parallelized, so the ``dropout_training`` fusion draws exactly
the mask this standalone kernel draws. The frontend emits it for a Dropout whose
``training_mode`` is a constant true.
"""

from __future__ import annotations

from tvm import relax, te, tirx

from . import kernel_attrs

KERNEL_NAME = "dropout_training"

# Philox-4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
PHILOX_ROUNDS = 10
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def philox_keys(seed: int) -> list[tuple[int, int]]:
    """The per-round keys for a Dropout seed (its low and high 32 bits), bumped by the Weyl constants."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    return [((k0 + r * _PHILOX_W0) & _MASK32, (k1 + r * _PHILOX_W1) & _MASK32) for r in range(PHILOX_ROUNDS)]


def _let(value: tirx.PrimExpr, body, name: str) -> tirx.PrimExpr:
    """Bind ``value`` once; without Let, TIR would copy each round's tree into the next ones."""
    var = tirx.Var(name, "uint64")
    return tirx.Let(var, value, body(var))


def philox_word0(counter: tirx.PrimExpr, seed: int) -> tirx.PrimExpr:
    """Word 0 of Philox-4x32-10 at counter (counter_lo, counter_hi, 0, 0), in a uint64.

    Only 32x32->64-bit products, shifts, masks and xors: no operation wraps, because TVM's
    LLVM code generator marks unsigned adds and multiplies "no unsigned wrap", which makes a
    wrapping hash (Squares, splitmix) undefined and miscompiled in scalar loops.
    """
    u64 = lambda v: tirx.const(v, "uint64")  # noqa: E731
    low = lambda v: v & u64(_MASK32)  # noqa: E731
    high = lambda v: tirx.shift_right(v, u64(32))  # noqa: E731
    keys = philox_keys(seed)

    def rounds(r, c0, c1, c2, c3):
        if r == PHILOX_ROUNDS:
            return c0
        k0, k1 = keys[r]
        return _let(c0 * u64(_PHILOX_M0), lambda p0: _let(c2 * u64(_PHILOX_M1), lambda p1: _let(
            high(p1) ^ c1 ^ u64(k0), lambda n0: _let(high(p0) ^ c3 ^ u64(k1), lambda n2: rounds(
                r + 1, n0, low(p1), n2, low(p0)), f"c2_{r}"), f"c0_{r}"), f"p1_{r}"), f"p0_{r}")

    return _let(counter, lambda c: rounds(0, low(c), high(c), u64(0), u64(0)), "counter")


def dropout_training_kernel(x: te.Tensor, ratio: te.Tensor, seed: int) -> list[te.Tensor]:
    """ONNX Dropout in training mode: ``[x * mask / (1 - ratio), mask]``, mask = uniform >= ratio.

    The uniform draw of element i is the top 24 bits of Philox word 0 at counter i times 2**-24,
    exact in float32; the keep test and the scale 1/(1-ratio) are in float32 as ONNX Runtime computes them.
    """
    shape = [int(dim) if isinstance(dim, tirx.IntImm) else dim for dim in x.shape]  # symbolic: an int64 var
    threshold = tirx.Cast("float32", ratio[()])

    def flat_index(indices) -> tirx.PrimExpr:
        flat = tirx.const(0, "int64")
        for index, extent in zip(indices, shape):
            flat = flat * extent + tirx.Cast("int64", index)
        return tirx.Cast("uint64", flat)

    def keep(*indices):
        top24 = tirx.shift_right(philox_word0(flat_index(indices), seed), tirx.const(8, "uint64"))
        uniform = tirx.Cast("float32", tirx.Cast("int32", top24)) * tirx.const(2.0**-24, "float32")
        return uniform >= threshold

    mask = te.compute(x.shape, keep, name="dropout_mask")
    one = tirx.const(1.0, "float32")
    scale = tirx.Cast(x.dtype, one / (one - threshold))
    output = te.compute(
        x.shape, lambda *i: tirx.Select(mask(*i), x(*i) * scale, tirx.const(0, x.dtype)),
        name="dropout_output")
    return [output, mask]


def emit_dropout_training(bb: relax.BlockBuilder, x: relax.Expr, ratio: relax.Expr,
                          seed: int) -> relax.Expr:
    """``call_tir(dropout_training, (x, ratio))`` -> (values, bool mask); ratio a 0-d float32."""
    return bb.call_te(dropout_training_kernel, x, ratio, seed, primfunc_name_hint=KERNEL_NAME,
                      primfunc_attrs=kernel_attrs(KERNEL_NAME))
