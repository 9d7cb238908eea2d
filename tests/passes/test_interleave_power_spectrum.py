"""InterleavePowerSpectrum: ``re^2 + im^2`` of a matmul's two column halves becomes the sum of
its even and odd columns' squares, the weight's columns interleaved at build time, the views
on the way composed into one; halves of unequal width, a half read elsewhere, a weight that is
no constant and a sum of unlike squares stay as they are. STFT front ends (two sibling convs;
one conv of both filter sets, sliced, with a magnitude's square root) run the power in the
matmul's kernel and match ONNX Runtime and the unfused module."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes.interleave_power_spectrum import InterleavePowerSpectrum, composed_views, interleaved
from tvm_fusion.patterns import PatternReport

# Stated tolerances: float32 sums of 32-64 products; the engines sum in different orders.
RTOL, ATOL = 1e-4, 1e-4
WEIGHT = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) / 10


def test_interleaved_weight_pairs_each_real_column_with_its_imaginary_one():
    np.testing.assert_array_equal(interleaved(WEIGHT)[:, 0::2], WEIGHT[:, :3])
    np.testing.assert_array_equal(interleaved(WEIGHT)[:, 1::2], WEIGHT[:, 3:])


def test_halves_squared_and_summed_become_even_and_odd_columns():
    """``x ** 2`` and ``x * x`` alike; the sum comes out as ``re^2 + im^2`` in that order."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 8), "float32")):
            with R.dataflow():
                both = R.matmul(x, R.const(WEIGHT))
                re = R.strided_slice(both, axes=[2], begin=[0], end=[3], assume_inbound=True)
                im = R.strided_slice(both, axes=[2], begin=[3], end=[6], assume_inbound=True)
                gv = R.add(R.multiply(im, im), R.power(re, R.const(2.0, "float32")))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 8), "float32")):
            with R.dataflow():
                both = R.matmul(x, R.const(interleaved(WEIGHT)))
                re = R.strided_slice(both, axes=[2], begin=[0], end=[6], strides=[2], assume_inbound=True)
                re_squared = R.multiply(re, re)
                im = R.strided_slice(both, axes=[2], begin=[1], end=[6], strides=[2], assume_inbound=True)
                im_squared = R.multiply(im, im)
                gv = R.add(re_squared, im_squared)
                R.output(gv)
            return gv

    report = PatternReport()
    tvm.ir.assert_structural_equal(InterleavePowerSpectrum(report)(Before), Expected)
    assert report.variants["interleave_power_spectrum.matmul"] == 1


def test_views_before_and_after_the_power_compose_into_one_reshape():
    """openWakeWord's spelling after StridedRowConvAsMatmul: the product transposed to bins x
    frames and given a unit axis before the slices, a unit axis after, and the transpose back
    after the sum: together they keep the element order."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 8), "float32")):
            with R.dataflow():
                both = R.matmul(x, R.const(WEIGHT))
                bins = R.expand_dims(R.permute_dims(both, [0, 2, 1]), [2])
                re = R.expand_dims(R.squeeze(R.strided_slice(bins, axes=[1], begin=[0], end=[3]), [2]), [1])
                im = R.expand_dims(R.squeeze(R.strided_slice(bins, axes=[1], begin=[3], end=[6]), [2]), [1])
                power = R.add(R.multiply(re, re), R.multiply(im, im))
                gv = R.permute_dims(power, [0, 1, 3, 2])
                R.output(gv)
            return gv

    after = InterleavePowerSpectrum()(Before)
    ops = [binding.value.op.name for binding in after["main"].body.blocks[0].bindings]
    assert "relax.permute_dims" not in ops, ops
    assert ops[-1] == "relax.reshape" and list(after["main"].ret_ty.shape) == [1, 1, 4, 3]
    data = np.random.default_rng(0).standard_normal((1, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(helpers.run_lowered(after, data), helpers.run_lowered(Before, data))


def test_composed_views_name_a_transpose_the_chain_keeps():
    transpose, shape = composed_views((1, 4, 3), [R.permute_dims(R.const(np.zeros((1, 4, 3), "float32")), [0, 2, 1])])
    assert transpose == [1, 0] and shape == (1, 3, 4)


def _before(kind: str) -> tvm.IRModule:
    bb = tvm.relax.BlockBuilder()
    x = tvm.relax.Var("x", tvm.relax.TensorType((1, 3 if kind == "unlike views" else 4, 8), "float32"))
    weight = tvm.relax.Var("w", tvm.relax.TensorType((8, 6), "float32"))
    with bb.function("main", [x, weight]):
        with bb.dataflow():
            both = bb.emit(R.matmul(x, weight if kind == "weight is a parameter" else R.const(WEIGHT)))
            split = 2 if kind == "unequal halves" else 3
            if kind == "unlike views":  # the real half sliced from the transposed product: 3 x 3 as well
                flipped = bb.emit(R.permute_dims(both, [0, 2, 1]))
                re = bb.emit(R.strided_slice(flipped, axes=[1], begin=[0], end=[3]))
            else:
                re = bb.emit(R.strided_slice(both, axes=[2], begin=[0], end=[split]))
            im = bb.emit(R.strided_slice(both, axes=[2], begin=[split], end=[6]))
            if split != 3:
                im = bb.emit(R.strided_slice(im, axes=[2], begin=[0], end=[2]))
            other = re if kind == "unlike squares" else im
            power = bb.emit(R.add(R.multiply(re, re), R.multiply(im, other)))
            outputs = [power, re] if kind == "a half is read elsewhere" else [power]
            out = bb.emit_output(tvm.relax.Tuple(outputs) if len(outputs) > 1 else power)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("kind", ["unequal halves", "a half is read elsewhere", "weight is a parameter",
                                  "unlike squares", "unlike views"])
def test_must_not_interleave(kind):
    before = _before(kind)
    report = PatternReport()
    tvm.ir.assert_structural_equal(InterleavePowerSpectrum(report)(before), before)
    assert not report.variants


def _stft_model(separate_convs: bool, magnitude: bool, samples: int = 200, taps: int = 32, hop: int = 8,
                bins: int = 32) -> onnx.ModelProto:
    """An STFT front end as exporters write it: two Conv1d (real and imaginary filters, the
    torchlibrosa/openWakeWord spelling) or one of both filter sets sliced by channel (silero
    VAD's ``forward_basis``); each part squared, summed, optionally its square root, then a
    mel-like MatMul over the bins (frames x bins after a Transpose)."""
    rng = np.random.default_rng(0)
    filters = rng.standard_normal((2 * bins, 1, taps)).astype(np.float32) * 0.2
    inits = [numpy_helper.from_array(np.abs(rng.standard_normal((bins, 6))).astype(np.float32), "mel"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("Unsqueeze", ["x", "axis1"], ["signal"])]
    if separate_convs:
        inits += [numpy_helper.from_array(filters[:bins], "w_re"), numpy_helper.from_array(filters[bins:], "w_im")]
        nodes += [helper.make_node("Conv", ["signal", f"w_{part}"], [f"c_{part}"], kernel_shape=[taps], strides=[hop])
                  for part in ("re", "im")]
    else:
        inits += [numpy_helper.from_array(filters, "basis"),
                  *(numpy_helper.from_array(np.array([v], np.int64), name)
                    for name, v in (("zero", 0), ("half", bins), ("full", 2 * bins)))]
        nodes += [helper.make_node("Conv", ["signal", "basis"], ["both"], kernel_shape=[taps], strides=[hop]),
                  helper.make_node("Slice", ["both", "zero", "half", "axis1"], ["c_re"]),
                  helper.make_node("Slice", ["both", "half", "full", "axis1"], ["c_im"])]
    nodes += [helper.make_node("Pow", ["c_re", "two"], ["p_re"]),
              helper.make_node("Mul", ["c_im", "c_im"], ["p_im"]),
              helper.make_node("Add", ["p_re", "p_im"], ["power"])]
    last = "power"
    if magnitude:
        nodes.append(helper.make_node("Sqrt", ["power"], ["magnitude"]))
        last = "magnitude"
    nodes += [helper.make_node("Transpose", [last], ["frames"], perm=[0, 2, 1]),
              helper.make_node("MatMul", ["frames", "mel"], ["y"])]
    frames = (samples - taps) // hop + 1
    graph = helper.make_graph(nodes, "stft", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, samples])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, frames, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("separate_convs, magnitude", [(True, False), (False, True)])
def test_stft_power_runs_in_the_matmul_kernel_and_matches_onnxruntime(tmp_path, separate_convs, magnitude):
    """64 columns pack into whole panels on AVX2 and AVX-512 alike: the power reads its column
    pairs across the packed panel, and the kernel computes it after the tiles."""
    model = _stft_model(separate_convs, magnitude)
    path = tmp_path / "stft.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert optimized.report.variants["interleave_power_spectrum.matmul"] == 1
    variant = "power_spectrum.matmul_even_odd_squares" + ("_elementwise" if magnitude else "")
    assert optimized.report.variants[variant] == 1, optimized.report.variants
    kernel = next(name for name in optimized.schedule_rules if "strided_slice" in name)
    assert optimized.schedule_rules[kernel] == "MatmulEpilogue", optimized.schedule_rules
    assert kernel.endswith("_elementwise") == magnitude  # the square root joins as the tail
    assert not [name for name in optimized.schedule_rules if "sqrt" in name or "power" in name]
    inputs = {"x": np.random.default_rng(1).standard_normal((1, 200)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)


def test_slices_that_name_every_axis_are_halves():
    """silero VAD's spelling: each slice names all axes, the others whole (ends past the extent)."""
    big = 9223372036854775807

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 8), "float32")):
            with R.dataflow():
                both = R.permute_dims(R.matmul(x, R.const(WEIGHT)), [0, 2, 1])
                re = R.strided_slice(both, axes=[0, 1, 2], begin=[0, 0, 0], end=[big, 3, big])
                im = R.strided_slice(both, axes=[0, 1, 2], begin=[0, 3, 0], end=[big, big, big])
                gv = R.sqrt(R.add(R.power(re, R.const(2.0, "float32")), R.power(im, R.const(2.0, "float32"))))
                R.output(gv)
            return gv

    report = PatternReport()
    after = InterleavePowerSpectrum(report)(Before)
    assert report.variants["interleave_power_spectrum.matmul"] == 1
    data = np.random.default_rng(0).standard_normal((1, 4, 8)).astype(np.float32)
    np.testing.assert_allclose(helpers.run_lowered(after, data), helpers.run_lowered(Before, data), rtol=1e-6)
