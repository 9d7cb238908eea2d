"""MarkShapeFunctionsNoAlias: the VM's shape functions get ``tirx.noalias``; kernels and
functions with several buffers are left as they are."""

import tvm
from tvm.script import tirx as T

from tvm_fusion.passes.mark_shape_functions_noalias import MarkShapeFunctionsNoAlias


@T.prim_func(s_tir=True)
def shape_func(H: T.Buffer((T.int64(4),), "int64")):
    T.func_attr({"tirx.is_host_func": True})
    H[T.int64(2)] = (H[T.int64(0)] - T.int64(1)) // T.int64(4) + T.int64(1)


@T.prim_func(s_tir=True)
def two_buffers(A: T.Buffer((T.int64(4),), "int64"), B: T.Buffer((T.int64(4),), "int64")):
    T.func_attr({"tirx.is_host_func": True})
    B[T.int64(0)] = A[T.int64(0)]


@T.prim_func(s_tir=True)
def kernel(A: T.Buffer((T.int64(4),), "float32")):
    A[T.int64(0)] = T.float32(1)


def test_shape_function_gets_noalias():
    mod = MarkShapeFunctionsNoAlias()(tvm.IRModule({"shape_func": shape_func}))
    assert mod["shape_func"].attrs["tirx.noalias"]


def test_other_functions_are_unchanged():
    before = tvm.IRModule({"two_buffers": two_buffers, "kernel": kernel})
    after = MarkShapeFunctionsNoAlias()(before)
    tvm.ir.assert_structural_equal(after, before)


def test_symbolic_build_marks_its_shape_function():
    """A Relax module with a symbolic dim built by tvm_fusion.build: the shape function the VM
    lowering adds reaches the TIR build marked noalias."""
    from tvm import relax, tirx

    from tvm_fusion.build import build
    from tvm_fusion.config import load_config

    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.reshape(x, (n * 2, 2)))
        bb.emit_func_output(out)
    seen = {}
    original = tvm.tirx.build

    def spy(mod, *args, **kwargs):
        seen["mod"] = mod
        return original(mod, *args, **kwargs)

    tvm.tirx.build = spy
    try:
        build(relax.get_pipeline("zero")(bb.get()), load_config())
    finally:
        tvm.tirx.build = original
    shape_funcs = [f for f in seen["mod"].functions.values() if "tirx.is_host_func" in (f.attrs or {})]
    assert shape_funcs and all(f.attrs["tirx.noalias"] for f in shape_funcs)
