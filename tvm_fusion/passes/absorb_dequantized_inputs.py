"""A quantized map's dequantization goes into the conv kernel that reads it.

Between two layers of a quantized model (QDQ, QOperator) the map is stored as bytes: the
QuantizeLinear at the end of one layer's kernel writes uint8 (or int8). The next conv, computed
in float32 on whole numbers where its depth is too short for the int8 kernels, reads
``astype(q, "float32") - zero_point``: as ops of their own those make a kernel that reads the
bytes and writes a float32 map four times their size, which the conv then reads back. Here the
composite of a rule that ``absorbs_dequantized_input`` takes that cast (and the subtraction of
scalar constants after it) into its prologue when nothing else reads them: the kernel loads the
bytes and converts each value as it reads it (a cast and a subtraction, which the conv
schedules inline into their input loads).
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax
import tvm.relax.utils  # noqa: F401  (copy_with_new_vars)

from ..patterns.base import scalar_constant
from .rebinding import composites_of, users_by_index, vars_in, with_main_blocks

SUFFIX = "_dequantized"
_CAST, _SUBTRACT = tvm.ir.Op.get("relax.astype"), tvm.ir.Op.get("relax.subtract")
_BYTE_DTYPES = ("uint8", "int8")


@dataclasses.dataclass
class AbsorbedHead:
    """One composite grown by its input's dequantization: the bindings it took and the variable
    bound to the composite's result (which does not change)."""

    absorbed: list[str]
    output: str


def absorb_dequantized_inputs(mod: tvm.IRModule, rule_names: set[str]) -> tuple[tvm.IRModule, list[AbsorbedHead]]:
    """Grow every composite of ``rule_names`` called in ``main`` by the dequantization of its
    first argument (its data), where that argument is one."""
    main = mod["main"]
    composites = composites_of(mod, rule_names)
    if not composites:
        return mod, []
    absorbed: list[AbsorbedHead] = []
    builder = relax.BlockBuilder(mod)
    returned = vars_in(main.body.body)
    blocks = []
    for block in main.body.blocks:
        bindings = list(block.bindings)
        position = {binding.var: index for index, binding in enumerate(bindings)}
        users = users_by_index(bindings)
        for index, binding in enumerate(bindings):
            call = binding.value if binding is not None else None
            if not (isinstance(call, relax.Call) and call.op in composites and call.args):
                continue
            head = _dequantization(bindings, position, users, returned, call.args[0])
            if head is None:
                continue
            source = bindings[head[0]].value.args[0]
            grown, constants = _grown_function(builder, composites[call.op], [bindings[i] for i in head], source)
            new_gvar = builder.add_func(grown, call.op.name_hint + SUFFIX)
            bindings[index] = relax.VarBinding(binding.var, builder.normalize(
                relax.Call(new_gvar, [source, *call.args[1:], *constants])))
            absorbed.append(AbsorbedHead([str(bindings[i].var.name) for i in head], str(binding.var.name)))
            for i in head:
                bindings[i] = None
        kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(kind([b for b in bindings if b is not None]))
    if not absorbed:
        return mod, []
    return with_main_blocks(builder, mod, blocks, composites), absorbed


def _dequantization(bindings: list, position: dict, users: dict, returned: set, data: relax.Expr
                    ) -> list[int] | None:
    """The indices of ``dequantization_chain(data)``'s bindings, each read by the next alone (the
    last by the composite); None where ``data`` is no such chain."""
    chain = dequantization_chain(data, lambda var: bindings[position[var]].value
                                 if var in position and bindings[position[var]] is not None else None)
    if chain is None or any(var in returned or len(users.get(var, ())) != 1 for var in chain):
        return None
    return [position[var] for var in chain]


def dequantization_chain(data: relax.Expr, value_of) -> list | None:
    """The variables from ``astype(bytes, "float32")`` to ``data``, each after the first less a
    scalar constant (a DequantizeLinear's centered values), the cast's first; None where ``data``
    is anything else. ``value_of(var)``: the value bound to ``var`` (None where unbound)."""
    chain: list = []
    value = data
    while True:
        call = value_of(value) if isinstance(value, relax.Var) else None
        if not isinstance(call, relax.Call):
            return None
        chain.insert(0, value)
        if call.op == _SUBTRACT and scalar_constant(call.args[1]) is not None:
            value = call.args[0]
            continue
        if call.op == _CAST and str(call.ty.dtype) == "float32" and str(call.args[0].ty.dtype) in _BYTE_DTYPES:
            return chain
        return None


def _grown_function(builder: relax.BlockBuilder, func: relax.Function, head: list,
                    source: relax.Expr) -> tuple[relax.Function, list]:
    """``func`` reading ``source`` (the bytes) as its first parameter, the ``head`` bindings
    (cast, subtractions) computing what it read before; their constants become parameters after
    the others (a primitive function holds no tensor constant), which the call passes."""
    func = relax.utils.copy_with_new_vars(func)  # a function may be called from several places
    data = relax.Var("bytes", source.ty)
    inner, value, constants, params = [], data, [], []
    for binding in head:
        call = binding.value
        args = [value]
        for arg in call.args[1:]:
            param = relax.Var(f"head_param_{len(params)}", arg.ty)
            constants.append(arg)
            params.append(param)
            args.append(param)
        var = relax.DataflowVar(binding.var.name, binding.var.ty)
        inner.append(relax.VarBinding(var, builder.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))))
        value = var
    bound = func.bind_params({func.params[0]: value})  # the body reads the last head binding
    (block,) = bound.body.blocks
    body = relax.SeqExpr([relax.DataflowBlock([*inner, *block.bindings])], bound.body.body)
    grown = relax.Function([data, *bound.params, *params], body, func.ret_ty, func.is_pure, func.attrs)
    return grown.with_attr("Composite", str(func.attrs["Composite"]) + SUFFIX), constants
