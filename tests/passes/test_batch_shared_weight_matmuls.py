"""BatchSharedWeightMatmuls: independent matmuls by one constant weight (equal by value) become
one matmul of their stacked rows, with the row-wise epilogue every step shares; a recurrent
chain, another weight, an epilogue that differs or a product read elsewhere is left alone; an
unrolled RNN and a stepped box head match ONNX Runtime and the unfused module."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes.batch_shared_weight_matmuls import BatchSharedWeightMatmuls
from tvm_fusion.patterns.base import PatternReport

# Stated tolerances: float32 matmuls, the stacked one sums in another order.
RTOL, ATOL = 1e-4, 1e-4
WEIGHT = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) / 7
OTHER = WEIGHT + 1


def test_independent_steps_become_one_matmul_of_their_rows():
    """The weight is a separate constant per step (as the importer folds each Gemm's W^T) with
    the same values; the second step's input is defined after the first step is read."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), y: R.Tensor((1, 4), "float32")):
            with R.dataflow():
                a = R.matmul(x, R.const(WEIGHT))
                used = R.tanh(a)
                b_in = R.multiply(y, R.const(2.0, "float32"))
                b = R.matmul(b_in, R.const(WEIGHT.copy()))
                gv = R.add(R.sum(used), R.sum(b))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), y: R.Tensor((1, 4), "float32")):
            with R.dataflow():
                b_in = R.multiply(y, R.const(2.0, "float32"))
                rows = R.concat((x, b_in), axis=0)
                stacked = R.matmul(rows, R.const(WEIGHT))
                a = R.strided_slice(stacked, axes=[0], begin=[0], end=[2], assume_inbound=True)
                b = R.strided_slice(stacked, axes=[0], begin=[2], end=[3], assume_inbound=True)
                used = R.tanh(a)
                gv = R.add(R.sum(used), R.sum(b))
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(BatchSharedWeightMatmuls()(Before), Expected)


def test_must_not_stack_a_recurrent_chain_or_another_weight():
    """``h1 = h0 @ W; h2 = tanh(h1) @ W``: the second input needs the first result. ``x @ W`` and
    ``x @ W'`` share no weight."""

    @I.ir_module
    class Before:
        @R.function
        def main(h0: R.Tensor((1, 4), "float32"), x: R.Tensor((1, 4), "float32")):
            with R.dataflow():
                h1 = R.matmul(h0, R.const(np.eye(4, dtype=np.float32)))
                h2 = R.matmul(R.tanh(h1), R.const(np.eye(4, dtype=np.float32)))
                p = R.matmul(x, R.const(WEIGHT))
                q = R.matmul(x, R.const(OTHER))
                gv = R.add(R.add(R.sum(h2), R.sum(p)), R.sum(q))
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(BatchSharedWeightMatmuls()(Before), Before)


def _unrolled_rnn(steps: int, features: int = 32, hidden: int = 8) -> onnx.ModelProto:
    """h_t = tanh(Gemm(x_t, W_ih, b, transB) + Gemm(h_{t-1}, W_hh, transB)), as torch's legacy
    exporter writes a hand-made cell: each step's input projection is a Gemm of its own."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((hidden, features)).astype(np.float32) * 0.2, "w_ih"),
             numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b_ih"),
             numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.3, "w_hh"),
             numpy_helper.from_array(np.array([0], np.int64), "axis")]
    nodes, state = [], "h_0"
    for t in range(steps):
        inits += [numpy_helper.from_array(np.array([t], np.int64), f"start_{t}"),
                  numpy_helper.from_array(np.array([t + 1], np.int64), f"end_{t}")]
        nodes += [helper.make_node("Slice", ["x", f"start_{t}", f"end_{t}", "axis"], [f"row_{t}"]),
                  helper.make_node("Squeeze", [f"row_{t}", "axis"], [f"x_{t}"]),
                  helper.make_node("Gemm", [f"x_{t}", "w_ih", "b_ih"], [f"in_{t}"], transB=1),
                  helper.make_node("Gemm", [state, "w_hh"], [f"rec_{t}"], transB=1),
                  helper.make_node("Add", [f"in_{t}", f"rec_{t}"], [f"sum_{t}"]),
                  helper.make_node("Tanh", [f"sum_{t}"], [f"h_{t + 1}"])]
        state = f"h_{t + 1}"
    nodes.append(helper.make_node("Concat", [f"h_{t + 1}" for t in range(steps)], ["y"], axis=0))
    graph = helper.make_graph(nodes, "unrolled_rnn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 1, features]),
                               helper.make_tensor_value_info("h_0", TensorProto.FLOAT, [1, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [steps, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_unrolled_rnn_stacks_its_input_projections_and_matches_onnxruntime(tmp_path):
    steps = 7
    model = _unrolled_rnn(steps)
    path = tmp_path / "unrolled_rnn.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    # One call for the 7 input projections; the 7 recurrent ones stay one per step.
    assert _matmul_calls(optimized.module) == steps + 1
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((steps, 1, 32)).astype(np.float32),
              "h_0": rng.standard_normal((1, 8)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)


def _matmul_calls(module) -> int:
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir":
            if "matmul" in expr.args[0].name_hint:
                calls.append(expr)

    relax.analysis.post_order_visit(module["main"], visit)
    return len(calls)


BIAS = np.array([0.5, -1.0, 2.0], np.float32)


def test_a_common_row_wise_epilogue_runs_once_on_the_stacked_rows():
    """Each step's ``sigmoid(x_t @ W + b)``, the bias equal by value: the bias add and the sigmoid
    follow the stacked matmul (the gemm epilogue then fuses them), and the slices take the
    sigmoid's place; the report maps each stacked binding to the steps' own."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), y: R.Tensor((1, 4), "float32")):
            with R.dataflow():
                a = R.matmul(x, R.const(WEIGHT))
                a_bias = R.add(a, R.const(BIAS))
                a_out = R.sigmoid(a_bias)
                b = R.matmul(y, R.const(WEIGHT.copy()))
                b_bias = R.add(b, R.const(BIAS.copy()))
                b_out = R.sigmoid(b_bias)
                gv = R.add(R.sum(a_out), R.sum(b_out))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), y: R.Tensor((1, 4), "float32")):
            with R.dataflow():
                rows = R.concat((x, y), axis=0)
                stacked = R.matmul(rows, R.const(WEIGHT))
                biased = R.add(stacked, R.const(BIAS))
                activated = R.sigmoid(biased)
                a_out = R.strided_slice(activated, axes=[0], begin=[0], end=[2], assume_inbound=True)
                b_out = R.strided_slice(activated, axes=[0], begin=[2], end=[3], assume_inbound=True)
                gv = R.add(R.sum(a_out), R.sum(b_out))
                R.output(gv)
            return gv

    report = PatternReport()
    tvm.ir.assert_structural_equal(BatchSharedWeightMatmuls(report)(Before), Expected)
    assert [(i.output, i.absorbed) for i in report.instances] == [
        ("a_stacked", ["a", "b"]), ("a_bias_stacked", ["a_bias", "b_bias"]), ("a_out_stacked", ["a_out", "b_out"])]


@pytest.mark.parametrize("second_bias, other_reader", [
    (BIAS + 1, False),  # another bias at the second step
    (np.tile(BIAS, (1, 1)), True),  # the same bias, but the product is read by a sum too
])
def test_must_not_stack_an_epilogue_that_differs_or_a_product_read_elsewhere(second_bias, other_reader):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), y: R.Tensor((1, 4), "float32")):
            with R.dataflow():
                a = R.matmul(x, R.const(WEIGHT))
                a_bias = R.add(a, R.const(BIAS))
                b = R.matmul(y, R.const(WEIGHT.copy()))
                b_bias = R.add(b, R.const(second_bias))
                gv = R.add(R.add(R.sum(a_bias), R.sum(b_bias)), R.sum(b) if other_reader else R.const(0.0))
                R.output(gv)
            return gv

    after = BatchSharedWeightMatmuls()(Before)
    adds = [b for b in after["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.add" and b.var.name.endswith("_bias")]
    assert [b.var.name for b in adds] == ["a_bias", "b_bias"]  # per step, after the slices
    assert any(isinstance(b.value, relax.Call) and b.value.op.name == "relax.concat"
               for b in after["main"].body.blocks[0].bindings)  # the matmuls are stacked all the same


def test_must_not_stack_a_bias_that_differs_per_row():
    """A ``[2, 3]`` addend of a two-row step adds another value to each row: not row-wise."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), y: R.Tensor((2, 4), "float32")):
            with R.dataflow():
                a = R.matmul(x, R.const(WEIGHT))
                a_bias = R.add(a, R.const(np.stack([BIAS, -BIAS])))
                b = R.matmul(y, R.const(WEIGHT.copy()))
                b_bias = R.add(b, R.const(np.stack([BIAS, -BIAS])))
                gv = R.add(R.sum(a_bias), R.sum(b_bias))
                R.output(gv)
            return gv

    report = PatternReport()
    BatchSharedWeightMatmuls(report)(Before)
    assert [i.absorbed for i in report.instances] == [["a", "b"]]


def _box_head_steps(steps: int, hidden: int = 16, boxes: int = 4) -> onnx.ModelProto:
    """SLANet's box head in each of ``steps`` independent decoding steps: ``sigmoid(x_t W + b)``."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((hidden, boxes)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(boxes).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([0], np.int64), "axis")]
    nodes = []
    for t in range(steps):
        inits += [numpy_helper.from_array(np.array([t], np.int64), f"start_{t}"),
                  numpy_helper.from_array(np.array([t + 1], np.int64), f"end_{t}")]
        nodes += [helper.make_node("Slice", ["x", f"start_{t}", f"end_{t}", "axis"], [f"x_{t}"]),
                  helper.make_node("MatMul", [f"x_{t}", "w"], [f"m_{t}"], name=f"matmul_{t}"),
                  helper.make_node("Add", [f"m_{t}", "b"], [f"a_{t}"], name=f"bias_{t}"),
                  helper.make_node("Sigmoid", [f"a_{t}"], [f"y_{t}"], name=f"sigmoid_{t}")]
    nodes.append(helper.make_node("Concat", [f"y_{t}" for t in range(steps)], ["y"], axis=0))
    graph = helper.make_graph(nodes, "box_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [steps, boxes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_stacked_box_head_is_one_fused_kernel_credited_to_every_step(tmp_path):
    steps = 6
    model = _box_head_steps(steps)
    path = tmp_path / "box_head.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert _matmul_calls(optimized.module) == 1  # matmul + bias + sigmoid, once for every step
    inputs = {"x": np.random.default_rng(3).standard_normal((steps, 16)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)
    coverage = api.inspect_model(path).coverage
    assert coverage.targeted == {"gemm_epilogue": steps} and coverage.fused == {"gemm_epilogue": steps}
