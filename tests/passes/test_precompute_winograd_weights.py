"""PrecomputeWinogradWeights: a Winograd conv's constant weight transformed once, at build time."""

import numpy as np
import tvm
import tvm_ffi
from machine import host_target
from tvm import relax, s_tir, te
from tvm.relax.op import nn

from tvm_fusion.kernels.winograd_conv2d import weight_transform, winograd_conv2d_transformed
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.passes.precompute_winograd_weights import PrecomputeWinogradWeights
from tvm_fusion.targets.target_info import vector_lanes

TARGET = tvm.target.Target(host_target())
BLOCK = vector_lanes(TARGET, "float32")
DATA = (1, 2, 8, 8, BLOCK)     # 2 x 2 tiles of F(4x4)
WEIGHT = (2, 2, 3, 3, BLOCK, BLOCK)
TRANSFORMED = (6, 6, 2, 2, BLOCK, BLOCK)


def lowered_conv(weight: np.ndarray | None) -> tvm.IRModule:
    """A blocked 3x3 conv after our lowering; its weight a constant, or (None) a parameter."""
    x = relax.Var("x", relax.TensorType(DATA, "float32"))
    params = [x] if weight is not None else [x, relax.Var("w", relax.TensorType(WEIGHT, "float32"))]
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        with builder.dataflow():
            w = relax.const(weight) if weight is not None else params[1]
            out = builder.emit_output(nn.conv2d(x, w, padding=1, data_layout=f"NCHW{BLOCK}c",
                                                kernel_layout=f"OIHW{BLOCK}i{BLOCK}o", out_layout=f"NCHW{BLOCK}c"))
        builder.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(builder.get())


def test_a_constant_weight_is_transformed_at_build_time():
    """Before: the kernel transforms the weight it is passed. After: it reads the transformed
    weight (the kernel the same conv would be from a transformed-weight parameter), and the
    call passes the constant transformed once in float64; the outputs agree."""
    weight = (np.random.default_rng(0).standard_normal(WEIGHT) / np.sqrt(9 * 2 * BLOCK)).astype("float32")
    before = lowered_conv(weight)
    after = PrecomputeWinogradWeights(TARGET)(before)

    data, transformed = (te.placeholder([tvm.tirx.IntImm("int64", dim) for dim in shape], name=name)  # Relax's dims
                         for shape, name in ((DATA, "x"), (TRANSFORMED, "winograd_weight")))
    expected = te.create_prim_func([data, transformed, winograd_conv2d_transformed(data, transformed, (1, 1, 1, 1), 4)],
                                   index_dtype_override="int64")
    (original,) = [func for func in before.functions.values() if isinstance(func, tvm.tirx.PrimFunc)]
    (kernel,) = [func for func in after.functions.values() if isinstance(func, tvm.tirx.PrimFunc)]
    assert "winograd_weight" in blocks_in(original) and "winograd_weight" not in blocks_in(kernel)
    tvm.ir.assert_structural_equal(kernel.body, expected.body, map_free_vars=True)

    constants = []
    relax.analysis.post_order_visit(after["main"], lambda e: constants.append(e) if isinstance(e, tvm.ir.GenericConst) else None)
    (constant,) = constants
    np.testing.assert_array_equal(constant.value.numpy(), weight_transform(weight, 4))

    x = np.random.default_rng(1).standard_normal(DATA).astype("float32")
    results = [relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
               for mod in (before, after)]
    # The transform rounded in float32 in the kernel, in float64 at build time.
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_must_not_transform_a_weight_computed_at_run_time():
    before = lowered_conv(None)
    after = PrecomputeWinogradWeights(TARGET)(before)
    tvm.ir.assert_structural_equal(after, before)


def blocks_in(func: tvm.tirx.PrimFunc) -> set[str]:
    names = set()
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda block: names.add(block.name_hint)))
    return names
