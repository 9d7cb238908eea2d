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
"""

from __future__ import annotations

import hashlib
import heapq

import numpy as np
import tvm
from tvm import relax

from ..patterns.base import static_shape
from .rebinding import rewrite_blocks, vars_in

MATMUL = "relax.matmul"
MIN_MATMULS = 2


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.BatchSharedWeightMatmuls")
class BatchSharedWeightMatmuls:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_blocks(mod, _batch_block)


def _batch_block(block):
    if not isinstance(block, relax.DataflowBlock):
        return block
    bindings = list(block.bindings)
    groups = _independent_groups(bindings)
    if not groups:
        return block
    builder = relax.BlockBuilder()
    replaced: dict[int, list[relax.VarBinding]] = {}  # first member's index -> the stacked bindings
    removed = set()
    for members in groups:
        replaced[members[0]] = _stacked(builder, [bindings[i] for i in members])
        removed.update(members)
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
        readers = readers or _readers(bindings)
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


def _readers(bindings: list) -> dict:
    """Variable -> the variables bound to expressions that read it."""
    readers: dict = {}
    for binding in bindings:
        for var in vars_in(binding.value):
            readers.setdefault(var, []).append(binding.var)
    return readers


def _descendants(readers: dict, roots: set) -> set:
    """Every variable computed from one of ``roots`` (not the roots themselves)."""
    found, frontier = set(), list(roots)
    while frontier:
        for reader in readers.get(frontier.pop(), ()):
            if reader not in found:
                found.add(reader)
                frontier.append(reader)
    return found


def _stacked(builder: relax.BlockBuilder, matmuls: list) -> list:
    """``concat(lhs..) @ W`` and each member's rows sliced back under its own variable."""
    lhs = [binding.value.args[0] for binding in matmuls]
    weight = matmuls[0].value.args[1]
    first = matmuls[0].var
    rows_value = builder.normalize(relax.op.concat(lhs, axis=0))
    rows = relax.DataflowVar(f"{first.name}_rows", rows_value.ty)
    stacked_value = builder.normalize(relax.op.matmul(rows, weight))
    stacked = relax.DataflowVar(f"{first.name}_stacked", stacked_value.ty)
    result = [relax.VarBinding(rows, rows_value), relax.VarBinding(stacked, stacked_value)]
    start = 0
    for binding in matmuls:
        count = int(binding.value.args[0].ty.shape[0])
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

