"""Element-wise work after an epilogue composite goes into it, whatever its spelling.

The epilogue patterns (``conv_epilogue``, ``gemm_epilogue``, ...) name the chains they know:
bias, one activation, a residual add. Real models put more after a conv or a matmul: PP-LCNetV3
(PaddleOCR) scales and shifts by learned scalars before and after every HardSwish, other
exporters leave a Mul by a constant or a cast. Each such step would be a kernel of its own that
reads and writes the whole map. Here the composite takes every element-wise op that follows it
and reads only the composite's result, constants and at most one residual tensor of the
result's shape, for as long as exactly one value of the grown chain is used outside it; the
kernel schedules compute these steps on the output tile like the rest of the epilogue. A
squeeze of axis 2 that alone reads the result (a Conv1d's row, ``Conv1dAsConv2d``) ends the
tail: the kernel writes the row squeezed instead of a copy kernel doing it.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax
import tvm.relax.utils  # noqa: F401  (copy_with_new_vars)

from ..patterns.base import same_dims, shape_dims
from .pad_conv_channels import QUANTIZATION_OPS
from .rebinding import composites_of, users_by_index, vars_in, with_main_blocks

# Float math on each element alone: arithmetic, the activations, and a log-mel spectrogram's
# log or a norm's square root (BatchSharedWeightMatmuls stacks the same ops after its matmuls).
ELEMENTWISE_MATH_OPS = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
    "relax.clip", "relax.nn.relu", "relax.nn.leakyrelu", "relax.sigmoid", "relax.tanh", "relax.nn.silu",
    "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.negative",
    "relax.log", "relax.exp", "relax.sqrt", "relax.rsqrt", "relax.abs", "relax.power",
})
# and a quantized conv's requantization and the QuantizeLinear/DequantizeLinear between layers
ELEMENTWISE_OPS = ELEMENTWISE_MATH_OPS | {"relax.round", "relax.astype"} | QUANTIZATION_OPS
SUFFIX = "_elementwise"


@dataclasses.dataclass
class AbsorbedTail:
    """One composite grown by a tail: the tail bindings it took (the first of them read the
    composite's result as its argument ``operand``), and the variable now bound to its result."""

    absorbed: list[str]
    first: relax.Var
    operand: int
    output: str


def absorb_elementwise_tails(mod: tvm.IRModule, rule_names: set[str]) -> tuple[tvm.IRModule, list[AbsorbedTail]]:
    """Grow every composite of ``rule_names`` in ``main`` by the element-wise ops after it."""
    main = mod["main"]
    composites = composites_of(mod, rule_names)
    if not composites:
        return mod, []
    absorbed: list[AbsorbedTail] = []
    builder = relax.BlockBuilder(mod)
    blocks = []
    returned = vars_in(main.body.body)
    for block in main.body.blocks:
        bindings = list(block.bindings)
        users = users_by_index(bindings)
        for index in range(len(bindings)):
            binding = bindings[index]
            if binding is None or not isinstance(binding.value, relax.Call) or binding.value.op not in composites:
                continue
            tail = _tail(bindings, index, users, returned)
            if not tail:
                continue
            old_gvar = binding.value.op
            grown, externals = _grown_function(builder, composites[old_gvar], binding.var,
                                               [bindings[i] for i in tail])
            # The builder keeps one function per distinct structure, as FuseOpsByPattern does.
            new_gvar = builder.add_func(grown, old_gvar.name_hint + SUFFIX)
            exit_binding = bindings[tail[-1]]
            operand = next(k for k, arg in enumerate(bindings[tail[0]].value.args) if arg.same_as(binding.var))
            call = builder.normalize(relax.Call(new_gvar, [*binding.value.args, *externals]))
            bindings[tail[-1]] = relax.VarBinding(exit_binding.var, call)
            absorbed.append(AbsorbedTail([str(bindings[i].var.name) for i in tail], bindings[tail[0]].var,
                                         operand, str(exit_binding.var.name)))
            bindings[index] = None
            for i in tail[:-1]:
                bindings[i] = None
        kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(kind([b for b in bindings if b is not None]))
    if not absorbed:
        return mod, []
    return with_main_blocks(builder, mod, blocks, composites), absorbed


def _tail(bindings: list, start: int, users: dict, returned: set) -> list[int]:
    """Indices of the longest chain after ``bindings[start]`` with a single value used outside."""
    result = bindings[start].var
    shape = shape_dims(result)  # symbolic dims too: a step joins only if provably of this very shape
    if shape is None:
        return []
    inside = {result}
    residuals = 0
    chain: list[int] = []
    best: list[int] = []
    # Past the last reader of the chain's values nothing can join it: the walk stops there, not at
    # the block's end (a block of an unrolled decoder holds thousands of bindings).
    horizon = max(users.get(result, ()), default=start)
    index = start
    while index < min(horizon, len(bindings) - 1):
        index += 1
        binding = bindings[index]
        value = binding.value if binding is not None else None
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name in ELEMENTWISE_OPS and any(arg in inside for arg in value.args)
                and same_dims(shape_dims(binding.var), shape)):
            continue
        others = [arg for arg in value.args if isinstance(arg, relax.Var) and arg not in inside]
        if others and not (value.op.name == "relax.add" and len(others) == 1 and residuals == 0
                           and same_dims(shape_dims(others[0]), shape)):
            continue
        residuals += bool(others)
        inside.add(binding.var)
        horizon = max([horizon, *users.get(binding.var, ())])
        chain.append(index)
        members = {start, *chain}
        exits = {var for var in inside if users.get(var, set()) - members or var in returned}
        if exits <= {binding.var}:
            best = list(chain)
    return best + _trailing_squeeze(bindings, start, best, users)


def _trailing_squeeze(bindings: list, start: int, chain: list[int], users: dict) -> list[int]:
    """The squeeze of a unit axis that alone reads the chain's result (a Conv1d computed as a
    one-row Conv2d): written squeezed by the kernel, it is no copy of its own."""
    end = bindings[chain[-1] if chain else start].var
    readers = users.get(end, set())
    if len(readers) != 1:
        return []
    (index,) = readers
    value = bindings[index].value if bindings[index] is not None else None
    if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.squeeze"
            and value.args[0].same_as(end) and len(shape_dims(end) or ()) == 4
            and [int(a) for a in value.attrs.axis or ()] == [2]):
        return [index]
    return []



def _grown_function(builder: relax.BlockBuilder, func: relax.Function, result: relax.Var,
                    tail: list) -> tuple[relax.Function, list]:
    """``func`` with the tail bindings appended; the tail's other operands become parameters."""
    func = relax.utils.copy_with_new_vars(func)  # a function may be called from several places
    (block,) = func.body.blocks
    inner = list(block.bindings)
    # The old result becomes an intermediate of the grown function.
    old_output = inner[-1].var
    intermediate = relax.DataflowVar(old_output.name, old_output.ty)
    inner[-1] = relax.VarBinding(intermediate, inner[-1].value)
    remap = {result: intermediate}
    externals: list = []
    params = list(func.params)
    for position, binding in enumerate(tail):
        args = []
        for arg in binding.value.args:
            if not isinstance(arg, (relax.Var, tvm.ir.GenericConst)):  # clip's bounds: stay as they are
                args.append(arg)
                continue
            if arg not in remap:
                param = relax.Var(f"tail_param_{len(externals)}", arg.ty)
                externals.append(arg)
                params.append(param)
                remap[arg] = param
            args.append(remap[arg])
        kind = relax.Var if position == len(tail) - 1 else relax.DataflowVar
        var = kind(binding.var.name, binding.var.ty)
        call = builder.normalize(relax.Call(binding.value.op, args, binding.value.attrs, binding.value.ty_args))
        inner.append(relax.VarBinding(var, call))
        remap[binding.var] = var
    output = remap[tail[-1].var]
    grown = relax.Function(params, relax.SeqExpr([relax.DataflowBlock(inner)], output),
                           output.ty, func.is_pure, func.attrs)
    composite = str(func.attrs["Composite"])
    return grown.with_attr("Composite", composite + SUFFIX), externals
