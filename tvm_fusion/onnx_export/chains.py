"""Element-wise chains after a fusion's anchor (a matmul, a conv, a merge, a softmax), read one
link at a time: a single node, or an activation the exporter decomposed into several.

Every builder walks its epilogue with ``chain_steps`` and recognizes the same activations the
same way (``classify``); what it does not place in its own epilogue goes to the ``Tail`` of a
variant that grew one (passes/absorb_elementwise_tails.py, reference_ops.apply_tail); the
prologue before a softmax is read back the same way (``score_prologue``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np
import onnx

from .graph import GraphIndex, Region, Unrepresentable, attribute

SIMPLE_ACTIVATIONS = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "LeakyRelu": "leakyrelu",
                      "HardSigmoid": "hardsigmoid", "HardSwish": "hardswish", "Clip": "clip"}
# Element-wise ONNX ops an epilogue's tail takes (reference_ops.apply_tail), by the step they become.
TAIL_BINARY = {"add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Max": "max", "Min": "min", "Pow": "pow"}
TAIL_UNARY = {"Neg": "neg", "Log": "log", "Exp": "exp", "Sqrt": "sqrt", "Abs": "abs"}
TAIL_SUFFIX = "_elementwise"  # passes/absorb_elementwise_tails.py: the variant grew a tail


@dataclasses.dataclass
class Step:
    """One link of an elementwise chain: a single node, or a decomposed activation."""

    kind: str  # "add", "activation", "batch_norm", "reshape", "dropout", or an op type
    nodes: list[onnx.NodeProto]
    output: str
    operand: str | None = None
    activation: str = ""
    params: list[float] = dataclasses.field(default_factory=list)


def chain_steps(region: Region, start: str, done: set[int]) -> tuple[list[Step], str]:
    """The chain hanging off ``start`` inside the region, one Step per link, in order, and the
    tensor it ends in (the fused op's output).

    A link grows node by node until a single tensor is left open (produced, still read inside
    the region): one node for Add or Relu, five for an erf GELU that reads x twice.
    """
    steps, current = [], start
    while True:
        pending = sorted(set(region.inside_consumers(current, done)))
        if not pending:
            return steps, current
        members: list[int] = []
        open_tensors = {current}
        for index in (i for i in region.indices if i >= pending[0] and i not in done):
            node = region.graph.nodes[index]
            if not open_tensors & set(node.input):
                continue
            members.append(index)
            done.add(index)
            open_tensors |= {o for o in node.output if o}
            open_tensors = {t for t in open_tensors if region.inside_consumers(t, done)}
            if len(open_tensors) <= 1:
                break
        if len(open_tensors) > 1:
            raise Unrepresentable(f"the chain after {start!r} branches and does not join again")
        last = region.graph.nodes[members[-1]]
        output = next(iter(open_tensors)) if open_tensors else last.output[0]
        step = classify(region, [region.graph.nodes[i] for i in members], current, output)
        if steps and completes(region.graph, steps[-1], step):
            steps[-1].nodes += step.nodes
            steps[-1].output = output
            steps[-1].kind = "activation"
        else:
            steps.append(step)
        current = output


def completes(graph: GraphIndex, previous: Step, step: Step) -> bool:
    """True for the last factor of an activation written as a separate step: the ``* 0.5`` (or
    ``/ 2``) after the rest of a GELU, the ``/ 6`` (or ``* 1/6``) after ``x * Clip(x + 3, 0, 6)``."""
    if step.operand is None:
        return False
    if previous.activation in ("gelu", "gelu_tanh") and previous.kind == "activation":
        return is_factor(graph, step, 0.5)
    return previous.kind == "unscaled_hardswish" and is_factor(graph, step, 1 / 6)


def is_factor(graph: GraphIndex, step: Step, factor: float) -> bool:
    """True for a step that multiplies by ``factor`` (or divides by its inverse), to float32 precision."""
    value = graph.scalar(step.operand) if step.operand is not None else None
    if value is None or step.kind not in ("Mul", "Div"):
        return False
    return bool(np.isclose(value if step.kind == "Mul" else 1 / value, factor, rtol=1e-6, atol=0))


def classify(region: Region, nodes: list[onnx.NodeProto], x: str, output: str) -> Step:
    graph = region.graph
    ops = sorted(n.op_type for n in nodes)
    if len(nodes) == 1:
        node = nodes[0]
        others = [name for name in node.input if name != x]
        operand = others[0] if others else None
        if node.op_type in SIMPLE_ACTIVATIONS:
            return Step("activation", nodes, output, activation=SIMPLE_ACTIVATIONS[node.op_type],
                        params=activation_params(graph, node))
        if node.op_type == "Gelu":
            approximate = attribute(node, "approximate", "none")
            return Step("activation", nodes, output, activation="gelu_tanh" if approximate == "tanh" else "gelu")
        if node.op_type == "Add" and len(node.input) == 2:
            return Step("add", nodes, output, operand=node.input[1] if node.input[0] == x else node.input[0])
        return Step(node.op_type, nodes, output, operand=operand)
    if "Erf" in ops:
        return Step("activation", nodes, output, activation="gelu")
    if "Tanh" in ops:
        return Step("activation", nodes, output, activation="gelu_tanh")
    if ops == ["Mul", "Sigmoid"]:
        return Step("activation", nodes, output, activation="silu")
    if ops == ["HardSigmoid", "Mul"] or ("Clip" in ops and "Mul" in ops):
        return hardswish_step(graph, nodes, output)
    raise Unrepresentable(f"unknown chain step {'+'.join(n.op_type for n in nodes)}")


def hardswish_step(graph: GraphIndex, nodes: list[onnx.NodeProto], output: str) -> Step:
    """``x * HardSigmoid(x)`` or ``x * Clip(x + 3, 0, 6) / 6`` (``* 1/6``, either association) as
    a hardswish; without the ``/ 6`` (written after the Mul) an ``unscaled_hardswish`` step that
    ``completes`` joins with it. Declines other constants, which are not a hardswish."""
    hard_sigmoid = next((n for n in nodes if n.op_type == "HardSigmoid"), None)
    if hard_sigmoid is not None:
        if not np.allclose(activation_params(graph, hard_sigmoid), [1 / 6, 0.5], rtol=1e-6, atol=0):
            raise Unrepresentable("x * HardSigmoid(x) with other than alpha 1/6, beta 0.5")
        return Step("activation", nodes, output, activation="hardswish")
    clip = next(n for n in nodes if n.op_type == "Clip")
    constants = [graph.scalar(i) for n in nodes if n.op_type in ("Add", "Mul", "Div") for i in n.input]
    steps = [Step(n.op_type, [n], n.output[0], operand=i) for n in nodes if n.op_type in ("Mul", "Div")
             for i in n.input if graph.scalar(i) is not None]
    if activation_params(graph, clip) != [0.0, 6.0] or 3.0 not in constants:
        raise Unrepresentable("x * Clip(x + a, b, c) with other than a = 3, b = 0, c = 6")
    if any(is_factor(graph, step, 1 / 6) for step in steps):
        return Step("activation", nodes, output, activation="hardswish")
    return Step("unscaled_hardswish", nodes, output, activation="hardswish")


def activation_params(graph: GraphIndex, node: onnx.NodeProto) -> list[float]:
    if node.op_type == "Clip":
        if len(node.input) == 1 and node.attribute:  # opset < 11: bounds are attributes
            return [attribute(node, "min", -np.inf), attribute(node, "max", np.inf)]
        bounds = [graph.scalar(name) if name else None for name in [*node.input[1:3], "", ""][:2]]
        if any(name and bound is None for name, bound in zip(node.input[1:3], bounds)):
            raise Unrepresentable(f"Clip {node.name!r} has bounds computed at run time")
        return [-np.inf if bounds[0] is None else bounds[0], np.inf if bounds[1] is None else bounds[1]]
    if node.op_type == "LeakyRelu":
        return [attribute(node, "alpha", 0.01)]
    if node.op_type == "HardSigmoid":
        return [attribute(node, "alpha", 0.2), attribute(node, "beta", 0.5)]
    return []


def variant_parts(variant: str) -> set[str]:
    return set(variant.split(".", 1)[-1].split("_"))


def activation_attributes(step: Step, prefix: str = "activation") -> dict:
    return {prefix: step.activation, **({f"{prefix}_params": step.params} if step.params else {})}


class Tail:
    """The element-wise steps after an epilogue, in a variant that grew a tail
    (passes/absorb_elementwise_tails.py): the fused op's ``tail`` and ``tail_params`` attributes
    and the operands it reads after its other inputs (reference_ops.apply_tail)."""

    def __init__(self, region: Region, variant: str, what: str):
        self.region, self.what = region, what
        self.allowed = variant.endswith(TAIL_SUFFIX)
        self.steps: list[str] = []
        self.params: list[float] = []
        self.operands: list[str] = []

    def before(self, steps: Iterable[Step]) -> Iterator[Step]:
        """The steps before the tail begins, for the epilogue to place (or ``take`` into the
        tail). Once one went to the tail, every later one goes too: the steps' order is the
        computation's."""
        for step in steps:
            if self.steps:
                self.take(step)
            else:
                yield step

    def take(self, step: Step) -> None:
        if not self.allowed:
            raise Unrepresentable(f"{step.kind} after the {self.what}'s epilogue")
        if step.kind == "activation":
            self.steps.append(step.activation)
            self.params += step.params
            return
        if step.kind in TAIL_UNARY:
            self.steps.append(TAIL_UNARY[step.kind])
            return
        name, node = TAIL_BINARY.get(step.kind), step.nodes[0]
        if name is None or len(node.input) != 2 or step.operand is None or self.region.producer(step.operand):
            raise Unrepresentable(f"{step.kind} in the element-wise tail after the {self.what}")
        reversed_operands = node.input[0] == step.operand and name in ("sub", "div", "pow")
        self.steps.append("r" + name if reversed_operands else name)
        self.operands.append(step.operand)

    def attributes(self) -> dict:
        return {"tail": self.steps, "tail_params": self.params or None} if self.steps else {}


def is_residual(graph: GraphIndex, step: Step) -> bool:
    """An add of a tensor of the result's shape (a constant scalar added is a tail step)."""
    return step.kind == "add" and graph.shape(step.operand) == graph.shape(step.output)


def check_all_used(region: Region, done: set[int]) -> None:
    left = [region.graph.nodes[i] for i in region.indices if i not in done]
    if left:
        raise Unrepresentable("nodes outside the recognized chain: "
                              + ", ".join(n.op_type for n in left))


def score_prologue(region: Region, logits: str, what: str) -> tuple[str, str, str, dict, list[onnx.NodeProto]]:
    """Back from the softmax's input over the additive mask, the causal Where and the scale (a
    Mul or Div by a constant): (scores, causal condition, mask, attributes, the nodes passed)."""
    graph = region.graph
    causal, mask, attrs, passed = "", "", {}, []
    while (node := region.producer(logits)) is not None and node.op_type in ("Add", "Where", "Div", "Mul"):
        passed.append(node)
        if node.op_type == "Add":
            first_outside = region.producer(node.input[0]) is None
            chain = node.input[1] if first_outside and region.producer(node.input[1]) is not None else node.input[0]
            mask, logits = (node.input[1] if chain == node.input[0] else node.input[0]), chain
        elif node.op_type == "Where":
            attrs["causal_fill"] = graph.scalar(node.input[2])
            if attrs["causal_fill"] is None:
                raise Unrepresentable("the causal fill value is not a constant scalar")
            causal, logits = node.input[0], node.input[1]
        else:
            factor = graph.scalar(node.input[1])
            if factor is None:
                raise Unrepresentable(f"the {what} scale is not a constant scalar")
            attrs["scale"], logits = (1 / factor if node.op_type == "Div" else factor), node.input[0]
    return logits, causal, mask, attrs, passed
