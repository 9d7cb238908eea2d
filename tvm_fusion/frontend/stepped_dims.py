"""Ranges with a step (``height = "32..640/32"``) in Relax: compiled as ``32 * height_div32``.

A Relax function can only take a symbolic var from a parameter where it stands alone, so
``input: R.Tensor((1, 3, 32 * h, 32 * w))`` cannot be ``main``'s signature. The imported
``main`` gets the step counts as a leading shape parameter instead, which defines them:

    main(step_dims: R.Shape([h, w]), input: R.Tensor((1, 3, 32 * h, 32 * w)))

and the pipeline runs on that. Before the build, ``expose_input_dims`` renames it and adds
the ``main`` users call, ``main(input: R.Tensor((1, 3, height, width)))``, which passes
``height // 32, width // 32``; the VM checks that the input really is a multiple of the step.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.s_tir.dlight.analysis import collect_vars_used_in_prim_expr

from .dims import DimRange

STEPPED_MAIN = "main_by_steps"


def add_steps_param(module, ranges: dict[str, DimRange]):
    """``main`` with the stepped dims' vars defined by a leading ``R.Shape`` parameter."""
    stepped = [r.var_name for r in ranges.values() if r.step > 1]
    if not stepped:
        return module
    main = module["main"]
    found = {var.name: var for param in main.params for var in _shape_vars(param.ty)}
    steps = relax.Var("step_dims", relax.ShapeType([found[name] for name in stepped]))
    attrs = dict(main.attrs) if main.attrs else {}
    if "num_input" in attrs:
        attrs["num_input"] = int(attrs["num_input"]) + 1
    module["main"] = relax.Function([steps, *main.params], main.body, main.ret_ty, main.is_pure,
                                    tvm.ir.DictAttrs(attrs))
    return module


def expose_input_dims(module, ranges: dict[str, DimRange]):
    """The module with ``main`` taking the inputs alone (plain dims), calling the stepped one."""
    stepped = {r.var_name: r for r in ranges.values() if r.step > 1}
    if not stepped:
        return module

    inner = module["main"]
    steps, *params = inner.params
    plain = {name: tirx.Var(r.name, "int64") for name, r in stepped.items()}
    outer_params = [relax.Var(p.name, _with_plain_dims(p.ty, plain, stepped)) for p in params]
    count = relax.ShapeExpr([tirx.floordiv(plain[var.name], stepped[var.name].step)
                             for var in steps.ty.values])
    module = tvm.IRModule({gv: f for gv, f in module.functions_items() if gv.name_hint != "main"},
                          attrs=module.attrs)
    # A BlockBuilder types the callee's GlobalVar and the call (a bare GlobalVar and Call have
    # none, and relax.Function and Normalize refuse them).
    builder = relax.BlockBuilder(module)
    callee = builder.add_func(inner.with_attr("global_symbol", STEPPED_MAIN), STEPPED_MAIN)
    bounds = {r.name: (r.low, r.high) for r in stepped.values()}
    with builder.function("main", outer_params, attrs={
            "num_input": len(outer_params),
            "tir_var_lower_bound": {n: lo for n, (lo, _) in bounds.items()},
            "tir_var_upper_bound": {n: hi for n, (_, hi) in bounds.items()}}):
        builder.emit_func_output(builder.emit(relax.Call(callee, [count, *outer_params])))
    return builder.get()


def _shape_vars(ty) -> list:
    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None) or []
    return [var for dim in values for var in collect_vars_used_in_prim_expr(dim)]


def _with_plain_dims(ty, plain: dict, stepped: dict):
    """``R.Tensor((1, 3, 32 * h, 32 * w))`` -> ``R.Tensor((1, 3, height, width))``."""
    dims = []
    for dim in ty.shape.values:
        names = [var.name for var in collect_vars_used_in_prim_expr(dim)]
        dims.append(plain[names[0]] if len(names) == 1 and names[0] in stepped else dim)
    return relax.TensorType(dims, ty.dtype)
