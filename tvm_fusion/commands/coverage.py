"""How much of a model our patterns reached, found on the ONNX graph independently of them.

The patterns match Relax; this module reads the (simplified) ONNX graph with its own, looser
notion of each chain we target: a Softmax between two MatMuls is an attention, a ReduceMean
whose input is also subtracted from it starts a LayerNorm, a Conv with an activation or an add
after it is a conv epilogue, however the exporter spelled the rest. A chain counts as fused
when each of its nodes (for an epilogue: each op after the matmul or conv) ended up in a place
a pattern fired, or in the kernel of an int8 or bf16 matmul or conv, which FuseOps gives its
epilogue (``inspect.own_kernel_groups``). Every chain left unfused is listed
with the near miss recorded at one of its nodes, or, when no check declined it, with the op
sequence no pattern recognized, so a new exporter spelling shows up as work to do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import numpy as np
import onnx
from onnx import numpy_helper

# Ops that only move, view or describe data: not counted as compute nodes.
DATA_MOVEMENT = frozenset({
    "Constant", "ConstantOfShape", "Shape", "Size", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
    "Identity", "Transpose", "Concat", "Split", "Slice", "Gather", "GatherElements", "Expand",
    "Cast", "CastLike", "Tile", "Range", "Dropout", "Pad", "DepthToSpace", "SpaceToDepth",
})
ACTIVATIONS = frozenset({
    "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Gelu",
    "Elu", "Selu", "Softplus", "Mish", "Erf",
})
ELEMENTWISE = ACTIVATIONS | frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Exp", "Log", "Neg", "Abs", "Max", "Min",
    "Cast",
})
_PASS_THROUGH = frozenset({"Cast", "Dropout", "Identity"})
_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
# Between a conv and its epilogue: views, and the transposes channels-last converters put
# there (passes/sink_views.py cancels them).
_EPILOGUE_THROUGH = _VIEWS | {"Transpose"}
# Between the softmax and ·V: casts, dropout, and torch's NaN guard (IsNaN -> Where).
_PROBS_THROUGH = _PASS_THROUGH | {"IsNaN", "Where"}
_SCORE_OPS = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast"})


@dataclasses.dataclass
class Chain:
    """One targeted chain: the concept, its ONNX nodes (indices into the simplified graph)."""

    target: str
    nodes: tuple[int, ...]
    # The nodes that must sit in a pattern's kernel; an epilogue needs only the ops after the
    # matmul/conv (BERT's output-projection bias goes with the residual LayerNorm, as in ONNX
    # Runtime, and the matmul is a kernel of its own).
    required: tuple[int, ...] = ()

    def __post_init__(self):
        self.required = self.required or self.nodes


@dataclasses.dataclass
class UnfusedChain:
    target: str
    nodes: list[str]
    ops: list[str]
    reason: str


@dataclasses.dataclass
class Coverage:
    compute_nodes: int
    fused_compute_nodes: int
    targeted: dict[str, int]
    fused: dict[str, int]
    unfused: list[UnfusedChain]

    @property
    def compute_share(self) -> float:
        """Share of the compute nodes inside a kernel one of our fusions built."""
        return self.fused_compute_nodes / self.compute_nodes if self.compute_nodes else 1.0

    @property
    def targeted_share(self) -> float:
        """Share of the targeted chains that were fused."""
        total = sum(self.targeted.values())
        return sum(self.fused.values()) / total if total else 1.0

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "compute_share": self.compute_share,
                "targeted_share": self.targeted_share}


class _Graph:
    """Producer/consumer lookups and constant values over one ONNX graph."""

    def __init__(self, model: onnx.ModelProto):
        self.nodes = list(model.graph.node)
        self.producer = {out: i for i, node in enumerate(self.nodes) for out in node.output if out}
        self.consumers: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            for name in node.input:
                self.consumers.setdefault(name, []).append(i)
        self.constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for node in self.nodes:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self.constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)

    def op(self, index: int | None) -> str | None:
        return self.nodes[index].op_type if index is not None else None

    def parent(self, index: int, slot: int = 0) -> int | None:
        inputs = self.nodes[index].input
        return self.producer.get(inputs[slot]) if slot < len(inputs) else None

    def parents(self, index: int) -> list[int]:
        return [p for p in (self.producer.get(name) for name in self.nodes[index].input) if p is not None]

    def children(self, index: int) -> list[int]:
        return [c for out in self.nodes[index].output for c in self.consumers.get(out, [])]

    def constant(self, index: int, slot: int) -> np.ndarray | None:
        inputs = self.nodes[index].input
        if slot >= len(inputs):
            return None
        if inputs[slot] in self.constants:
            return self.constants[inputs[slot]]
        producer = self.producer.get(inputs[slot])
        return self.constant(producer, 0) if producer is not None and self.op(producer) in _PASS_THROUGH else None

    def has_constant_near(self, index: int, value: float, depth: int) -> bool:
        """Whether a scalar constant ``value`` feeds ``index`` or one of its ancestors up to ``depth``."""
        frontier, seen = [index], set()
        for _ in range(depth + 1):
            following = []
            for i in frontier:
                if i in seen:
                    continue
                seen.add(i)
                for slot in range(len(self.nodes[i].input)):
                    const = self.constant(i, slot)
                    if const is not None and const.size == 1 and np.isclose(float(const.reshape(())), value, rtol=1e-3):
                        return True
                following += self.parents(i)
            frontier = following
        return False

    def walk_back(self, index: int, through: frozenset, depth: int) -> Iterable[int]:
        """Ancestors reached through ops in ``through``, up to ``depth`` steps."""
        return self._walk(index, self.parents, through, depth)

    def walk_forward(self, index: int, through: frozenset, depth: int) -> Iterable[int]:
        """Descendants reached through ops in ``through``, up to ``depth`` steps."""
        return self._walk(index, self.children, through, depth)

    def _walk(self, index: int, step: Callable[[int], list[int]], through: frozenset,
              depth: int) -> Iterable[int]:
        """Every node ``step`` reaches from ``index`` in up to ``depth`` steps, going on only
        from nodes whose op is in ``through``."""
        frontier = [index]
        for _ in range(depth):
            frontier = [n for i in frontier for n in step(i)]
            yield from frontier
            frontier = [n for n in frontier if self.op(n) in through]


def find_chains(model: onnx.ModelProto) -> list[Chain]:
    """Every chain one of our patterns targets, by what it computes."""
    g = _Graph(model)
    chains: list[Chain] = []
    in_attention: set[int] = set()
    for i, node in enumerate(g.nodes):
        if node.op_type != "Softmax":
            continue
        scores = next((p for p in g.walk_back(i, _SCORE_OPS, 4) if g.op(p) == "MatMul"), None)
        values = next((c for c in g.walk_forward(i, _PROBS_THROUGH, 3) if g.op(c) == "MatMul"), None)
        if scores is not None and values is not None:
            chains.append(Chain("attention", (scores, i, values)))
            in_attention |= {scores, values}
        elif g.op(g.parent(i)) in _SCORE_OPS - {"Cast"} and not _is_linear_bias(g, g.parent(i)):
            # A lone Softmax is one kernel anyway; its prologue is the work to fuse.
            chains.append(Chain("softmax", (g.parent(i), i)))
    for i, node in enumerate(g.nodes):
        op = node.op_type
        if op == "Exp" and g.op(g.parent(i)) == "Sub" and g.op(g.parent(g.parent(i), 1)) == "ReduceMax":
            divide = [c for c in g.children(i) if g.op(c) == "Div"]
            chains.append(Chain("softmax", (g.parent(g.parent(i), 1), i, *divide)))
        elif op in ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"):
            # A whole norm op is one kernel already; the add before it (skip_layernorm,
            # skip_rms_norm) is what there is to fuse.
            if g.op(g.parent(i)) == "Add":
                chains.append(Chain("layer_norm" if op == "LayerNormalization" else "rms_norm", (g.parent(i), i)))
        elif op == "ReduceMean":
            chains.extend(_norm_chain(g, i))
        elif op in ("Gelu", "Erf") or (op == "Tanh" and g.has_constant_near(i, 0.044715, 4)):
            chains.append(Chain("gelu", (i,)))
        elif op == "HardSwish":
            chains.append(Chain("hardswish", (i,)))
        elif op == "HardSigmoid" or (op == "Clip" and g.op(g.parent(i)) == "Add"
                                     and g.has_constant_near(i, 3.0, 1)):
            chains.append(_hard_gate_chain(g, i))
        elif op == "Sigmoid" and any(g.op(c) == "Mul" and g.nodes[i].input[0] in g.nodes[c].input
                                     for c in g.children(i)):
            chains.append(Chain("silu", (i,)))
        elif op in ("MatMul", "Gemm") and i not in in_attention:
            chains.extend(_epilogue_chain(g, i, "gemm_epilogue"))
        elif op == "Conv":
            chains.extend(_epilogue_chain(g, i, "conv_epilogue"))
    return chains


def _is_linear_bias(g: _Graph, op: int) -> bool:
    """``x @ W + b`` with constant ``W`` and ``b``: a classifier head's bias before its softmax.
    It belongs to the linear layer's epilogue (counted there), where it costs nothing."""
    linear = g.parents(op)
    return (g.op(op) == "Add" and len(linear) == 1 and g.op(linear[0]) in ("MatMul", "Gemm")
            and any(g.constant(op, slot) is not None for slot in (0, 1))
            and any(g.constant(linear[0], slot) is not None for slot in (0, 1)))


def _norm_chain(g: _Graph, mean: int) -> list[Chain]:
    """A LayerNorm starts at ``mean(x)`` subtracted from ``x``; an RMSNorm at ``mean(x*x)``
    (or ``mean(x**2)``) of an ``x`` that is not itself centred."""
    x = g.nodes[mean].input[0]
    if any(g.op(c) == "Sub" and g.nodes[c].input[0] == x for c in g.children(mean)):
        return [Chain("layer_norm", (mean,))]
    square = g.parent(mean)
    if g.op(square) == "Pow" or (g.op(square) == "Mul" and len(set(g.nodes[square].input)) == 1):
        base = g.parent(square)
        centred = g.op(base) == "Sub" and g.op(g.parent(base, 1)) == "ReduceMean"
        if not centred:
            return [Chain("rms_norm", (square, mean))]
    return []


def _hard_gate_chain(g: _Graph, gate: int) -> Chain:
    """``HardSigmoid(x)`` or ``Clip(x + 3, 0, 6)`` (scaled by 1/6 after): a HardSwish when the
    gate, or its scaled value, multiplies ``x`` itself."""
    add = g.parent(gate) if g.op(gate) == "Clip" else None
    x = g.nodes[add if add is not None else gate].input[0]
    nodes = [n for n in (add, gate) if n is not None]
    frontier = [gate]
    for _ in range(2):
        following = []
        for node in frontier:
            for child in g.children(node):
                if g.op(child) == "Mul" and x in g.nodes[child].input:
                    return Chain("hardswish", (*nodes, child))
                if g.op(child) in ("Mul", "Div"):
                    following.append(child)
        frontier = following
    return Chain("hardsigmoid", tuple(nodes))


def _epilogue_chain(g: _Graph, producer: int, target: str) -> list[Chain]:
    """A matmul or conv followed by element-wise work on its output alone (activations in any
    spelling, affine constants, one residual add): all of it belongs in the epilogue."""
    head = producer
    while True:  # through views (GPT-2's Reshape -> Gemm -> Reshape linears) and transposes
        children = g.children(head)
        if len(children) != 1 or g.op(children[0]) not in _EPILOGUE_THROUGH:
            break
        head = children[0]
    views = _nodes_between(g, producer, head)
    inside = {out for out in g.nodes[head].output}
    region: list[int] = []
    residuals = 0
    frontier = list(g.children(head))
    while frontier:
        node = frontier.pop(0)
        if node in region or g.op(node) not in ELEMENTWISE:
            continue
        outside = [name for slot, name in enumerate(g.nodes[node].input)
                   if name and name not in inside and g.constant(node, slot) is None]
        if outside and not (g.op(node) == "Add" and len(outside) == 1 and residuals == 0):
            continue
        residuals += bool(outside)
        region.append(node)
        inside |= set(g.nodes[node].output)
        frontier += g.children(node)
    if not region or any(c not in region for c in g.children(head)):
        return []
    region.sort()  # ONNX graphs are topologically sorted
    return [Chain(target, (producer, *views, *region), required=tuple(region))]


def _nodes_between(g: _Graph, producer: int, head: int) -> list[int]:
    nodes = []
    while head != producer:
        nodes.append(head)
        head = g.parent(head)
    return nodes[::-1]


def measure(model: onnx.ModelProto, groups, near_misses) -> Coverage:
    """Coverage of ``model`` (the simplified graph inspect fused) by ``groups`` (api.FusedNodes,
    one per place a pattern fired), with ``near_misses`` (NearMiss, ``where`` naming a node)."""
    fusion_of: dict[int, int] = {}
    pattern_of: dict[int, int] = {}
    for number, group in enumerate(groups):
        for index in group.indices:
            pattern_of.setdefault(index, number)
            if group.variant != group.pattern:  # a fusion (a kernel of ours), not a rewrite
                fusion_of[index] = number
    compute = [i for i, node in enumerate(model.graph.node) if node.op_type not in DATA_MOVEMENT]
    targeted: dict[str, int] = {}
    fused: dict[str, int] = {}
    unfused: list[UnfusedChain] = []
    for chain in find_chains(model):
        targeted[chain.target] = targeted.get(chain.target, 0) + 1
        owners = {pattern_of.get(i) for i in chain.required}
        if None not in owners:
            fused[chain.target] = fused.get(chain.target, 0) + 1
            continue
        nodes = [model.graph.node[i] for i in chain.nodes]
        names = [node.name or f"#{i}" for node, i in zip(nodes, chain.nodes)]
        reasons = [f"{m.pattern}: {m.reason}" for m in near_misses if any(f" {n})" in m.where for n in names)]
        if not reasons:
            reasons = ["no pattern matched " + " -> ".join(node.op_type for node in nodes)
                       + (" (partly fused elsewhere)" if owners - {None} else "")]
        unfused.append(UnfusedChain(chain.target, names, [n.op_type for n in nodes], "; ".join(reasons)))
    return Coverage(len(compute), sum(1 for i in compute if i in fusion_of), targeted, fused, unfused)
