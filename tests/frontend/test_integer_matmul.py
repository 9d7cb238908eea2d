"""The int8 matmul kernel (frontend/integer_matmul.py; its schedule: schedules/cpu/test_int8_matmul_vnni.py):
exact against ONNX Runtime through the whole pipeline at odd shapes, on the host (the int8
kernel where the host has AVX512-VNNI, the float32 products elsewhere), and where the import
must not emit it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from machine import host_target
from onnx import helper, numpy_helper
from tvm import relax

from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.frontend.integer_matmul import int8_weight, pack_weight
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.session import ModelSession
from tvm_fusion.kernels.cpu_features import has_vnni
from tvm_fusion.verify import reference_outputs

MS = "com.microsoft"
HOST = tvm.target.Target(host_target())
VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
NO_VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "znver1", "num-cores": 2})
host_vnni = pytest.mark.skipif(not has_vnni(HOST), reason="the host CPU has no AVX512-VNNI")


def finish(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "q", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def tensor(name: str, dtype, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)


def integers(rng, dtype, shape) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, int(info.max) + 1, shape, dtype=dtype)


def qlinear_matmul(m: int, k: int, n: int, activation, weight, per_channel: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    b = integers(rng, weight, (k, n))
    b_scale = rng.uniform(0.002, 0.01, n if per_channel else ()).astype(np.float32)
    b_zp = (rng.integers(-5, 5, n if per_channel else ()).astype(weight) if weight == np.int8
            else np.full(n if per_channel else (), 121, weight))
    y_zp = np.array(7 if activation == np.int8 else 128, activation)
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"], name="qmm")
    # the output scale keeps the requantized values spread over the range at every K
    y_scale = np.float32(0.0173 * 0.006 * np.sqrt(k) * 300)
    model = finish([node], [tensor("a", activation, [m, k])], [tensor("y", activation, [m, n])],
                   [const("sa", np.float32(0.0173)), const("za", np.array(3, activation)), const("b", b),
                    const("sb", b_scale), const("zb", b_zp), const("sy", y_scale), const("zy", y_zp)])
    return model, {"a": integers(rng, activation, (m, k))}


def matmul_integer(m: int, k: int, n: int, activation, weight, seed: int = 0):
    rng = np.random.default_rng(seed)
    node = helper.make_node("MatMulInteger", ["a", "b", "za", "zb"], ["y"], name="mmi")
    model = finish([node], [tensor("a", activation, [1, m, k])], [tensor("y", np.int32, [1, m, n])],
                   [const("b", integers(rng, weight, (k, n))), const("za", np.array(9, activation)),
                    const("zb", np.array(-2 if weight == np.int8 else 200, weight))])
    return model, {"a": integers(rng, activation, (1, m, k))}


def compiled(model: onnx.ModelProto, feeds: dict, tmp_path):
    """The model through the whole pipeline, for the host: (VM, kernel -> schedule rule)."""
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    session = ModelSession(path, [f"{name}:{'x'.join(map(str, v.shape))}" for name, v in feeds.items()])
    scheduled = session.scheduled()
    vm = relax.VirtualMachine(session.built(), tvm.cpu())
    return vm, scheduled.schedule_rules


def assert_int8_kernels(rules: dict) -> None:
    """With VNNI on the host, every int8 kernel scheduled by Int8MatmulVnni or, where the host
    has AMX tiles, Int8MatmulAmx (none left to the general rules, which would run it as naive
    loops); without, no int8 kernel at all."""
    int8 = {name: rule for name, rule in rules.items() if "int8_matmul" in name}
    if has_vnni(HOST):
        assert int8 and set(int8.values()) <= {"Int8MatmulAmx", "Int8MatmulVnni"}, rules
    else:
        assert not int8, rules


def assert_equal_to_onnxruntime(model, feeds, tmp_path) -> dict:
    vm, rules = compiled(model, feeds, tmp_path)
    got = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()]).numpy()
    (expected,) = reference_outputs(model, feeds).values()
    assert got.dtype == expected.dtype
    assert len(np.unique(expected)) > min(10, expected.size // 2)  # a spread: the check means something
    np.testing.assert_array_equal(got, expected)
    return rules


SHAPES = [(1, 13, 3), (7, 64, 17), (33, 100, 64)]


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("activation, weight, per_channel", [
    (np.uint8, np.int8, True), (np.uint8, np.uint8, False), (np.uint8, np.int8, False)])
def test_qlinear_matmul_equals_onnxruntime(tmp_path, m, k, n, activation, weight, per_channel):
    model, feeds = qlinear_matmul(m, k, n, activation, weight, per_channel)
    rules = assert_equal_to_onnxruntime(model, feeds, tmp_path)
    assert_int8_kernels(rules)


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("activation, weight", [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8)])
def test_matmul_integer_equals_onnxruntime(tmp_path, m, k, n, activation, weight):
    model, feeds = matmul_integer(m, k, n, activation, weight)
    rules = assert_equal_to_onnxruntime(model, feeds, tmp_path)
    assert_int8_kernels(rules)


@host_vnni
def test_sums_beyond_float32_precision_are_exact(tmp_path):
    """K = 1024 products of 255 * -128: the int32 sum ONNX Runtime computes, where float32
    partial sums above 2^24 would round (only the int8 kernel is exact there)."""
    k = 1024
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"], name="mmi")
    rng = np.random.default_rng(3)
    weights = np.full((k, 5), -128, np.int8)
    weights[::7] = integers(rng, np.int8, weights[::7].shape)
    model = finish([node], [tensor("a", np.uint8, [2, k])], [tensor("y", np.int32, [2, 5])], [const("b", weights)])
    feeds = {"a": np.full((2, k), 255, np.uint8)}
    feeds["a"][1, ::3] = 1
    vm, rules = compiled(model, feeds, tmp_path)
    got = vm["main"](tvm.runtime.tensor(feeds["a"])).numpy()
    expected = feeds["a"].astype(np.int64) @ weights.astype(np.int64)
    assert np.abs(expected).max() > 1 << 24
    assert_int8_kernels(rules)
    np.testing.assert_array_equal(got, expected)


def test_weight_offsets_are_exact():
    """Every int8 column as is; a column of ``w - w_zp`` past int8 shifted by a constant."""
    centered = np.stack([np.arange(-128, 128), np.arange(-121, 135), np.arange(0, 256)], axis=1)
    shifted, shift = int8_weight(centered)
    assert shifted.dtype == np.int8 and list(shift) == [0, 7, 128]
    np.testing.assert_array_equal(shifted.astype(np.int32) + shift, centered)
    packed = pack_weight(shifted[:13, :3])  # K 13 -> 16, N 3 -> 16, zero-padded
    assert packed.shape == (1, 4, 16, 4)
    assert packed[0, 3, 2, 0] == shifted[12, 2] and packed[0, 3, 2, 1] == 0 and packed[0, 0, 5, 0] == 0


def test_must_not_emit_the_kernel_without_vnni():
    """znver1 (AVX2, no VNNI): the import keeps the float32 products (no int8 kernel, no
    ``vpdpbusd`` in the code); schedules/cpu/test_int8_matmul_vnni.py has the rule's side."""
    assert not has_vnni(NO_VNNI) and has_vnni(VNNI)
    model, _ = qlinear_matmul(7, 64, 17, np.uint8, np.int8, True)
    with NO_VNNI:
        module = onnx_frontend.import_model(model, [onnx_frontend.TensorSpec("a", (7, 64), "uint8")])
    lowered = tvm.transform.Sequential(lowering_passes())(module)
    assert not any("int8_matmul" in gv.name_hint for gv in lowered.get_global_vars())
    (kernels,) = tvm.compile(lowered, target=NO_VNNI).mod.imports  # the llvm module of the kernels
    assert "vpdpbusd" not in kernels.inspect_source("s")


def test_static_leading_axes_are_one_row_axis_of_the_kernel():
    """A [steps, batch, K] activation (an LSTM's input projection) is steps * batch rows of one
    kernel, so that the AMX tiles see them all, and comes back in its own shape."""
    rng = np.random.default_rng(5)
    node = helper.make_node("MatMulInteger", ["a", "b", "za", "zb"], ["y"], name="mmi")
    model = finish([node], [tensor("a", np.uint8, [6, 1, 32])], [tensor("y", np.int32, [6, 1, 16])],
                   [const("b", integers(rng, np.int8, (32, 16))), const("za", np.uint8(7)), const("zb", np.int8(0))])
    with VNNI:
        module = onnx_frontend.import_model(model, [onnx_frontend.TensorSpec("a", (6, 1, 32), "uint8")])
    (kernel,) = [gv for gv in module.get_global_vars() if gv.name_hint == "int8_matmul"]
    calls = [binding.value for block in module["main"].body.blocks for binding in block.bindings
             if isinstance(binding.value, relax.Call) and kernel.same_as(binding.value.args[0])]
    assert [[int(d) for d in call.ty.shape] for call in calls] == [[6, 16]]
    assert [int(d) for d in module["main"].body.ty.shape] == [6, 1, 16]


def test_must_not_apply_to_a_weight_computed_at_run_time():
    """QLinearMatMul whose B is a graph input: no constant to pack, float32 products."""
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"], name="qmm")
    model = finish([node], [tensor("a", np.uint8, [4, 8]), tensor("b", np.int8, [8, 16])],
                   [tensor("y", np.uint8, [4, 16])],
                   [const("sa", np.float32(0.02)), const("za", np.uint8(3)), const("sb", np.float32(0.01)),
                    const("zb", np.int8(0)), const("sy", np.float32(0.1)), const("zy", np.uint8(128))])
    specs = [onnx_frontend.TensorSpec("a", (4, 8), "uint8"), onnx_frontend.TensorSpec("b", (8, 16), "int8")]
    with VNNI:
        module = onnx_frontend.import_model(model, specs)
    lowered = tvm.transform.Sequential(lowering_passes())(module)
    assert not any("int8_matmul" in gv.name_hint for gv in lowered.get_global_vars())


@host_vnni
def test_dynamic_quantize_matmul_equals_onnxruntime_on_the_int8_kernel(tmp_path):
    """A zero point computed at run time (DynamicQuantizeLinear's) in the kernel's correction."""
    rng = np.random.default_rng(4)
    k, n = 100, 17
    node = helper.make_node("DynamicQuantizeMatMul", ["a", "b", "sb", "zb"], ["y"], name="dqmm", domain=MS)
    model = finish([node], [tensor("a", np.float32, [7, k])], [tensor("y", np.float32, [7, n])],
                   [const("b", integers(rng, np.int8, (k, n))), const("sb", np.float32(0.004)),
                    const("zb", np.int8(0))])
    feeds = {"a": rng.standard_normal((7, k)).astype(np.float32)}
    vm, rules = compiled(model, feeds, tmp_path)
    got = vm["main"](tvm.runtime.tensor(feeds["a"])).numpy()
    assert_int8_kernels(rules)
    np.testing.assert_array_equal(got, reference_outputs(model, feeds)["y"])


@pytest.mark.parametrize("trans_b", [True, False])
def test_qgemm_with_bias_equals_onnxruntime(tmp_path, trans_b):
    rng = np.random.default_rng(5)
    m, k, n = 7, 40, 17
    b = integers(rng, np.int8, (n, k) if trans_b else (k, n))
    node = helper.make_node("QGemm", ["a", "sa", "za", "b", "sb", "zb", "bias", "sy", "zy"], ["y"], name="qgemm",
                            domain=MS, transB=int(trans_b), alpha=0.75)
    model = finish([node], [tensor("a", np.uint8, [m, k])], [tensor("y", np.uint8, [m, n])],
                   [const("sa", np.float32(0.013)), const("za", np.uint8(120)), const("b", b),
                    const("sb", rng.uniform(0.002, 0.01, n).astype(np.float32)), const("zb", np.zeros(n, np.int8)),
                    const("bias", rng.integers(-2000, 2000, n).astype(np.int32)), const("sy", np.float32(0.07)),
                    const("zy", np.uint8(130))])
    rules = assert_equal_to_onnxruntime(model, {"a": integers(rng, np.uint8, (m, k))}, tmp_path)
    assert_int8_kernels(rules)


def test_matmul_integer_to_float_matches_onnxruntime(tmp_path):
    """The integer sum exact; its float scale-and-bias epilogue rounds as the float path's
    did (within 2e-6 of ONNX Runtime's, as before the int8 kernel)."""
    rng = np.random.default_rng(6)
    m, k, n = 33, 100, 17
    node = helper.make_node("MatMulIntegerToFloat", ["a", "b", "sa", "sb", "za", "zb", "bias"], ["y"], name="mmif",
                            domain=MS)
    model = finish([node], [tensor("a", np.uint8, [m, k])], [tensor("y", np.float32, [m, n])],
                   [const("b", integers(rng, np.int8, (k, n))), const("sa", np.float32(0.02)),
                    const("sb", rng.uniform(0.002, 0.01, n).astype(np.float32)), const("za", np.uint8(131)),
                    const("zb", np.zeros(n, np.int8)), const("bias", rng.standard_normal(n).astype(np.float32))])
    feeds = {"a": integers(rng, np.uint8, (m, k))}
    vm, rules = compiled(model, feeds, tmp_path)
    got = vm["main"](tvm.runtime.tensor(feeds["a"])).numpy()
    assert_int8_kernels(rules)
    np.testing.assert_allclose(got, reference_outputs(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def test_static_quantized_mlp_equals_onnxruntime(tmp_path):
    """quantize_static's QDQ MLP (per-channel uint8/int8): its MatMul groups as QLinearMatMul on
    the int8 kernel, the whole model as ONNX Runtime computes it."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from helpers import mlp_model

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.batches = iter([{"x": rng.standard_normal((16, 64)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    onnx.save(mlp_model(seed=3, in_features=64, hidden=96), tmp_path / "float.onnx")
    quantize_static(tmp_path / "float.onnx", tmp_path / "qdq.onnx", Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    model = onnx.load(tmp_path / "qdq.onnx")
    feeds = {"x": np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32) * 2}
    vm, rules = compiled(model, feeds, tmp_path)
    got = vm["main"](tvm.runtime.tensor(feeds["x"])).numpy()
    assert_int8_kernels(rules)
    np.testing.assert_allclose(got, reference_outputs(model, feeds)["y"], rtol=0, atol=1e-5)


def test_symbolic_rows_equal_onnxruntime_at_every_size(tmp_path):
    """Rows given as a range (a sequence length): one build, exact at each size."""
    model, _ = qlinear_matmul(7, 100, 17, np.uint8, np.int8, True)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "rows"
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "rows"
    onnx.save(model, tmp_path / "model.onnx")
    session = ModelSession(tmp_path / "model.onnx", ["a:1..64x100"])
    assert_int8_kernels(session.scheduled().schedule_rules)
    vm = relax.VirtualMachine(session.built(), tvm.cpu())
    for rows in (1, 5, 33, 64):
        a = integers(np.random.default_rng(rows), np.uint8, (rows, 100))
        got = vm["main"](tvm.runtime.tensor(a)).numpy()
        np.testing.assert_array_equal(got, reference_outputs(model, {"a": a})["y"], err_msg=str(rows))


def test_dynamic_quantized_mlp_equals_onnxruntime(tmp_path):
    """quantize_dynamic's MLP: DynamicQuantizeLinear -> MatMulInteger (a zero point computed at
    run time) -> scale, as ONNX Runtime computes it."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from helpers import mlp_model

    onnx.save(mlp_model(seed=4, in_features=64, hidden=96), tmp_path / "float.onnx")
    quantize_dynamic(tmp_path / "float.onnx", tmp_path / "dynamic.onnx", weight_type=QuantType.QInt8)
    model = onnx.load(tmp_path / "dynamic.onnx")
    assert "MatMulInteger" in {node.op_type for node in model.graph.node}
    feeds = {"x": np.random.default_rng(7).standard_normal((16, 64)).astype(np.float32)}
    vm, rules = compiled(model, feeds, tmp_path)
    got = vm["main"](tvm.runtime.tensor(feeds["x"])).numpy()
    assert_int8_kernels(rules)
    np.testing.assert_allclose(got, reference_outputs(model, feeds)["y"], rtol=0, atol=1e-5)
