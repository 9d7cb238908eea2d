"""Injective: fused, vectorized, parallel element-wise and data-movement functions."""

import math

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from helpers import ort_outputs
from loop_structure import loop_kinds
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, te, tirx
from tvm.relax.op import add, concat, greater, nn, permute_dims, reshape, split, strided_slice, take, where

from tvm_fusion import api
from tvm_fusion.schedules.cpu import Injective
from tvm_fusion.schedules.cpu.injective import _comparison_cut

# Below this many elements a block runs on one core (the rule's launch-cost threshold).
MIN_PARALLEL_ELEMENTS = 4096


def assert_fused_vectors(funcs, lanes, elements: int, blocks: int):
    """Each of the kernel's ``blocks`` loop nests fused into one loop of ``elements``, split
    into vectors of the target's width when they divide it, the rest across cores when large."""
    (func,) = funcs.values()
    vectors = elements % lanes == 0 and elements > lanes
    loops = loop_kinds(func)
    assert loops.vectorized == ([lanes] * blocks if vectors else [])
    parallel = elements // lanes if vectors else elements
    assert loops.parallel == ([parallel] * blocks if elements >= MIN_PARALLEL_ELEMENTS else [])


@pytest.mark.parametrize("shape", [(128, 256), (3, 5, 7), (1,)])
def test_elementwise_chain(assert_schedule_matches, lanes, shape):
    funcs = assert_schedule_matches(Injective(), lambda x, y: nn.gelu(add(x, y)), x=shape, y=shape)
    # the add is inlined; gelu's erf block and its output block are kept (erf is not recomputed)
    assert_fused_vectors(funcs, lanes, math.prod(shape), blocks=2)


def test_broadcast_add(assert_schedule_matches, lanes):
    funcs = assert_schedule_matches(Injective(), add, x=(4, 33, 16), y=(16,))
    assert_fused_vectors(funcs, lanes, 4 * 33 * 16, blocks=1)


def test_reshape_transpose(assert_schedule_matches, lanes):
    def heads(x):
        return permute_dims(reshape(x, (1, 128, 4, 64)), (0, 2, 1, 3))

    funcs = assert_schedule_matches(Injective(), heads, x=(1, 128, 256))
    assert_fused_vectors(funcs, lanes, 128 * 256, blocks=1)  # the reshape inlined


def test_concat_and_where(assert_schedule_matches, lanes):
    def block(x, y):
        both = concat([x, y], axis=1)
        return where(greater(both, relax.const(0.0)), both, relax.const(0.5))

    funcs = assert_schedule_matches(Injective(), block, x=(6, 5), y=(6, 11))
    assert_fused_vectors(funcs, lanes, 6 * 16, blocks=1)  # the concat and the comparison inlined into the select


def test_a_concat_read_by_a_split_is_one_pass(assert_schedule_matches, lanes):
    """YOLOv8's head: maps of three sizes flattened, joined and split into box and class rows.
    The concats are selects inlined into each split output (no joined copy written first)."""
    def head(a, b, c):
        flat = [reshape(m, (1, 8, size)) for m, size in ((a, 64), (b, 16), (c, 4))]
        return split(concat(flat, axis=2), [4], axis=1)

    # 4 x 84 values per output: whole vectors at 8 and 16 lanes.
    funcs = assert_schedule_matches(Injective(), head, a=(1, 8, 8, 8), b=(1, 8, 4, 4), c=(1, 8, 2, 2))
    (func,) = funcs.values()
    assert "alloc_buffer" not in func.script()
    assert len(loop_kinds(func).vectorized) == 2  # the two outputs, each one loop nest


def _selects_left(func) -> int:
    """if_then_else calls in ``func`` once its blocks are lowered and its loops' ranges simplify it."""
    lowering = tvm.transform.Sequential([tvm.s_tir.transform.LowerInitBlock(), tvm.s_tir.transform.ConvertBlocksToOpaque(),
                                         tvm.s_tir.transform.LowerOpaqueBlock(), tvm.s_tir.transform.StmtSimplify()])
    lowered = lowering(tvm.IRModule({"main": func}))["main"]
    return lowered.script().count("if_then_else")


@pytest.mark.parametrize("sides", [(16, 8, 4), (10, 6, 5)], ids=["square levels", "levels of odd sides"])
def test_a_concat_of_flattened_levels_runs_a_loop_per_level(assert_schedule_matches, lanes, sides):
    """YOLOv8's head at detection sizes: each output row (a box or class channel) copies each
    level's map in a loop of its own, the rows across cores, so no select is left for a lane
    to evaluate and no index is recovered from a fused one by division."""
    def head(a, b, c):
        flat = [reshape(m, (1, 24, side * side)) for m, side in zip((a, b, c), sides)]
        return split(concat(flat, axis=2), [16], axis=1)

    maps = {name: (1, 24, side, side) for name, side in zip("abc", sides)}
    (func,) = assert_schedule_matches(Injective(), head, **maps).values()
    assert loop_kinds(func).parallel == [16, 8]
    loops = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, loops.append))
    serial = [int(loop.extent) for loop in loops if loop.kind == tvm.tirx.ForKind.SERIAL]
    assert sorted(serial) == sorted([side * side for side in sides] * 2)
    assert _selects_left(func) == 0


@pytest.mark.parametrize("spell, cut", [
    (lambda v, c: v < c, 7), (lambda v, c: c <= v, 7), (lambda v, c: v >= c, 7), (lambda v, c: c > v, 7),
    (lambda v, c: v <= c, 8), (lambda v, c: c < v, 8), (lambda v, c: v > c, 8), (lambda v, c: c >= v, 8),
])
def test_every_spelling_of_a_concat_bound_cuts_at_the_same_place(spell, cut):
    axes = [tvm.tirx.Var("n", "int64"), tvm.tirx.Var("l", "int64")]
    assert _comparison_cut(spell(axes[1], tvm.tirx.IntImm("int64", 7)), axes) == (1, cut)


def test_a_pad_condition_or_a_value_comparison_is_no_cut():
    axes = [tvm.tirx.Var("h", "int64"), tvm.tirx.Var("w", "int64")]
    one = tvm.tirx.IntImm("int64", 1)
    assert _comparison_cut(tvm.tirx.And(one <= axes[0], one <= axes[1]), axes) is None
    assert _comparison_cut(tvm.tirx.Var("x", "float32") > tvm.tirx.const(0.0, "float32"), axes) is None
    assert _comparison_cut(axes[0] < axes[1], axes) is None


def test_must_not_cut_pieces_under_a_vector_or_without_a_task_per_core(assert_schedule_matches, lanes):
    """A concat whose pieces are shorter than a vector keeps the fused vector loop (the
    YOLOv8 head test above, at 2x2 maps); one with a single row has no task per core in
    pieces, and keeps the fused loop across cores."""
    def levels(a, b):
        return concat([reshape(a, (1, 1, 64 * 64)), reshape(b, (1, 1, 32 * 32))], axis=2)

    funcs = assert_schedule_matches(Injective(), levels, a=(1, 1, 64, 64), b=(1, 1, 32, 32))
    assert_fused_vectors(funcs, lanes, 64 * 64 + 32 * 32, blocks=1)


def test_a_blocked_map_runs_its_rows_across_cores(assert_schedule_matches, lanes):
    """NCHW[x]c maps (5-D, a channel block innermost): a core's share is a band of rows, as in
    the convs before and after, whatever the op does along the channels (a concat here)."""
    funcs = assert_schedule_matches(Injective(), lambda x, y: concat([x, y], axis=1),
                                    x=(1, 3, 24, 20, lanes), y=(1, 2, 24, 20, lanes))
    loops = loop_kinds(next(iter(funcs.values())))
    assert loops.parallel == [24]
    assert loops.vectorized == [lanes]


def _requantize_between_blocked_maps(lanes: int) -> tvm.tirx.PrimFunc:
    """Blocked map -> NCHW -> round(x * 7.5) + 3 clipped to uint8 -> nearbyint(q / 0.3) ->
    blocked, one stage per op (as FuseOps hands a QDQ model's requantize and quantize over)."""
    x = te.placeholder((1, 4, 16, 10, lanes), "float32", name="x")
    nchw = te.compute((1, 4 * lanes, 16, 10), lambda n, c, h, w: x[n, c // lanes, h, w, c % lanes], name="nchw")
    rounded = te.compute(nchw.shape, lambda *i: tirx.round(nchw(*i) * 7.5) + 3.0, name="rounded")
    quantized = te.compute(nchw.shape, lambda *i: tirx.max(tirx.min(rounded(*i), 255.0), 0.0).astype("uint8"),
                           name="quantized")
    again = te.compute(nchw.shape, lambda *i: tirx.nearbyint(quantized(*i).astype("float32") / 0.3), name="again")
    out = te.compute(x.shape, lambda n, c, h, w, b: again[n, c * lanes + b, h, w], name="blocked")
    return te.create_prim_func([x, out])


def test_roundings_between_blocked_maps_are_one_pass(run_kernel, target, lanes):
    """The roundings are inlined like arithmetic (kept, each was a pass over an NCHW map that
    gathered every lane from the blocked one): one loop nest over the blocked map."""
    func = _requantize_between_blocked_maps(lanes)
    scheduled = Injective().apply(func, target, False).mod["main"]
    assert "alloc_buffer" not in scheduled.script()
    loops = loop_kinds(scheduled)
    assert loops.parallel == [16] and loops.vectorized == [lanes]
    shapes, result = {"x": (1, 4, 16, 10, lanes)}, (1, 4, 16, 10, lanes)
    np.testing.assert_array_equal(run_kernel(scheduled, shapes, result), run_kernel(func, shapes, result))


def test_a_vectorized_nearbyint_stays_a_vector(prim_funcs, lowered, target):
    """``relax.round`` legalizes to ``nearbyint``, which TVM's vectorizer left scalar until
    tvm_fusion.schedules registered it as vectorizable."""
    func = next(iter(prim_funcs(lowered(relax.op.round, x=(4, 64))).values()))
    sch = Injective().apply(func, target, False)
    passes = [tvm.s_tir.transform.LowerInitBlock(), tvm.s_tir.transform.ConvertBlocksToOpaque(),
              tvm.s_tir.transform.LowerOpaqueBlock(), tvm.tirx.transform.FlattenBuffer(),
              tvm.tirx.transform.VectorizeLoop(True)]
    vectorized = tvm.transform.Sequential(passes)(tvm.IRModule({"main": sch.mod["main"]}))
    text = vectorized["main"].script()
    assert "T.nearbyint" in text and "T.Ramp" in text
    assert "_s in" not in text  # the vectorizer's scalarized fallback loop


def channel_shuffle(x, branch):
    """ShuffleNet v2's unit tail: the kept half of ``x`` and the branch joined, then the two
    halves interleaved channel by channel (reshape to 2 groups, swap, flatten)."""
    n, channels, rows, columns = (int(d) for d in x.ty.shape)
    kept = strided_slice(x, [1], [0], [channels // 2])
    groups = reshape(concat([kept, branch], axis=1), (n, 2, channels // 2, rows, columns))
    return reshape(permute_dims(groups, (0, 2, 1, 3, 4)), (n, channels, rows, columns))


@pytest.mark.parametrize("rows, columns", [(8, 8), (7, 7), (3, 6)])
def test_a_channel_shuffle_copies_plane_by_plane(assert_schedule_matches, lanes, rows, columns):
    """Every read takes whole (row, column) planes, each from a channel of its own: the channels
    run across cores and each plane is one contiguous inner loop (vectors where it holds whole
    ones), instead of one fused loop whose lanes each gather from a channel of their own."""
    channels = 232
    funcs = assert_schedule_matches(Injective(), channel_shuffle, x=(1, channels, rows, columns),
                                    branch=(1, channels // 2, rows, columns))
    loops = loop_kinds(next(iter(funcs.values())))
    plane = rows * columns
    assert loops.parallel == [channels]
    assert loops.vectorized == ([lanes] if plane % lanes == 0 and plane > lanes else [])


def test_a_channel_slice_copies_plane_by_plane(assert_schedule_matches, lanes):
    """A split's second half: each output channel reads the channel 58 further on."""
    funcs = assert_schedule_matches(Injective(), lambda x: strided_slice(x, [1], [58], [116]), x=(1, 116, 16, 16))
    loops = loop_kinds(next(iter(funcs.values())))
    assert (loops.parallel, loops.vectorized) == ([58], [lanes])


def test_planes_under_a_vector_stay_fused(assert_schedule_matches, lanes):
    """A shuffle of 2x2 maps: a plane is less than one vector, so the loops stay fused."""
    funcs = assert_schedule_matches(Injective(), channel_shuffle, x=(1, 2048, 2, 2), branch=(1, 1024, 2, 2))
    assert_fused_vectors(funcs, lanes, 2048 * 4, blocks=1)


def test_a_transpose_of_the_planes_stays_fused(assert_schedule_matches, lanes):
    """Swapping rows and columns moves the trailing axes themselves: no plane is copied whole."""
    funcs = assert_schedule_matches(Injective(), lambda x: permute_dims(x, (0, 1, 3, 2)), x=(1, 64, 16, 16))
    assert_fused_vectors(funcs, lanes, 64 * 256, blocks=1)


def test_take_rows(lowered, prim_funcs, target):
    mod = lowered(lambda table, x: take(table, relax.const([3, 0, 2], "int64"), axis=0),
                  table=(10, 16), x=(1,))
    for func in prim_funcs(mod).values():
        assert Injective().apply(func, target, False) is not None


def test_declines_reduction(lowered, prim_funcs, target):
    mod = lowered(lambda x: nn.softmax(x, axis=-1), x=(8, 32))
    for func in prim_funcs(mod).values():
        assert Injective().apply(func, target, False) is None


def test_a_shufflenet_unit_matches_onnx_runtime(tmp_path):
    """ShuffleNet v2's unit as torch exports it (Split, a 1x1 / depthwise 3x3 / 1x1 branch,
    Concat, then the shuffle as Reshape, Transpose, Reshape) over 116 channels of 14x14:
    the shuffle compiles to one Injective kernel copying 116 planes across cores, and the
    outputs agree with ONNX Runtime (rtol 1e-4, atol 1e-5)."""
    rng = np.random.default_rng(0)
    channels, half, size = 116, 58, 14

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype("float32"), name)

    nodes = [
        helper.make_node("Split", ["x", "halves"], ["kept", "branch_in"], axis=1),
        helper.make_node("Conv", ["branch_in", "expand"], ["e"]), helper.make_node("Relu", ["e"], ["e_relu"]),
        helper.make_node("Conv", ["e_relu", "depthwise"], ["d"], group=half, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["d", "project"], ["p"]), helper.make_node("Relu", ["p"], ["p_relu"]),
        helper.make_node("Concat", ["kept", "p_relu"], ["joined"], axis=1),
        helper.make_node("Reshape", ["joined", "grouped_shape"], ["grouped"]),
        helper.make_node("Transpose", ["grouped"], ["swapped"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["swapped", "map_shape"], ["y"])]
    shape = [1, channels, size, size]
    graph = helper.make_graph(
        nodes, "shufflenet_unit", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.array([half, half], "int64"), "halves"),
         weight("expand", half, half, 1, 1), weight("depthwise", half, 1, 3, 3), weight("project", half, half, 1, 1),
         numpy_helper.from_array(np.array([1, 2, half, size, size], "int64"), "grouped_shape"),
         numpy_helper.from_array(np.array(shape, "int64"), "map_shape")])
    path = tmp_path / "shufflenet_unit.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    prepared = api.prepare(path)
    optimized = api.optimize(prepared, tuning_log=False)
    shuffles = [func for gvar, func in optimized.module.functions_items()
                if isinstance(func, tvm.tirx.PrimFunc) and "transpose" in gvar.name_hint]
    assert len(shuffles) == 1
    assert loop_kinds(shuffles[0]).parallel == [channels]
    x = rng.standard_normal(shape).astype("float32")
    vm = relax.VirtualMachine(api.build(optimized.module, prepared.config), tvm.cpu())
    (expected,) = ort_outputs(path, {"x": x}).values()
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), expected, rtol=1e-4, atol=1e-5)


def test_shifted_rows_run_row_by_row(assert_schedule_matches, lanes):
    """A slice along rows of 260 columns (no whole number of vectors of 8 or 16): fused, the
    vectors would straddle rows and gather; row by row, whole vectors and then a tail of 4."""
    funcs = assert_schedule_matches(Injective(), lambda x: strided_slice(x, axes=[2], begin=[3], end=[263]),
                                    x=(2, 40, 300))
    (func,) = funcs.values()
    loops = loop_kinds(func)
    assert loops.vectorized == [lanes, 260 % lanes] and loops.parallel == [2 * 40]


def test_element_wise_rows_keep_the_fused_loop(assert_schedule_matches, lanes):
    """Rows of 260 read as they are written: the fused loop's vectors are contiguous already."""
    funcs = assert_schedule_matches(Injective(), lambda x: add(x, x), x=(2, 40, 260))
    assert_fused_vectors(funcs, lanes, 2 * 40 * 260, blocks=1)
