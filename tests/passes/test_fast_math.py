"""Fast-math legalization: same values as the libm legalization within float32 rounding."""

import numpy as np
import pytest
import tvm
from tvm import relax

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
