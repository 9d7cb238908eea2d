"""BatchSharedWeightMatmuls: independent matmuls by one constant weight run as one matmul.

An RNN unrolled by its exporter (torch's legacy exporter on a hand-written LSTM cell, tf2onnx
on a static loop) projects each time step's input by the same weight in a matmul of its own:
captcha-crnn's bidirectional LSTM makes 40 products of a 1 x 4096 row by a 4096 x 400 weight,
each reading the 6.5 MB weight from L3 or DRAM for 3.3 MFLOP (12 % of that model's time at
29 GFLOP/s). The inputs of those steps do not depend on one another's results, so the rows can
be stacked: ``concat(x_1..x_n) @ W`` reads the weight once and runs as a real matmul; each step
then takes its rows back with a slice. The importer folds ``W^T`` into a constant per node, so
equal weights are found by value, not by identity (which also leaves one copy of the weight in
the compiled module instead of one per step).

Only matmuls whose left operand does not depend, through any chain, on another member's result
are stacked (a recurrent ``h_{t-1} @ W_hh`` never is). The block's bindings are then reordered
so that the stacked matmul comes before the first step that reads one of its slices, with the
left operands' own chains pulled up before it; everything else keeps its order.

What every step does to its product alone, the same for each, row by row (the bias add, a
sigmoid: SLANet's box head ``sigmoid(h W + b)`` in each of its 501 decoding steps), is done
once on the stacked product before the slices (``_common_epilogue``): the gemm epilogue then
fuses it into the stacked matmul instead of leaving a small kernel per step. ``report`` records
the stacked bindings as rewrites of the steps' own, so that the ONNX nodes they came from stay
credited to whatever fuses them.
"""

from __future__ import annotations

import hashlib
import heapq

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..patterns.base import PatternInstance, PatternReport, static_shape
from .absorb_elementwise_tails import ELEMENTWISE_MATH_OPS
from .rebinding import readers_of, rewrite_blocks, vars_in

MATMUL = "relax.matmul"
MIN_MATMULS = 2
PASS_NAME = "batch_shared_weight_matmuls"


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.BatchSharedWeightMatmuls")
class BatchSharedWeightMatmuls:
    def __init__(self, report: PatternReport | None = None):
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_blocks(mod, lambda block: _batch_block(block, self.report))


def _batch_block(block, report: PatternReport | None):
    if not isinstance(block, relax.DataflowBlock):
        return block
    bindings = list(block.bindings)
    groups = _independent_groups(bindings)
    if not groups:
        return block
    builder = relax.BlockBuilder()
    replaced: dict[int, list[relax.VarBinding]] = {}  # first member's index -> the stacked bindings
    removed = set()
    readers = readers_of(bindings)
    position = {binding.var: index for index, binding in enumerate(bindings)}
    for members in groups:
        steps = [members] + _common_epilogue(bindings, members, readers, position)
        replaced[members[0]] = _stacked(builder, [[bindings[i] for i in step] for step in steps], report)
        removed.update(i for step in steps for i in step)
    new = []  # (priority, binding): a stacked group takes its first member's place
    for index, binding in enumerate(bindings):
        if index in replaced:
            new += [(index, b) for b in replaced[index]]
        elif index not in removed:
            new.append((index, binding))
    return relax.DataflowBlock(_reorder(new))


def _independent_groups(bindings: list) -> list[list[int]]:
    """Indices of matmuls by one constant weight (equal by value) whose left operands depend on
    no other member's result; groups of at least ``MIN_MATMULS``."""
    candidates: dict[tuple, list[int]] = {}
    for index, binding in enumerate(bindings):
        key = _weight_key(binding.value)
        if key is not None:
            candidates.setdefault(key, []).append(index)
    groups, readers = [], None
    for indices in candidates.values():
        indices = _same_weight(bindings, indices)
        if len(indices) < MIN_MATMULS:
            continue
        readers = readers or readers_of(bindings)
        # A member's left operand is defined before it, so if it is or descends from a member,
        # that is another member.
        members = {bindings[i].var for i in indices}
        dependent = _descendants(readers, members) | members
        independent = [i for i in indices if bindings[i].value.args[0] not in dependent]
        if len(independent) >= MIN_MATMULS:
            groups.append(independent)
    return groups


def _weight_key(value) -> tuple | None:
    """(weight shape, dtype, digest, the left operand's shape but its rows) for ``x @ C`` with a
    2-D constant ``C`` and a static left operand; None for any other binding."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == MATMUL):
        return None
    lhs, weight = value.args
    if not isinstance(weight, tvm.ir.GenericConst) or len(weight.value.shape) != 2:
        return None
    if value.attrs.out_dtype not in ("", None) and str(value.attrs.out_dtype) != "void":
        return None  # an explicit output type (a mixed-precision product) is left as written
    lhs_shape = static_shape(lhs)
    if lhs_shape is None or len(lhs_shape) < 2 or str(lhs.ty.dtype) != str(weight.value.dtype):
        return None
    array = weight.value.numpy()
    return array.shape, str(array.dtype), hashlib.sha1(array.tobytes()).hexdigest(), tuple(lhs_shape[1:])


def _same_weight(bindings: list, indices: list[int]) -> list[int]:
    """The members whose weight equals the first's (a digest match confirmed by value)."""
    first = bindings[indices[0]].value.args[1].value.numpy()
    return [i for i in indices if np.array_equal(bindings[i].value.args[1].value.numpy(), first)]


def _descendants(readers: dict, roots: set) -> set:
    """Every variable computed from one of ``roots`` (not the roots themselves)."""
    found, frontier = set(), list(roots)
    while frontier:
        for reader in readers.get(frontier.pop(), ()):
            if reader.var not in found:
                found.add(reader.var)
                frontier.append(reader.var)
    return found


def _common_epilogue(bindings: list, members: list[int], readers: dict, position: dict) -> list[list[int]]:
    """The bindings that follow each member's product alike, one list per step (each member's
    binding at that step): while every member's last result is a dataflow variable read by one
    binding alone, a call of it and of constants broadcast along the rows, of its shape, and the
    same call for every member. An element-wise op treats each row alone, so on the stacked rows
    it equals each step's; the ops are the float math the epilogue tails take
    (``ELEMENTWISE_MATH_OPS``), so that the gemm epilogue takes what is stacked."""
    steps: list[list[int]] = []
    last = list(members)
    while True:
        following = []
        for index in last:
            var = bindings[index].var
            reader = readers.get(var, [])
            if not isinstance(var, relax.DataflowVar) or len(reader) != 1:
                return steps
            following.append(position[reader[0].var])
        templates = [_row_wise_template(bindings[i].value, bindings[j].var) for i, j in zip(following, last)]
        if templates[0] is None or not all(t is not None and tvm_ffi.structural_equal(t, templates[0])
                                           for t in templates[1:]):
            return steps
        steps.append(following)
        last = following


_PLACEHOLDER = relax.Var("row_wise_operand")


def _row_wise_template(value, var):
    """``value`` with ``var`` as a shared placeholder, if it is a row-wise op of ``var`` alone
    (``_common_epilogue``); else None."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in ELEMENTWISE_MATH_OPS):
        return None
    shape = static_shape(var)
    if shape is None or static_shape(value) != shape or sum(a.same_as(var) for a in value.args) != 1:
        return None
    for arg in value.args:
        if arg.same_as(var):
            continue
        constant = static_shape(arg) if isinstance(arg, tvm.ir.GenericConst) else None
        if constant is None or len(constant) > len(shape) or any(d != 1 for d in constant[:-1]):
            return None  # not a constant, or not the same for every row
    args = [_PLACEHOLDER if a.same_as(var) else a for a in value.args]
    return relax.Call(value.op, args, value.attrs, value.ty_args)


def _stacked(builder: relax.BlockBuilder, steps: list[list], report: PatternReport | None) -> list:
    """``concat(lhs..) @ W``, then the common epilogue's steps on the stacked rows, and each
    member's rows sliced back under its last binding's variable."""
    matmuls = steps[0]
    lhs = [binding.value.args[0] for binding in matmuls]
    weight = matmuls[0].value.args[1]
    first = matmuls[0].var
    rows_value = builder.normalize(relax.op.concat(lhs, axis=0))
    rows = relax.DataflowVar(f"{first.name}_rows", rows_value.ty)
    stacked_value = builder.normalize(relax.op.matmul(rows, weight))
    stacked = relax.DataflowVar(f"{first.name}_stacked", stacked_value.ty)
    result = [relax.VarBinding(rows, rows_value), relax.VarBinding(stacked, stacked_value)]
    for step, previous in zip(steps, [None] + steps[:-1]):
        if previous is not None:  # the epilogue's call, on the stacked rows instead of one step's
            value = step[0].value
            args = [stacked if a.same_as(previous[0].var) else a for a in value.args]
            value = builder.normalize(relax.Call(value.op, args, value.attrs, value.ty_args))
            stacked = relax.DataflowVar(f"{step[0].var.name}_stacked", value.ty)
            result.append(relax.VarBinding(stacked, value))
        if report is not None:
            report.instances.append(PatternInstance(PASS_NAME, PASS_NAME, stacked.name, [b.var.name for b in step]))
    start = 0
    for matmul, binding in zip(matmuls, steps[-1]):
        count = int(matmul.value.args[0].ty.shape[0])
        part = builder.normalize(relax.op.strided_slice(stacked, axes=[0], begin=[start], end=[start + count],
                                                        assume_inbound=True))
        result.append(relax.VarBinding(binding.var, part))
        start += count
    return result


def _reorder(prioritized: list) -> list:
    """A topological order of the bindings that runs each as early as its priority says: a
    binding's priority is the least of its own and its readers', so a stacked matmul's left
    operands (defined late, one per step) are pulled up to run before it."""
    bindings = [binding for _, binding in prioritized]
    position = {binding.var: index for index, binding in enumerate(bindings)}
    inputs = [[position[v] for v in vars_in(binding.value) if v in position] for binding in bindings]
    priority = [p for p, _ in prioritized]
    readers: list[list[int]] = [[] for _ in bindings]
    for index, deps in enumerate(inputs):
        for dep in deps:
            readers[dep].append(index)
    for index in reversed(range(len(bindings))):
        for dep in inputs[index]:
            priority[dep] = min(priority[dep], priority[index])
    waiting = [len(set(deps)) for deps in inputs]
    ready = [(priority[i], i) for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, index = heapq.heappop(ready)
        order.append(bindings[index])
        for reader in set(readers[index]):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (priority[reader], reader))
    return order

