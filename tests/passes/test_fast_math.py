"""Fast-math legalization: same values as the libm legalization within float32 rounding."""

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir
from tvm.s_tir.dlight.analysis import get_root_block

from tvm_fusion.passes.fast_math import fast_math_legalize_map

OPS = {
    "exp": relax.op.exp, "erf": relax.op.erf, "tanh": relax.op.tanh, "sigmoid": relax.op.sigmoid,
    "gelu": relax.op.nn.gelu, "gelu_tanh": relax.op.nn.gelu_tanh, "silu": relax.op.nn.silu,
    "softmax": relax.op.nn.softmax,
}


def single_op_module(op, dtype="float32"):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 64), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op(x))
        bb.emit_func_output(out)
    return bb.get()


def run(mod, x):
    ex = tvm.compile(mod, target=tvm.target.Target("llvm"))
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("name", sorted(OPS))
def test_fast_legalization_matches_libm(name):
    mod = single_op_module(OPS[name])
    # Covers the saturating tails (exp clamps near +-88) as well as the interesting middle.
    x = np.linspace(-12, 12, 8 * 64, dtype="float32").reshape(8, 64)
    if name == "exp":
        x = np.linspace(-80, 80, 8 * 64, dtype="float32").reshape(8, 64)
    fast = run(relax.transform.LegalizeOps(fast_math_legalize_map())(mod), x)
    exact = run(relax.transform.LegalizeOps()(mod), x)
    # Measured: fast_exp is within 4.1e-6 relative over [-80, 80]; the others within 1e-6.
    rtol = 5e-6 if name == "exp" else 2e-6
    np.testing.assert_allclose(fast, exact, rtol=rtol, atol=1e-6)


def test_fast_legalization_replaces_the_libm_calls():
    mod = relax.transform.LegalizeOps(fast_math_legalize_map())(single_op_module(relax.op.nn.gelu))
    assert "erf" not in mod.script().replace("fast_erf", "")


def test_other_dtypes_keep_the_default_legalization():
    mod = single_op_module(relax.op.erf, "float64")
    fast = relax.transform.LegalizeOps(fast_math_legalize_map())(mod)
    tvm.ir.assert_structural_equal(fast, relax.transform.LegalizeOps()(mod))


def softmax_module(shape, axis=-1):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(x, axis=axis))
        bb.emit_func_output(out)
    return bb.get()


def reduction_extents(mod) -> list[int]:
    """The reduction extents of the softmax kernel's blocks (its max's and its sum's)."""
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    sch = s_tir.Schedule(func)
    stmts = [sch.get(block) for block in sch.get_child_blocks(get_root_block(sch))]
    return [int(iv.dom.extent) for stmt in stmts for iv in stmt.iter_vars
            if iv.iter_type == tvm.tirx.IterVar.CommReduce]


@pytest.mark.parametrize("width", [65, 2053, 18385])
def test_a_row_16_does_not_divide_is_reduced_over_its_padding(width):
    """The CTC head of PP-OCRv5 (18385 classes), a prime row: max and sum over the row padded
    to 16, the padding the reductions' identity; the values are softmax's."""
    mod = softmax_module((3, width))
    fast = relax.transform.LegalizeOps(fast_math_legalize_map())(mod)
    assert reduction_extents(fast) == [-(-width // 16) * 16] * 2
    x = np.random.default_rng(0).standard_normal((3, width)).astype("float32") * 4
    x[1, -1] = 30.0  # the row's max is its last element, next to the padding
    exact = run(relax.transform.LegalizeOps()(mod), x)
    np.testing.assert_allclose(run(fast, x), exact, rtol=5e-6, atol=1e-8)


@pytest.mark.parametrize("shape, axis", [((3, 64), -1), ((3, 96), -1), ((3, 2048), 1), ((75, 3), 0), ((4, 75, 3), 1)])
def test_must_not_pad_a_row_16_divides_a_short_row_or_another_axis(shape, axis):
    fast = relax.transform.LegalizeOps(fast_math_legalize_map())(softmax_module(shape, axis))
    assert reduction_extents(fast) == [shape[axis]] * 2


def test_isnan_by_its_bits_is_exact():
    mod = relax.transform.LegalizeOps(fast_math_legalize_map())(single_op_module(relax.op.isnan))
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, np.finfo(np.float32).max,
                        np.finfo(np.float32).tiny / 2], dtype="float32")
    payloads = np.array([0x7F800001, 0x7FC00000, 0xFFFFFFFF, 0xFF800001], dtype="uint32").view("float32")
    x = np.resize(np.concatenate([special, payloads]), 8 * 64).astype("float32").reshape(8, 64)
    np.testing.assert_array_equal(run(mod, x), np.isnan(x))


def test_nan_guard_vectorizes():
    """A softmax's NaN guard ``where(isnan(p), 0, p)``: with ``tirx.isnan`` in the select, TVM's
    vectorizer left the loop scalar (LLVM's then gathered its loads); by the bits, it is vectors."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.where(relax.op.isnan(x), relax.const(0.0, "float32"), x))
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential([
        relax.transform.LegalizeOps(fast_math_legalize_map()), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()])(bb.get())
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    sch = s_tir.Schedule(func)
    *producers, guard = sch.get_child_blocks(get_root_block(sch))
    for block in producers:
        sch.compute_inline(block)
    _, columns = sch.get_loops(guard)
    sch.vectorize(sch.split(columns, [None, 16])[1])
    kernel = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")})
    llvm_ir = tvm.compile(kernel, target=tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})).mod
    code = llvm_ir.inspect_source("ll")
    assert "load <16 x float>" in code and "gather" not in code
