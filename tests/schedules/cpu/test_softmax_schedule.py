"""Softmax rule: row max/sum as vector partial reductions (rfactor), prologue and epilogue in the
row loop, same numbers as the unscheduled kernel."""

import math

import numpy as np
import pytest
import tvm
from loop_structure import loop_kinds
from tvm import relax

from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.schedules.cpu import Softmax


def _fused_softmax(shape, mask_shape, epilogue, fast_math):
    """(x * 0.125 + mask) -> softmax [-> * w], fused by the softmax pattern and lowered."""
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    mask = relax.Var("mask", relax.TensorType(mask_shape, "float32"))
    w = relax.Var("w", relax.TensorType(shape[-1:], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, mask, w]):
        with bb.dataflow():
            logits = relax.op.add(relax.op.multiply(x, relax.const(0.125, "float32")), mask)
            probs = relax.op.nn.softmax(logits, axis=-1)
            out = bb.emit_output(relax.op.multiply(probs, w) if epilogue else probs)
        bb.emit_func_output(out)
    report = PatternReport()
    fused = FusePatterns([get_pattern("softmax")], report)(bb.get())
    assert report.fired["softmax"] == 1
    return tvm.transform.Sequential(lowering_passes(fast_math))(fused)


def _run(mod, inputs, target):
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


def partial_width(keys: int, lanes: int) -> int:
    """Lanes of the partial max/sum vectors: the largest power of two dividing the key count,
    at most one vector register; under 4, the largest divisor from half a register to two
    registers that still leaves two steps per row (a row of 75 keys: 25 lanes on AVX-512, 15
    on AVX2)."""
    width = 1
    while width * 2 <= lanes and keys % (width * 2) == 0:
        width *= 2
    if width < 4:
        width = max((d for d in range(lanes // 2, 2 * lanes + 1) if keys % d == 0 and keys >= 2 * d), default=width)
    return width


@pytest.mark.parametrize("shape, mask_shape, epilogue, fast_math, split", [
    ((1, 4, 64, 64), (1, 1, 1, 64), True, True, True),     # 64 keys: one full vector of partials
    ((2, 3, 40), (2, 1, 40), False, False, True),          # 40 keys: 8-wide partials (8 divides 40)
    ((6, 6), (6, 6), True, True, False),                   # 6 keys: too narrow to split, scalar reductions
    ((3, 75), (3, 75), True, True, True),                  # 75 keys, odd: partials of a divisor (25 or 15)
    ((2, 6625), (1, 6625), False, True, True),             # a CTC head's 6625 classes: 25 lanes
    ((1, 64), (1, 64), True, True, True),                  # a single row: one serial task
    ((1, 1, 100), (1, 1, 100), False, False, True),        # one query of a decoder's head: 4-wide partials
    ((3, 75), (3, 75), True, False, True),                 # without fast math: topi's softmax, a divisor's partials
    ((2, 2053), (1, 2053), False, True, True),             # a prime row: reductions over 2064, exp on vectors and a tail
])
def test_schedule_matches_unscheduled(target, lanes, shape, mask_shape, epilogue, fast_math, split):
    mod = _fused_softmax(shape, mask_shape, epilogue, fast_math)
    (gvar,) = [gv for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    sch = Softmax().apply(mod[gvar], target, False)
    assert sch is not None
    scheduled = mod.clone()
    scheduled[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)

    loops = loop_kinds(sch.mod["main"])
    rows = math.prod(shape[:-1])
    assert loops.parallel == ([rows] if rows > 1 else [])  # a single row runs serially
    script = sch.mod["main"].script()
    keys = shape[-1]
    # fast math's softmax reduces a row of over 64 keys that 16 does not divide over its
    # padding to 16 (kernels/padded_softmax.py): whole vectors of partials
    padded = fast_math and keys > 64 and keys % 16
    partial = partial_width(-(-keys // 16) * 16 if padded else keys, lanes)
    assert split == (partial >= 4)
    if split:  # both reductions go through a vector of partial results, updated and initialized as vectors
        assert script.count(f"T.sblock_alloc_buffer(({', '.join(f'T.int64({d})' for d in shape[:-1])}, "
                            f"T.int64({partial})))") == 2
        assert loops.vectorized.count(partial) >= 4
    else:
        assert "_rf" not in script
    # exp and normalize on the row, on whole vectors, or past 4 vectors on a divisor's width,
    # else on whole vectors and the few keys left
    row_vectors = {keys}
    if keys > lanes and keys % lanes == 0:
        row_vectors = {lanes}
    elif keys > 4 * lanes:
        row_vectors = {partial_width(keys, lanes)} if partial_width(keys, lanes) >= 4 else {lanes, keys % lanes}
    assert row_vectors <= set(loops.vectorized) <= {partial, *row_vectors}  # exp, normalize

    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(shape).astype("float32"),
              np.where(rng.random(mask_shape) < 0.2, -np.inf, 0.0).astype("float32"),
              rng.standard_normal(shape[-1:]).astype("float32")]
    np.testing.assert_allclose(_run(scheduled, inputs, target), _run(mod, inputs, target),
                               rtol=1e-5, atol=1e-6)


def _lowered(fn, **shapes):
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(fn(*params))
        bb.emit_func_output(out)
    return relax.get_pipeline("zero")(bb.get())


@pytest.mark.parametrize("fn, shapes", [
    (lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]), {"x": (8, 32), "g": (32,), "b": (32,)}),
    (lambda x: relax.op.nn.softmax(x, axis=0), {"x": (16, 8)}),
    (lambda x, w: relax.op.matmul(x, w), {"x": (16, 8), "w": (8, 16)}),
])
def test_declines_what_is_not_a_last_axis_softmax(target, fn, shapes):
    mod = _lowered(fn, **shapes)
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert funcs
    assert all(Softmax().apply(f, target, False) is None for f in funcs)
