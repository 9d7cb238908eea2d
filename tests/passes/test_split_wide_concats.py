"""SplitWideConcats: a concat or stack of more than CHUNK tensors becomes chunks of at most
CHUNK, joined by a concat that FuseOps keeps apart, so no kernel takes hundreds of buffers."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax, topi
from tvm.script import relax as R

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes import split_wide_concats
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.passes.split_wide_concats import CHUNK, SplitWideConcats


def _concat_module(count: int, op=relax.op.concat, axis: int = 0) -> tvm.IRModule:
    """``op`` over ``count`` sums of separate inputs, as an unrolled decoder's steps (each its own
    kernel's output) feed a concat: without the split, one kernel of ``count`` + 1 buffers."""
    bb = relax.BlockBuilder()
    steps = [relax.Var(f"step{index}", R.Tensor((1, 4), "float32")) for index in range(count)]
    with bb.function("main", steps):
        with bb.dataflow():
            sums = [bb.emit(relax.op.add(step, relax.const(float(index), "float32"))) for index, step in enumerate(steps)]
            out = bb.emit_output(op(sums, axis))
        bb.emit_func_output(out)
    return bb.get()


def _widest_kernel(mod: tvm.IRModule) -> int:
    return max(len(f.params) for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))


def test_a_wide_concat_becomes_chunks_joined_by_an_opaque_concat(monkeypatch):
    monkeypatch.setattr(split_wide_concats, "CHUNK", 2)
    a, b, c, d = (relax.Var(name, R.Tensor((1, 3), "float32")) for name in "abcd")

    def function(body):
        bb = relax.BlockBuilder()
        with bb.function("main", [a, b, c, d]):
            with bb.dataflow():
                out = bb.emit_output(body(bb))
            bb.emit_func_output(out)
        return bb.get()

    before = function(lambda bb: relax.op.concat([a, b, c, d], 1))

    def expected_body(bb):
        first = bb.emit(relax.op.concat([a, b], 1))
        second = bb.emit(relax.op.concat([c, d], 1))
        call = bb.call_te(lambda *ts: topi.concatenate(ts, 1), first, second, primfunc_name_hint="concatenate_chunks")
        bb.update_func(call.args[0], bb.get()[call.args[0]].with_attr("op_pattern", 8))
        return call

    after = SplitWideConcats()(before)
    tvm.ir.assert_structural_equal(after, function(expected_body))
    assert len(before.get_global_vars()) == 1  # a new module: the caller keeps the old one


def test_must_not_split_a_concat_of_chunk_size():
    before = _concat_module(CHUNK)
    tvm.ir.assert_structural_equal(SplitWideConcats()(before), before)


@pytest.mark.parametrize("count", [5, 21])
def test_no_kernel_takes_more_than_a_chunk_and_the_values_are_the_same(monkeypatch, count):
    """Each chunk takes what its fused producers read (here two slices' sources), the joining
    concat one buffer per chunk, a tree of them past CHUNK * CHUNK inputs (21 with CHUNK 4:
    without the tree the joining concat would take 6 buffers and the output)."""
    monkeypatch.setattr(split_wide_concats, "CHUNK", 4)
    before = _concat_module(count)
    lowered = tvm.transform.Sequential(lowering_passes())(before)
    assert _widest_kernel(lowered) <= 4 + 1
    steps = np.random.default_rng(count).standard_normal((count, 1, 4), dtype=np.float32)
    expected = np.concatenate([step + index for index, step in enumerate(steps)])
    np.testing.assert_array_equal(helpers.run_lowered(before, *steps), expected)  # exact: data movement


def test_a_wide_stack_splits_along_the_stacked_axis():
    count = CHUNK + 8
    before = _concat_module(count, relax.op.stack, axis=1)
    lowered = tvm.transform.Sequential(lowering_passes())(before)
    assert _widest_kernel(lowered) <= CHUNK + 1
    steps = np.random.default_rng(0).standard_normal((count, 1, 4), dtype=np.float32)
    expected = np.stack([step + index for index, step in enumerate(steps)], 1)
    np.testing.assert_array_equal(helpers.run_lowered(before, *steps), expected)


def test_a_wide_onnx_concat_matches_onnx_runtime(tmp_path):
    """An ONNX Concat of 40 step outputs, each a matmul by its own weight (its own kernel):
    without the split, the concat's kernel takes 41 buffers."""
    steps = CHUNK + 8
    nodes, outputs = [], []
    for step in range(steps):
        nodes += [helper.make_node("Slice", ["x", f"s{step}", f"e{step}", "axis"], [f"row{step}"]),
                  helper.make_node("MatMul", [f"row{step}", f"w{step}"], [f"sum{step}"]),
                  helper.make_node("Tanh", [f"sum{step}"], [f"h{step}"])]
        outputs.append(f"h{step}")
    nodes.append(helper.make_node("Concat", outputs, ["y"], axis=1))
    inits = [helper.make_tensor("axis", TensorProto.INT64, [1], [1])]
    for step in range(steps):
        inits += [helper.make_tensor(f"w{step}", TensorProto.FLOAT, [8, 8], np.linspace(-1, 1, 64) * (step + 1) / steps),
                  helper.make_tensor(f"s{step}", TensorProto.INT64, [1], [step]),
                  helper.make_tensor(f"e{step}", TensorProto.INT64, [1], [step + 1])]
    graph = helper.make_graph(nodes, "wide_concat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, steps, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, steps, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "wide_concat.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert _widest_kernel(optimized.module) <= CHUNK + 1
    inputs = {"x": np.random.default_rng(2).standard_normal((2, steps, 8)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, 1e-5, 1e-6)
