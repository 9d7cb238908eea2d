"""Bf16Activations: a float32 tensor that only bf16 roundings read is written and read as bf16
bits; the results are bit for bit those of the float32 tensor."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
import tvm_ffi
from machine import host_target
from tvm import relax, te, tirx
from tvm.ir.expr import TensorLoad

from tvm_fusion.config import load_config
from tvm_fusion.frontend.bf16_matmul import bf16_bits
from tvm_fusion.kernels.cpu_features import has_bf16_kernels
from tvm_fusion.commands.profile.build import with_copies
from tvm_fusion.kernels.costs import param_bytes
from tvm_fusion.passes.bf16_activations import SUFFIX, Bf16Activations, copied_from
from tvm_fusion.passes import pipeline
from tvm_fusion.passes.pipeline import fusion_pipeline
from tvm_fusion.patterns import PatternReport

from test_bf16_matmuls import cnn_model

SHAPE = (4, 8)
HOST = tvm.target.Target(host_target())
AMX = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}


def writer_kernel(narrow: bool = False) -> tirx.PrimFunc:
    """The writer: ReLU of a matmul (a float32 conv stands in: a contraction summed in a buffer
    of its own), stored as float32 or (``narrow``) as its bf16 bits, the value bound once."""
    x, w = te.placeholder(SHAPE, "float32", "x"), te.placeholder((SHAPE[1], SHAPE[1]), "float32", "w")
    k = te.reduce_axis((0, SHAPE[1]), "k")
    summed = te.compute(SHAPE, lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="sum")

    def value(i, j):
        relu = te.max(summed[i, j], tirx.const(0, "float32"))
        if not narrow:
            return relu
        bound = tirx.Var("value", "float32")
        return tirx.Let(bound, relu, bf16_bits(bound))

    return te.create_prim_func([x, w, te.compute(SHAPE, value, name="relu")])


WEIGHT = relax.const(np.eye(SHAPE[1], dtype=np.float32) * 0.5)


def rounding_kernel(narrow: bool = False, nan_test: bool = False) -> tirx.PrimFunc:
    """The reader: a bf16 kernel's prologue, its input rounded to bf16 bits and widened back by
    a shift (the product stands in), or (``narrow``) the bits loaded as they are. The rounding
    is as TVM's simplifier leaves it in a scheduled kernel (without ``bf16_bits``'s NaN test),
    or with that test kept (``nan_test``)."""
    x = te.placeholder(SHAPE, "uint16" if narrow else "float32", "x")
    out = te.compute(SHAPE, lambda i, j: (x[i, j] if narrow else bf16_bits(x[i, j])).astype("uint32")
                     << tirx.const(16, "uint32"), name="widened")
    func = te.create_prim_func([x, out])
    if not nan_test:
        return func

    def tested(cast: tirx.Cast):
        loads: list = []
        tvm_ffi.structural_walk(cast, (TensorLoad, loads.append))
        if loads and tvm_ffi.structural_equal(cast, bf16_bits(loads[0]).false_value):
            return bf16_bits(loads[0])
        return cast

    return tvm_ffi.structural_map(func, [(tirx.Cast, tested)])


def add_kernel() -> tirx.PrimFunc:
    x = te.placeholder(SHAPE, "float32", "x")
    return te.create_prim_func([x, te.compute(SHAPE, lambda i, j: x[i, j] + tirx.const(1, "float32"), name="add")])


def module(kernels: dict, calls) -> tvm.IRModule:
    """``main(x)``: ``calls`` (the builder, the kernels' GlobalVars and x -> its result) over
    ``kernels`` (name -> PrimFunc)."""
    bb = relax.BlockBuilder()
    gvars = {name: bb.add_func(func.without_attr("global_symbol"), name) for name, func in kernels.items()}
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(calls(bb, gvars, x))
        bb.emit_func_output(out)
    return bb.get()


def relu_then_rounding(bb, k, x):
    relu = bb.emit(relax.call_tir(k["relu"], [x, WEIGHT], relax.TensorType(SHAPE, "float32")))
    return relax.call_tir(k["rounding"], [relu], relax.TensorType(SHAPE, "uint32"))


@pytest.mark.parametrize("nan_test", [False, True], ids=["simplified", "with-nan-test"])
def test_a_tensor_only_a_rounding_reads_is_written_as_bf16(nan_test):
    """The writer rounds (``bf16_bits``, which lowering simplifies as it does the reader's) and
    stores uint16; the reader loads them."""
    before = module({"relu": writer_kernel(), "rounding": rounding_kernel(nan_test=nan_test)}, relu_then_rounding)
    assert "T.Select" in before["rounding"].script() if nan_test else "T.Select" not in before["rounding"].script()

    def expected_calls(bb, k, x):
        relu = bb.emit(relax.call_tir(k["relu"], [x, WEIGHT], relax.TensorType(SHAPE, "uint16")))
        return relax.call_tir(k["rounding"], [relu], relax.TensorType(SHAPE, "uint32"))

    expected = module({"relu": writer_kernel(narrow=True), "rounding": rounding_kernel(narrow=True)}, expected_calls)
    simplify = tirx.transform.StmtSimplify()
    tvm.ir.assert_structural_equal(simplify(Bf16Activations()(before)), simplify(expected))


def test_the_results_are_bit_for_bit_the_float32_tensors():
    """Run on the host (integer ops only): NaN, infinities, signed zeros, subnormals, ties of
    the rounding and values past bf16's range give the very bits the float32 tensor gave."""
    values = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8,
                       3.4e38, -3.4e38, 1.00390625, 2.0, -7.5, 1e-3, 65504.0] * 2, np.float32).reshape(SHAPE)
    for nan_test in (False, True):
        before = module({"relu": writer_kernel(), "rounding": rounding_kernel(nan_test=nan_test)},
                        relu_then_rounding)
        results = []
        for mod in (before, Bf16Activations()(before)):
            vm = relax.VirtualMachine(tvm.compile(mod, target=HOST), tvm.cpu())
            results.append(vm["main"](tvm.runtime.tensor(values)).numpy())
        np.testing.assert_array_equal(results[0], results[1])
    assert np.abs(results[0]).max() > 0


def test_must_not_narrow_a_tensor_a_float32_kernel_reads_too():
    """A residual add reads the ReLU's output as well: it stays float32."""
    def calls(bb, k, x):
        relu = bb.emit(relax.call_tir(k["relu"], [x, WEIGHT], relax.TensorType(SHAPE, "float32")))
        rounded = bb.emit(relax.call_tir(k["rounding"], [relu], relax.TensorType(SHAPE, "uint32")))
        added = bb.emit(relax.call_tir(k["add"], [relu], relax.TensorType(SHAPE, "float32")))
        return relax.Tuple([rounded, added])

    before = module({"relu": writer_kernel(), "rounding": rounding_kernel(), "add": add_kernel()}, calls)
    tvm.ir.assert_structural_equal(Bf16Activations()(before), before)


def test_must_not_narrow_a_model_output_or_a_tensor_read_otherwise():
    def output(bb, k, x):
        return relax.call_tir(k["relu"], [x, WEIGHT], relax.TensorType(SHAPE, "float32"))

    def reshaped(bb, k, x):
        relu = bb.emit(relax.call_tir(k["relu"], [x, WEIGHT], relax.TensorType(SHAPE, "float32")))
        rounded = bb.emit(relax.call_tir(k["rounding"], [relu], relax.TensorType(SHAPE, "uint32")))
        return relax.Tuple([rounded, relax.op.reshape(relu, (32,))])

    for calls in (output, reshaped):
        before = module({"relu": writer_kernel(), "rounding": rounding_kernel()}, calls)
        tvm.ir.assert_structural_equal(Bf16Activations()(before), before)


def test_must_not_narrow_what_an_elementwise_kernel_writes():
    """Only a float32 conv or matmul (a contraction, no AMX tiles) writes bf16 maps: an
    elementwise writer's rounding, its loop of selects and casts, ran slower than its float32
    stores saved (basic-pitch's harmonic stacking)."""
    def calls(bb, k, x):
        added = bb.emit(relax.call_tir(k["add"], [x], relax.TensorType(SHAPE, "float32")))
        return relax.call_tir(k["rounding"], [added], relax.TensorType(SHAPE, "uint32"))

    before = module({"add": add_kernel(), "rounding": rounding_kernel()}, calls)
    tvm.ir.assert_structural_equal(Bf16Activations()(before), before)


def test_must_not_narrow_a_sum_accumulated_in_its_output():
    """A writer that reads its output back (partial sums in it) keeps it float32."""
    x = te.placeholder(SHAPE, "float32", "x")
    k = te.reduce_axis((0, SHAPE[1]), "k")
    summed = te.compute(SHAPE, lambda i, j: te.sum(x[i, k] * x[k % SHAPE[0], j], axis=k), name="sum")
    before = module({"relu": te.create_prim_func([x, summed]), "rounding": rounding_kernel()}, relu_then_rounding)
    tvm.ir.assert_structural_equal(Bf16Activations()(before), before)


def test_a_kernel_called_with_and_without_a_narrowed_tensor_is_copied():
    """The rounding kernel reads the ReLU's output (narrowed) and the model's input (not): the
    first call takes a copy (``_bf16``), which the schedule log names under its kernel's rule."""
    def calls(bb, k, x):
        relu = bb.emit(relax.call_tir(k["relu"], [x, WEIGHT], relax.TensorType(SHAPE, "float32")))
        first = bb.emit(relax.call_tir(k["rounding"], [relu], relax.TensorType(SHAPE, "uint32")))
        second = bb.emit(relax.call_tir(k["rounding"], [x], relax.TensorType(SHAPE, "uint32")))
        return relax.Tuple([first, second])

    log = {"rounding": "SomeRule", "relu": "Other"}
    after = Bf16Activations(log)(module({"relu": writer_kernel(), "rounding": rounding_kernel()}, calls))
    names = {gvar.name_hint: func for gvar, func in after.functions_items() if isinstance(func, tirx.PrimFunc)}
    assert set(names) == {"relu", "rounding", "rounding" + SUFFIX}
    assert str(names["rounding" + SUFFIX].params[0].dtype) == "uint16"
    assert str(names["rounding"].params[0].dtype) == "float32"
    assert log["rounding" + SUFFIX] == "SomeRule"


def bf16_cnn(target: dict) -> tvm.IRModule:
    """``cnn_model`` through the whole pipeline at bf16 for ``target`` (a target JSON dict)."""
    config = dataclasses.replace(load_config(None), precision="bf16", target=target)
    return fusion_pipeline(config, PatternReport())(relax.frontend.onnx.from_onnx(cnn_model()))


def test_a_bf16_cnns_maps_between_its_convs_travel_as_bf16():
    """The small CNN on AMX: the float32 RGB stem's output feeds only the first 3x3 conv's
    rounding (as bf16); the 3x3 convs, on AMX tiles, keep their outputs float32 (a tile kernel
    that rounded its epilogue ran slower: nudenet-yolov8n's), and the last feeds the float32
    depthwise conv."""
    mod = bf16_cnn(AMX)
    assert len(bf16_writers(mod)) == 1, bf16_writers(mod)
    assert str(mod["main"].ret_ty.dtype) == "float32"


def bf16_writers(mod: tvm.IRModule) -> list[str]:
    """The kernels whose output is bf16 bits (a packed weight is uint16 too, but an input)."""
    return [gvar.name_hint for gvar, func in mod.functions_items()
            if isinstance(func, tirx.PrimFunc) and str(func.params[-1].dtype) == "uint16"]


@pytest.mark.skipif(not has_bf16_kernels(HOST), reason="the host has neither AMX-BF16 nor AVX512_BF16: no bf16 "
                    "kernels to narrow between (the pass itself is run on the host above)")
def test_a_bf16_cnn_gives_the_same_bits_with_its_maps_as_bf16(monkeypatch):
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)
    results = []
    for narrowing in (True, False):
        if not narrowing:
            monkeypatch.setattr(pipeline, "Bf16Activations", lambda log=None: tvm.transform.Sequential([]))
        mod = bf16_cnn(host_target())
        assert bool(bf16_writers(mod)) == narrowing
        vm = relax.VirtualMachine(tvm.compile(mod, target=HOST), tvm.cpu())
        results.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(results[0], results[1])
    assert np.abs(results[0]).max() > 0


@pytest.mark.parametrize("name, original", [("conv_bf16", "conv"), ("conv_bf162", "conv"), ("conv", "conv"),
                                            ("conv_bf16x", "conv_bf16x"), ("my_bf16_conv", "my_bf16_conv")])
def test_a_copys_name_leads_back_to_its_kernel(name, original):
    assert copied_from(name) == original


def test_profile_counts_a_copy_as_its_kernel_and_its_bytes_as_it_runs():
    """profile's lowered module gets the copy under its name (FLOPs, pattern, ONNX nodes of the
    original), and each kernel's bytes are those of the kernel as it runs (bf16 maps: 2 bytes)."""
    def calls(bb, k, x):
        relu = bb.emit(relax.call_tir(k["relu"], [x, WEIGHT], relax.TensorType(SHAPE, "float32")))
        first = bb.emit(relax.call_tir(k["rounding"], [relu], relax.TensorType(SHAPE, "uint32")))
        second = bb.emit(relax.call_tir(k["rounding"], [x], relax.TensorType(SHAPE, "uint32")))
        return relax.Tuple([first, second])

    lowered = module({"relu": writer_kernel(), "rounding": rounding_kernel()}, calls)
    scheduled = Bf16Activations()(lowered)
    patterns, covers = {"rounding": "some_pattern"}, {"rounding": ["Conv@3"]}
    with_copy = with_copies(lowered, scheduled, patterns, covers)
    names = {gvar.name_hint for gvar, _ in with_copy.functions_items()}
    assert "rounding" + SUFFIX in names
    assert patterns["rounding" + SUFFIX] == "some_pattern" and covers["rounding" + SUFFIX] == ["Conv@3"]
    copy = next(f for g, f in scheduled.functions_items() if g.name_hint == "rounding" + SUFFIX)
    original = next(f for g, f in scheduled.functions_items() if g.name_hint == "rounding")
    assert param_bytes(original) - param_bytes(copy) == 2 * SHAPE[0] * SHAPE[1]
