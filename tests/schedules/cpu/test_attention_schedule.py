"""Attention rule: the fused attention kernel computed per (batch, head, row tile), with tiles
instead of seq x seq buffers, giving the unscheduled kernel's numbers."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from loop_structure import largest_divisor, loop_kinds, whole_vectors
from tvm import relax, s_tir

from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.schedules.cpu import Attention

FLOAT_MIN = float(np.finfo(np.float32).min)


def _attention_module(batch, seq, heads, dim, scale_op, mask_shape, causal, fast_math, qk_heads=False):
    """One attention as the exporters write it, fused by the attention pattern and lowered;
    ``qk_heads``: Q and K are inputs already in [batch, heads, seq, dim] (Llama's form)."""
    proj = relax.TensorType((batch, seq, heads * dim), "float32")
    params = [relax.Var(name, proj) for name in "qkv"]
    if qk_heads:
        params[:2] = [relax.Var(name, relax.TensorType((batch, heads, seq, dim), "float32")) for name in "qk"]
    if mask_shape:
        params.append(relax.Var("mask", relax.TensorType(mask_shape, "float32")))

    def heads_first(x, axes):
        return relax.op.permute_dims(relax.op.reshape(x, (batch, seq, heads, dim)), axes)

    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            if qk_heads:
                scores = relax.op.matmul(params[0], relax.op.permute_dims(params[1], [0, 1, 3, 2]))
            else:
                scores = relax.op.matmul(heads_first(params[0], [0, 2, 1, 3]),
                                         heads_first(params[1], [0, 2, 3, 1]))
            scale = np.sqrt(dim) if scale_op is relax.op.divide else 1 / np.sqrt(dim)
            logits = scale_op(scores, relax.const(scale, "float32"))
            if causal:
                triangle = relax.const(np.tril(np.ones((1, 1, seq, seq), bool)))
                logits = relax.op.where(triangle, logits, relax.const(FLOAT_MIN, "float32"))
            if mask_shape:
                logits = relax.op.add(logits, params[3])
            context = relax.op.matmul(relax.op.nn.softmax(logits, axis=-1), heads_first(params[2], [0, 2, 1, 3]))
            merged = relax.op.permute_dims(context, [0, 2, 1, 3])
            out = bb.emit_output(relax.op.reshape(merged, (batch, seq, heads * dim)))
        bb.emit_func_output(out)
    report = PatternReport()
    fused = FusePatterns([get_pattern("attention")], report)(bb.get())
    assert report.fired["attention"] == 1
    return tvm.transform.Sequential(lowering_passes(fast_math))(fused)


def _attention_func(mod):
    (gvar,) = [gv for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and "softmax" in gv.name_hint]
    return gvar


def _run(mod, inputs, target):
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


def _largest_allocation(func, excluded: tuple = ()) -> int:
    """Elements of the largest intermediate buffer (but for copies of the ``excluded`` inputs)
    once allocations shrink to what each loop uses."""
    mod = tvm.transform.Sequential([
        s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation(),
    ])(tvm.IRModule({"main": func}))
    buffers = []
    tvm_ffi.structural_walk(mod["main"].body, (s_tir.SBlock, lambda b: buffers.extend(b.alloc_buffers)))
    return max(int(np.prod([int(d) for d in buffer.shape])) for buffer in buffers
               if buffer.name not in [f"{param.name}_global" for param in excluded])


@pytest.mark.parametrize("batch, seq, heads, dim, scale_op, mask_shape, causal, fast_math, qk_heads", [
    (2, 40, 3, 16, relax.op.divide, (2, 1, 1, 40), False, True, False),     # BERT padding mask
    (1, 64, 2, 32, relax.op.multiply, (1, 1, 64, 64), True, False, False),  # GPT-2 causal, libm exp
    (1, 64, 2, 16, relax.op.multiply, (1, 2, 64, 64), False, True, False),  # a bias per head
    (1, 256, 1, 64, relax.op.divide, None, False, True, False),             # longer keys, no mask
    (1, 48, 2, 16, relax.op.multiply, (1, 1, 48, 48), False, True, True),   # Llama: Q, K head-first
    (1, 40, 8, 15, relax.op.multiply, None, False, True, False),            # PP-OCRv4-rec's SVTR heads
])
def test_schedule_matches_unscheduled_with_row_tiles(target, lanes, batch, seq, heads, dim, scale_op, mask_shape,
                                                     causal, fast_math, qk_heads):
    mod = _attention_module(batch, seq, heads, dim, scale_op, mask_shape, causal, fast_math, qk_heads)
    gvar = _attention_func(mod)
    sch = Attention().apply(mod[gvar], target, False)
    assert sch is not None
    scheduled = mod.clone()
    scheduled[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)

    # A [.., rows, keys] mask the heads share (a causal triangle, a mask per batch) is first
    # transposed once, in a pass of its own over the keys (its rows in vectors), into a copy of
    # its size; a mask per head is read in place.
    shared_masks = [p for p in sch.mod["main"].params if len(p.shape) == 4
                    and [int(d) for d in p.shape[-2:]] == [seq, seq] and np.prod([int(d) for d in p.shape]) < batch * heads * seq * seq]
    # No seq x seq score matrix: every intermediate is at most a tile of <= 32 rows x all keys.
    assert _largest_allocation(sch.mod["main"], excluded=shared_masks) <= 32 * seq < seq * seq
    # One parallel loop over (batch, head, tile of up to 2 vectors of query rows, or where no
    # whole vectors divide the rows, of the widest power-of-two vector that does); every step on
    # vectors of the tile's rows, except the probs·V tile, on up to 2 vectors of the head dim.
    row_tile = largest_divisor(seq, 2 * lanes)
    if row_tile % lanes and seq % 4 == 0:
        row_tile = max(w for w in (4, 8, 16) if w <= lanes and seq % w == 0)
    dim_tile = whole_vectors(dim, lanes, 2) or largest_divisor(dim, 2 * lanes)
    loops = loop_kinds(sch.mod["main"])
    assert loops.parallel == [seq] * len(shared_masks) + [batch * heads * (seq // row_tile)]
    assert set(loops.vectorized) == {row_tile, dim_tile} | ({largest_divisor(seq, lanes)} if shared_masks else set())

    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in mod["main"].params[:3]]
    if mask_shape:
        inputs.append(np.where(rng.random(mask_shape) < 0.2, FLOAT_MIN, 0.0).astype("float32"))
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
    (lambda x: relax.op.nn.softmax(x, axis=-1), {"x": (1, 2, 16, 16)}),
    (lambda q, k: relax.op.nn.softmax(relax.op.matmul(q, k), axis=-1), {"q": (2, 16, 8), "k": (2, 8, 16)}),
    (lambda x, w: relax.op.matmul(x, w), {"x": (16, 8), "w": (8, 16)}),
])
def test_declines_what_is_not_attention(target, fn, shapes):
    mod = _lowered(fn, **shapes)
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert funcs
    assert all(Attention().apply(f, target, False) is None for f in funcs)
