"""FusePatterns with symbolic dims that appear only inside expressions (a stepped range: image
sides ``32 * height_div32``): shapes FuseOpsByPattern lifts into a composite's parameters go
back inline, so the composite lowers and the patterns after it see its result's shape."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from tvm_fusion.config import load_config
from tvm_fusion.passes import FusePatterns, fusion_pipeline
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.patterns.base import dims_text

# Stepped dims: the image side is a multiple of 4 of these, as frontend/stepped_dims.py imports them.
H, W = tirx.Var("height_div4", "int64"), tirx.Var("width_div4", "int64")
NEAREST = {"method": "nearest_neighbor", "coordinate_transformation_mode": "asymmetric",
           "rounding_method": "floor"}


def stepped_module(fn, inputs: dict, constants: dict) -> tvm.IRModule:
    """``main(step_dims: R.Shape([H, W]), **inputs)``: the step counts defined by a shape
    parameter, the inputs' shapes using them only inside expressions."""
    steps = relax.Var("step_dims", relax.ShapeType([H, W]))
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in inputs.items()]
    consts = [relax.const(value) for value in constants.values()]
    bb = relax.BlockBuilder()
    with bb.function("main", [steps, *params]):
        with bb.dataflow():
            out = bb.emit_output(fn(*params, *consts))
        bb.emit_func_output(out)
    return bb.get()


def fpn_merge_then_conv() -> tvm.IRModule:
    """``relu(conv(lateral_conv(x) + upsample(top)) + b)``: an upsampled-residual conv epilogue
    whose result a second conv epilogue reads."""
    rng = np.random.default_rng(0)
    weights = {"w1": rng.standard_normal((8, 4, 1, 1)).astype("float32"),
               "w2": rng.standard_normal((8, 8, 3, 3)).astype("float32"),
               "b2": rng.standard_normal((1, 8, 1, 1)).astype("float32")}

    def fn(x, top, w1, w2, b2):
        size = relax.ShapeExpr([2 * (2 * H), 2 * (2 * W)])
        merged = relax.op.add(relax.op.nn.conv2d(x, w1), relax.op.image.resize2d(top, size, **NEAREST))
        return relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(merged, w2, padding=1), b2))

    return stepped_module(fn, {"x": (1, 4, 4 * H, 4 * W), "top": (1, 8, 2 * H, 2 * W)}, weights)


def composites(mod: tvm.IRModule) -> dict:
    return {str(func.attrs["Composite"]): func for _, func in mod.functions_items()
            if isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs}


def test_a_resize_size_in_stepped_dims_stays_inline_and_its_shape_reaches_the_next_pattern():
    report = PatternReport()
    after = FusePatterns([get_pattern("conv_epilogue")], report)(fpn_merge_then_conv())
    fused = composites(after)
    assert set(fused) == {"conv_epilogue.conv_upsampled_residual", "conv_epilogue.conv_bias_relu"}
    merge = fused["conv_epilogue.conv_upsampled_residual"]
    # Only the shape FuseOpsByPattern adds to define the step counts stays a parameter.
    shape_params = [p for p in merge.params if isinstance(p.ty, relax.ShapeType)]
    assert all(isinstance(dim, tirx.Var) for p in shape_params for dim in p.ty.values)
    resize = merge.body.blocks[0].bindings[1].value
    assert isinstance(resize.args[1], relax.ShapeExpr)
    assert dims_text(merge.ret_ty.shape.values) == "(1, 8, height_div4 * 4, width_div4 * 4)"
    assert not report.near_misses
    assert [i.variant for i in report.instances] == ["conv_epilogue.conv_upsampled_residual",
                                                     "conv_epilogue.conv_bias_relu"]


def test_the_stepped_fpn_merge_lowers_and_matches_the_unfused_module_at_several_sizes():
    mod = fpn_merge_then_conv()
    cfg = load_config(None)
    optimized = fusion_pipeline(cfg, PatternReport())(mod)
    target = cfg.tvm_target()
    fused = relax.VirtualMachine(tvm.compile(optimized, target=target), tvm.cpu())
    plain = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    rng = np.random.default_rng(1)
    for h, w in [(1, 1), (1, 5), (3, 2), (8, 13)]:
        x = tvm.runtime.tensor(rng.standard_normal((1, 4, 4 * h, 4 * w)).astype("float32"))
        top = tvm.runtime.tensor(rng.standard_normal((1, 8, 2 * h, 2 * w)).astype("float32"))
        steps = tvm.runtime.ShapeTuple([h, w])
        np.testing.assert_allclose(fused["main"](steps, x, top).numpy(), plain["main"](steps, x, top).numpy(),
                                   rtol=1e-4, atol=1e-4)


def test_required_ops_are_those_every_match_calls():
    """FusePatterns skips a variant whose required ops the module does not call: an op on one
    side of ``|`` only is not required, one on both sides is."""
    from tvm.relax.dpl import is_op, is_tuple, is_tuple_get_item, wildcard

    from tvm_fusion.passes.fuse_patterns import required_ops

    matmul = is_op("relax.matmul")(wildcard(), wildcard())
    biased = is_op("relax.add")(matmul, wildcard())
    assert required_ops(biased) == {"relax.add", "relax.matmul"}
    assert required_ops(biased | matmul) == {"relax.matmul"}
    assert required_ops(is_op("relax.nn.relu")(biased).has_dtype("float32")) == {"relax.nn.relu", "relax.add",
                                                                                  "relax.matmul"}
    assert required_ops(is_tuple_get_item(is_tuple([matmul, wildcard()]), 0)) == {"relax.matmul"}
    assert required_ops(wildcard()) == frozenset()



def test_required_edges_are_the_op_to_op_reads_every_match_has():
    """FusePatterns also skips a variant needing one op to feed another where none does (an
    unrolled decoder calls matmul and add, but maybe never add on a matmul's result)."""
    from tvm import relax
    from tvm.relax.dpl import is_op, wildcard

    from tvm_fusion.passes.fuse_patterns import called_edges, required_edges

    matmul = is_op("relax.matmul")(wildcard(), wildcard())
    biased = is_op("relax.add")(matmul, wildcard())
    activated = is_op("relax.nn.relu")(biased) | is_op("relax.nn.relu")(is_op("relax.multiply")(biased, wildcard()))
    assert required_edges(biased) == {("relax.matmul", "relax.add")}
    assert required_edges(activated) == {("relax.matmul", "relax.add")}  # add -> relu only on one side
    assert required_edges(is_op("relax.nn.relu")(biased | matmul)) == frozenset()  # relu's input: add or matmul
    assert required_edges(wildcard()) == frozenset()

    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4), "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            product = builder.emit(relax.op.matmul(x, relax.const(np.ones((4, 4), "float32"))))
            summed = builder.emit(relax.op.add(x, x))  # add reads no matmul
            out = builder.emit_output(relax.op.nn.relu(relax.op.multiply(product, summed)))
        builder.emit_func_output(out)
    edges = called_edges(builder.get())
    assert edges == {("relax.matmul", "relax.multiply"), ("relax.add", "relax.multiply"),
                     ("relax.multiply", "relax.nn.relu")}
    assert not required_edges(biased) <= edges
