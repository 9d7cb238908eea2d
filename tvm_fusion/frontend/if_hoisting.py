"""Top-level If nodes inlined: both branches in the main graph, each output a ``Where`` on the
condition.

Silero VAD's whole network is an ``If`` on its sample-rate input: one branch per rate. The
shape subgraphs inside the branches (pads computed from the input length) are out of reach of
the shape folding before import, which sees only the main graph, so TVM's importer meets a
dynamic Pad and gives up; the patterns and ``inspect``'s coverage would not see the branches
either. TVM's own If import computes both branches anyway and then picks one; written as
``Where(cond, then_value, else_value)`` the same computation is an ordinary graph that folds,
fuses and is covered like any other.

``Where`` broadcasts where ``If`` would not, so a hoisted model is used only when each pair of
selected values has one known shape after simplification (``same_shapes``); otherwise the If
stays and TVM's importer takes it. Branches with subgraphs of their own are left as they are.

An If whose condition depends on shapes only (torch's squeeze-if-size-1, nested in silero VAD's
spox export) has its branches of different shapes by design; once the shapes are bound, its
condition is a constant, and ``select_known_branches`` keeps the taken branch alone. So it does
for an If on a pinned input (``--input-value sr=16000``): silero's spox export needs that, as
its 8 kHz branch cannot run on 512 samples at all.

An If still undecided after that (its condition reads an input's value) can be built once per
branch (``dispatch/branches.py``): ``take_branch`` is the model as one branch computes it,
``condition_model`` the condition alone, and ``inputs_taking`` finds input values that take a
given branch, so that compile verifies both.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .input_binding import graph_inputs
from .shape_values import ancestors, evaluate, shape_dependent

SELECT = "/select_"


def hoist_ifs(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` with each hoistable top-level If inlined (Ifs nested in its branches first),
    or None when there is none."""
    flat = _flatten(model.graph)
    if flat is None:
        return None
    inlined = onnx.ModelProto()
    inlined.CopyFrom(model)
    for field, values in zip(("node", "initializer"), flat):
        del getattr(inlined.graph, field)[:]
        getattr(inlined.graph, field).extend(values)
    return inlined


def _flatten(graph: onnx.GraphProto) -> tuple[list, list] | None:
    """The nodes and initializers of ``graph`` with its hoistable Ifs inlined; None if none is."""
    nodes, initializers = [], list(graph.initializer)
    hoisted = False
    for index, node in enumerate(graph.node):
        branches = _branches(node)
        if branches is None:
            nodes.append(node)
            continue
        hoisted = True
        prefix = node.name or f"If_{index}"
        scalar_cond = f"{prefix}/cond"
        initializers.append(numpy_helper.from_array(np.zeros(0, np.int64), f"{prefix}/scalar_shape"))
        nodes.append(helper.make_node("Reshape", [node.input[0], f"{prefix}/scalar_shape"], [scalar_cond],
                                      name=scalar_cond))
        selected = []
        for name, (branch, branch_nodes, branch_initializers) in branches:
            renamed = _inline(branch_nodes, branch_initializers, f"{prefix}/{name}/", nodes, initializers)
            selected.append([renamed.get(out.name, out.name) for out in branch.output])
        for k, (output, then_value, else_value) in enumerate(zip(node.output, *selected)):
            nodes.append(helper.make_node("Where", [scalar_cond, then_value, else_value], [output],
                                          name=f"{prefix}{SELECT}{k}"))
    return (nodes, initializers) if hoisted else None


def _branches(node: onnx.NodeProto) -> list | None:
    """For an If with tensor outputs whose branches flatten to plain nodes: (name, (branch,
    its nodes, its initializers)) for then and else; None for any other node."""
    if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
        return None
    graphs = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    if set(graphs) != {"then_branch", "else_branch"}:
        return None
    branches = []
    for name in ("then_branch", "else_branch"):
        graph = graphs[name]
        if any(out.type.WhichOneof("value") not in (None, "tensor_type") for out in graph.output):
            return None  # a sequence or optional: Where cannot select it (spox leaves tensors untyped)
        branch_nodes, branch_initializers = _flatten(graph) or (list(graph.node), list(graph.initializer))
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for n in branch_nodes for a in n.attribute):
            return None  # a Loop or an If that stays: its subgraph reads the branch's names
        branches.append((name, (graph, branch_nodes, branch_initializers)))
    return branches


def _inline(branch_nodes: list, branch_initializers: list, prefix: str, nodes: list,
            initializers: list) -> dict[str, str]:
    """Append a branch's nodes and initializers with its own names prefixed (outer names it
    reads stay as they are); return the renaming."""
    renamed = {init.name: prefix + init.name for init in branch_initializers}
    for init in branch_initializers:
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = renamed[init.name]
        initializers.append(copy)
    for node in branch_nodes:
        for out in node.output:
            if out:
                renamed[out] = prefix + out
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = prefix + (node.name or node.output[0])
        del copy.input[:]
        copy.input.extend(renamed.get(name, name) for name in node.input)
        del copy.output[:]
        copy.output.extend(renamed.get(name, name) for name in node.output)
        nodes.append(copy)
    return renamed


def select_known_branches(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> onnx.ModelProto:
    """``model`` with each hoisted ``Where`` whose condition the bound shapes or pinned inputs
    decide (the same at every feed's sizes) replaced by an Identity of the taken value, and the
    branches no output reads dropped.

    Outer selects are decided first: a nested condition may read a shape past an outer select,
    and only once that select is decided can ORT compute it (the branch not taken may fail,
    squeezing an axis that is not 1)."""
    if not any(_is_select(node) for node in model.graph.node):
        return model
    resolved = onnx.ModelProto()
    resolved.CopyFrom(model)
    while True:
        undecided = [node for node in resolved.graph.node if _is_select(node)]
        static, _ = shape_dependent(resolved)
        past_undecided = {node.output[0] for node in undecided}  # and what is computed from them
        for node in resolved.graph.node:  # topologically sorted
            if any(name in past_undecided for name in node.input):
                past_undecided.update(node.output)
        ready = [node for node in undecided if node.input[0] in static and node.input[0] not in past_undecided]
        runs = evaluate(resolved, [node.input[0] for node in ready], feeds) if ready else None
        if runs is None:
            break
        decided = 0
        for node, *values in zip(ready, *runs):
            if all(np.array_equal(value, values[0]) for value in values):
                _decide(node, bool(values[0]))
                decided += 1
        if not decided:
            break
        # The branches not taken go at once: shape inference (for the next round's types) may fail on them.
        _drop_dead_nodes(resolved)
    return resolved


def undecided_conditions(model: onnx.ModelProto) -> list[str]:
    """The conditions (bool scalars) of the hoisted selects still in ``model``, in graph order:
    one per If whose branch only the input values decide."""
    conditions: list[str] = []
    for node in model.graph.node:
        if _is_select(node) and node.input[0] not in conditions:
            conditions.append(node.input[0])
    return conditions


def take_branch(model: onnx.ModelProto, condition: str, taken: bool) -> onnx.ModelProto:
    """``model`` as it computes when ``condition`` is ``taken``: each select on it an Identity
    of that side, the other branch gone."""
    resolved = onnx.ModelProto()
    resolved.CopyFrom(model)
    for node in resolved.graph.node:
        if _is_select(node) and node.input[0] == condition:
            _decide(node, taken)
    _drop_dead_nodes(resolved)
    return resolved


def condition_model(model: onnx.ModelProto, condition: str) -> onnx.ModelProto:
    """The part of ``model`` that computes ``condition``, as a model whose one output it is (a
    bool scalar); its inputs are ``model``'s, so that it is called with the same arguments."""
    part = onnx.ModelProto()
    part.CopyFrom(model)
    del part.graph.output[:]
    part.graph.output.append(helper.make_tensor_value_info(condition, onnx.TensorProto.BOOL, []))
    _drop_dead_nodes(part)
    read = {name for node in part.graph.node for name in node.input}
    kept = [init for init in part.graph.initializer if init.name in read]
    del part.graph.initializer[:]
    part.graph.initializer.extend(kept)
    return part


def shared_weight_share(model: onnx.ModelProto, condition: str) -> float:
    """The share of ``model``'s weight bytes that both branches of ``condition`` read: what a
    build per branch would hold twice."""
    sizes = {init.name: int(np.prod(init.dims)) * helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
             for init in model.graph.initializer}  # from dims: the weights' data may be elided
    read = [{name for node in take_branch(model, condition, taken).graph.node for name in node.input}
            for taken in (True, False)]
    total = sum(sizes.values())
    return sum(size for name, size in sizes.items() if name in read[0] and name in read[1]) / total if total else 0.0


def inputs_taking(model: onnx.ModelProto, condition: str, feed: dict[str, np.ndarray],
                  taken: bool) -> dict[str, np.ndarray] | None:
    """``feed`` itself when ``condition`` is ``taken`` on it, else ``feed`` with the inputs
    ``condition`` reads changed so that it is, or None when no value tried does that. Tried:
    each number the condition's nodes hold (``sr == 16000`` holds 16000), 0 and 1, filled into
    every small input it reads."""
    nodes = ancestors(model, [condition])
    read = {name for node in nodes for name in node.input}
    deciding = [name for name, value in feed.items() if name in read and value.size <= _MAX_DECIDING_ELEMENTS]
    held = {init.name: init for init in model.graph.initializer}
    numbers = {0.0, 1.0}
    for node in nodes:
        tensors = [held[name] for name in node.input if name in held]
        tensors += [a.t for a in node.attribute if a.type == onnx.AttributeProto.TENSOR]
        arrays = [numpy_helper.to_array(t) for t in tensors]
        numbers.update(float(v) for a in arrays if a.dtype.kind in "biuf" for v in a.ravel()[:_MAX_DECIDING_ELEMENTS])
    tried = [feed] + [{**feed, **{name: np.full(feed[name].shape, number, feed[name].dtype) for name in deciding}}
             for number in sorted(numbers)]
    results = evaluate(model, [condition], tried if deciding else [feed], {condition: onnx.TensorProto.BOOL})
    return next((feed for feed, (value,) in zip(tried, results or []) if bool(value) == taken), None)


# An input of at most this many elements can decide an If (a sample rate, a flag, a mode).
_MAX_DECIDING_ELEMENTS = 16


def _decide(select: onnx.NodeProto, taken: bool) -> None:
    """A hoisted select turned into an Identity of the value the branch ``taken`` computes."""
    value = select.input[1] if taken else select.input[2]
    select.CopyFrom(helper.make_node("Identity", [value], list(select.output), name=select.name))


def _drop_dead_nodes(model: onnx.ModelProto) -> None:
    """Remove the nodes no graph output reads."""
    live = ancestors(model, [value.name for value in model.graph.output])
    del model.graph.node[:]
    model.graph.node.extend(live)


def deciding_inputs(model: onnx.ModelProto) -> list[str]:
    """The graph inputs whose values (not shapes) decide a top-level If: what ``--input-value``
    could pin when the If does not import."""
    inputs = {value.name for value in graph_inputs(model)}
    conditions = [node.input[0] for node in model.graph.node if node.op_type == "If"]
    read = set(conditions)
    for node in ancestors(model, conditions):
        if node.op_type not in ("Shape", "Size"):
            read.update(node.input)
    return sorted(read & inputs)


def _is_select(node: onnx.NodeProto) -> bool:
    """A ``Where`` that ``hoist_ifs`` wrote for an If's output."""
    return node.op_type == "Where" and SELECT in node.name


def same_shapes(model: onnx.ModelProto) -> bool:
    """Whether every hoisted ``Where`` left in ``model`` selects between two values of one known
    shape (so it selects, never broadcasts)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - a graph shape inference rejects proves nothing
        return False
    shapes = {value.name: _dims(value) for value in [*inferred.graph.value_info, *inferred.graph.output,
                                                     *inferred.graph.input]}
    shapes.update({init.name: tuple(init.dims) for init in inferred.graph.initializer})
    for node in inferred.graph.node:
        if _is_select(node):
            first, second = shapes.get(node.input[1]), shapes.get(node.input[2])
            if first is None or first != second or None in first:
                return False
    return True


def _dims(value: onnx.ValueInfoProto) -> tuple | None:
    """Each dim's size, or its name (a ranged dim: one name is one size); None where unknown."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
