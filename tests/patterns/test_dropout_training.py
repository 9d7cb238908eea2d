"""Training-mode Dropout: the counter-based kernel, its fusion into the GEMM epilogue, and the
ONNX path (training_mode a constant true input, ratio a constant, seed an attribute).

ONNX Runtime's Dropout generator cannot be reproduced, so the mask is checked against a numpy
implementation of the same generator (bit for bit) and for its statistics; the fused kernel
must equal the separate-kernel build bit for bit.
"""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from machine import host_target
from tvm import relax

from tvm_fusion import api
from tvm_fusion.config import parse_config
from tvm_fusion.kernels.dropout_training import emit_dropout_training
from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.fast_math import fast_math_legalize_map
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.runtime import CompiledModel
from tvm_fusion.schedules import ApplySchedules

TARGET = tvm.target.Target(host_target())
PATTERNS = ["gelu_erf", "dropout", "dropout_training", "gemm_epilogue"]


# numpy oracle of the generator ---------------------------------------------------------------

def philox4x32_10(counter: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Random123's Philox-4x32-10 in numpy, counters (lo, hi, 0, 0); returns the 4 words."""
    mask = np.uint64(0xFFFFFFFF)
    c = [counter.astype(np.uint64) & mask, counter.astype(np.uint64) >> np.uint64(32),
         np.zeros_like(counter, np.uint64), np.zeros_like(counter, np.uint64)]
    k0, k1 = key
    for _ in range(10):
        p0, p1 = c[0] * np.uint64(0xD2511F53), c[2] * np.uint64(0xCD9E8D57)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & mask,
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & mask]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return np.stack(c)


def test_numpy_oracle_matches_random123_known_answers():
    """philox4x32_10 known-answer vectors from Random123's kat_vectors (counter words 2, 3 = 0)."""
    assert [int(w) for w in philox4x32_10(np.array([0]), (0, 0))[:, 0]] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def reference_mask(shape, seed: int, ratio: float) -> np.ndarray:
    counters = np.arange(int(np.prod(shape)), dtype=np.uint64)
    word0 = philox4x32_10(counters, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))[0]
    uniform = (word0 >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)
    return (uniform >= np.float32(ratio)).reshape(shape)


# builders ------------------------------------------------------------------------------------

def ffn_dropout_model(training=True, ratio=0.1, seed=7, m=16, k=32, n=64,
                      ratio_is_input=False) -> onnx.ModelProto:
    """x[m, k] -> MatMul -> Add(bias) -> erf GELU as exported -> Dropout(ratio, training_mode; seed)."""
    rng = np.random.default_rng(0)
    constants = {"w": (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32),
                 "b": rng.standard_normal(n).astype(np.float32),
                 "sqrt2": np.array(1.4142135381698608, np.float32), "one": np.array(1.0, np.float32),
                 "half": np.array(0.5, np.float32), "training": np.array(training)}
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])]
    if ratio_is_input:
        # A 1-element tensor: onnxslim cannot bind a 0-d input's shape (the converter reshapes it).
        inputs.append(helper.make_tensor_value_info("ratio", TensorProto.FLOAT, [1]))
    else:
        constants["ratio"] = np.array(ratio, np.float32)
    dropout_attrs = {} if seed is None else {"seed": seed}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["h_div"]), helper.make_node("Erf", ["h_div"], ["h_erf"]),
        helper.make_node("Add", ["h_erf", "one"], ["h_erf1"]), helper.make_node("Mul", ["h", "h_erf1"], ["h_mul"]),
        helper.make_node("Mul", ["h_mul", "half"], ["g"]),
        helper.make_node("Dropout", ["g", "ratio", "training"], ["y", "mask"], name="ffn_dropout",
                         **dropout_attrs),
    ]
    graph = helper.make_graph(
        nodes, "ffn_dropout", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, [m, n])],
        [numpy_helper.from_array(value, name) for name, value in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def config(patterns):
    return parse_config({"target": host_target(),
                         "pipeline": {"patterns": patterns}}, name="test")


def compile_onnx(model, tmp_path, patterns=PATTERNS):
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, config(patterns))
    optimized = api.optimize(prepared)
    compiled = CompiledModel(api.build(optimized.module, prepared.config),
                             {"inputs": [s.to_json() for s in prepared.inputs],
                              "outputs": [{"name": n} for n in prepared.output_names], "threads": 2})
    return compiled, optimized


def relax_ffn(shape=(16, 32, 64), ratio=0.1, seed=7, second_consumer=False, ratio_is_input=False):
    """matmul + bias + gelu + the training dropout kernel, as the frontend imports it."""
    m, k, n = shape
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    params = [x, w, b]
    if ratio_is_input:
        params.append(relax.Var("ratio", relax.TensorType((), "float32")))
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            g = bb.emit(relax.op.nn.gelu(relax.op.add(relax.op.matmul(x, w), b)))
            ratio_expr = params[3] if ratio_is_input else relax.const(ratio, "float32")
            dropped = bb.emit(emit_dropout_training(bb, g, ratio_expr, seed))
            values, mask = bb.emit(dropped[0]), bb.emit(dropped[1])
            if second_consumer:
                values = bb.emit(relax.op.add(values, g))
            out = bb.emit_output(relax.Tuple([values, mask]))
        bb.emit_func_output(out)
    return bb.get()


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("dropout_training")], report)(mod), report


def build_separate_kernels(mod):
    """Every op its own kernel (no FuseOps), each scheduled by our rules: the unfused baseline."""
    lowered = tvm.transform.Sequential([relax.transform.LegalizeOps(fast_math_legalize_map()),
                                        relax.transform.AnnotateTIROpPattern(),
                                        ApplySchedules(TARGET)])(mod)
    return relax.VirtualMachine(tvm.compile(lowered, target=TARGET), tvm.cpu())


def build_fused(mod):
    from tvm_fusion.passes.pipeline import lowering_passes

    fused, report = fuse(mod)
    lowered = tvm.transform.Sequential([*lowering_passes(), ApplySchedules(TARGET)])(fused)
    return relax.VirtualMachine(tvm.compile(lowered, target=TARGET), tvm.cpu()), report


def ffn_inputs(shape=(16, 32, 64), seed=1):
    m, k, n = shape
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((m, k)).astype("float32"),
            (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float32"),
            rng.standard_normal(n).astype("float32")]


def run(vm, arrays):
    return [t.numpy() for t in vm["main"](*[tvm.runtime.tensor(a) for a in arrays])]


# fusion --------------------------------------------------------------------------------------

def test_matmul_bias_gelu_dropout_becomes_one_composite():
    after, report = fuse(relax_ffn())
    assert report.variants["dropout_training.matmul_bias_gelu_dropout"] == 1
    composites = {f.attrs["Composite"]: f for _, f in after.functions_items()
                  if isinstance(f, relax.Function) and f.attrs and "Composite" in f.attrs}
    assert list(composites) == ["dropout_training.matmul_bias_gelu_dropout"]
    ops = [b.value.op for b in next(iter(composites.values())).body.blocks[0].bindings]
    assert [getattr(op, "name", None) for op in ops] == [
        "relax.matmul", "relax.add", "relax.nn.gelu", "relax.call_tir"]
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert len(calls) == 1  # the composite, which returns values and mask


def test_fused_kernel_equals_separate_kernels_bit_for_bit():
    """Same generator, different kernels and schedules: identical mask and values."""
    shape = (64, 128, 256)
    mod, inputs = relax_ffn(shape, ratio=0.25, seed=11), ffn_inputs(shape)
    fused_vm, report = build_fused(mod)
    assert report.fired["dropout_training"] == 1
    fused_values, fused_mask = run(fused_vm, inputs)
    separate_values, separate_mask = run(build_separate_kernels(mod), inputs)
    np.testing.assert_array_equal(fused_mask, separate_mask)
    np.testing.assert_array_equal(fused_values, separate_values)
    np.testing.assert_array_equal(fused_mask, reference_mask(shape[::2], 11, 0.25))


# the kernel's statistics and determinism -------------------------------------------------------

def dropout_only(shape, ratio, seed):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(emit_dropout_training(bb, x, relax.const(ratio, "float32"), seed))
        bb.emit_func_output(out)
    return build_separate_kernels(bb.get())


@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_mask_statistics_scale_and_zeros(ratio):
    shape = (1000, 1000)
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    values, mask = run(dropout_only(shape, ratio, seed=3), [x])
    assert mask.dtype == np.bool_ and mask.shape == shape
    # 10^6 Bernoulli draws: the keep fraction's standard deviation is <= 5e-4; allow 4e-3 (8 sigma).
    assert abs(mask.mean() - (1 - ratio)) < 4e-3
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(ratio))
    np.testing.assert_array_equal(values[mask], x[mask] * scale)  # exactly 1/(1-r)
    assert not values[~mask].any()  # dropped values are exactly 0
    np.testing.assert_array_equal(mask, reference_mask(shape, 3, ratio))
    # No structure along rows or columns: each row and column keeps about 1 - r.
    assert abs(mask.mean(axis=1) - (1 - ratio)).max() < 0.1
    assert abs(mask.mean(axis=0) - (1 - ratio)).max() < 0.1


def test_same_seed_same_mask_other_seed_other_mask():
    shape = (64, 64)
    x = np.ones(shape, "float32")
    first = run(dropout_only(shape, 0.5, seed=1), [x])
    again = run(dropout_only(shape, 0.5, seed=1), [x])
    other = run(dropout_only(shape, 0.5, seed=2), [x])
    np.testing.assert_array_equal(first[1], again[1])
    np.testing.assert_array_equal(first[0], again[0])
    assert (first[1] != other[1]).mean() > 0.4  # independent masks differ on ~half the elements


def test_ratio_zero_keeps_everything():
    x = np.random.default_rng(0).standard_normal((8, 40)).astype("float32")
    values, mask = run(dropout_only((8, 40), 0.0, seed=5), [x])
    assert mask.all()
    np.testing.assert_array_equal(values, x)


def test_symbolic_rows_draw_the_same_mask_as_static_rows():
    """A symbolic row count: one kernel for every size, each drawing the static kernel's mask
    (the counter is the flat index, computed from the symbolic extent)."""
    x = np.random.default_rng(0).standard_normal((40, 24)).astype("float32")
    vm = dropout_only((tvm.tirx.Var("n", "int64"), 24), 0.3, seed=9)
    for rows in (5, 40):
        values, mask = run(vm, [x[:rows]])
        np.testing.assert_array_equal(mask, reference_mask((rows, 24), 9, 0.3))
        np.testing.assert_array_equal(values, np.where(mask, x[:rows] * (np.float32(1) / np.float32(0.7)), 0))


def test_symbolic_rows_fuse_into_the_gemm_epilogue():
    after, report = fuse(relax_ffn((tvm.tirx.Var("n", "int64"), 32, 64)))
    assert report.variants["dropout_training.matmul_bias_gelu_dropout"] == 1
    assert not report.near_misses


# from ONNX -----------------------------------------------------------------------------------

def test_onnx_training_dropout_is_fused_and_matches_the_inference_graph(tmp_path):
    """Kept values equal the inference graph's (= ONNX Runtime's) values times 1/(1-r)."""
    x = np.random.default_rng(2).standard_normal((16, 32)).astype("float32")
    train, optimized = compile_onnx(ffn_dropout_model(training=True, ratio=0.2, seed=9), tmp_path)
    assert optimized.report.variants["dropout_training.matmul_bias_gelu_dropout"] == 1
    assert "MatmulMultiOutput" in optimized.schedule_rules.values()
    out = train.run({"x": x})
    assert out["mask"].dtype == np.bool_
    np.testing.assert_array_equal(out["mask"], reference_mask((16, 64), 9, 0.2))
    infer_model = ffn_dropout_model(training=False, ratio=0.2)
    (tmp_path / "infer").mkdir()
    infer, _ = compile_onnx(infer_model, tmp_path / "infer")
    (expected,) = [v for k, v in ort_run(infer_model, x).items() if k == "y"]
    inferred = infer.run({"x": x})["y"]
    np.testing.assert_allclose(inferred, expected, rtol=1e-5, atol=1e-5)  # fast-math erf vs ORT
    scale = np.float32(1.0) / np.float32(0.8)
    kept = out["mask"]
    np.testing.assert_allclose(out["y"][kept], inferred[kept] * scale, rtol=1e-6, atol=0)
    assert not out["y"][~kept].any()


def ort_run(model, x):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))


def test_onnx_dropout_without_seed_is_reproducible(tmp_path):
    x = np.ones((16, 32), "float32")
    first, _ = compile_onnx(ffn_dropout_model(seed=None), tmp_path)
    (tmp_path / "again").mkdir()
    second, _ = compile_onnx(ffn_dropout_model(seed=None), tmp_path / "again")
    np.testing.assert_array_equal(first.run({"x": x})["mask"], second.run({"x": x})["mask"])


# must not fuse -------------------------------------------------------------------------------

def test_must_not_fuse_a_ratio_computed_at_run_time():
    before = relax_ffn(ratio_is_input=True)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [
        "the dropout ratio is computed at run time; the fusion needs a constant ratio"]


def test_onnx_ratio_input_still_runs_the_standalone_kernel(tmp_path):
    model = ffn_dropout_model(ratio_is_input=True)
    compiled, optimized = compile_onnx(model, tmp_path)
    assert not optimized.report.fired["dropout_training"]
    # gemm_epilogue takes the matmul chain; the dropout stays a kernel of its own.
    assert optimized.report.variants["gemm_epilogue.matmul_bias_gelu"] == 1
    out = compiled.run({"x": np.ones((16, 32), "float32"), "ratio": np.array([0.3], "float32")})
    np.testing.assert_array_equal(out["mask"], reference_mask((16, 64), 7, 0.3))


@pytest.mark.parametrize("ratio, shown", [(1.0, "1"), (-0.1, "-0.1")])
def test_must_not_fuse_a_ratio_outside_zero_one(ratio, shown):
    before = relax_ffn(ratio=ratio)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [f"dropout ratio {shown} is outside [0, 1)"]


def test_must_not_fuse_when_the_activation_has_a_second_consumer():
    before = relax_ffn(second_consumer=True)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == ["an intermediate result is also used outside the chain"]


@pytest.mark.parametrize("shape", [(2, 8, 16), (3, 5), (257,)])
def test_mask_is_independent_of_schedule_and_rank(shape):
    """Naive loops (no schedule) and our schedules draw the numpy oracle's mask for any rank."""
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(emit_dropout_training(bb, x, relax.const(0.2, "float32"), -5))
        bb.emit_func_output(out)
    naive = relax.VirtualMachine(tvm.compile(bb.get(), target=TARGET), tvm.cpu())
    ones = [np.ones(shape, "float32")]
    expected = reference_mask(shape, -5, 0.2)
    np.testing.assert_array_equal(run(naive, ones)[1], expected)
    np.testing.assert_array_equal(run(build_separate_kernels(bb.get()), ones)[1], expected)
