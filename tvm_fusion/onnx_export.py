"""The fused graph as ONNX (``tvm-fusion inspect --onnx``): one ``tvm_fusion``-domain node per fusion.

Built from the shape-simplified ONNX graph and the ONNX nodes each fusion absorbed
(``api.FusedNodes``), not from Relax: every parameter of a fused node (activation, epsilon,
scale, conv attributes) is read from the absorbed nodes themselves, their op types and
constant inputs. Fused nodes take the original tensors as inputs and outputs (scalar
constants become attributes), so the file lines up with the model it came from, Netron draws
it, and ``onnx_ops`` runs it under ``onnx.reference``.

Rewrites that no fusion absorbed become custom ops too (``Activation``, ``LayerNorm``,
``RMSNorm``) rather than standard ``Gelu`` (opset 20) or ``LayerNormalization`` (opset 17):
those would need the model's default opset raised, which changes other ops' signatures
(Split, Squeeze, ReduceMean). A rewrite of a single node (ONNX Clip, inference Dropout) keeps
that node: it is one op already. Whatever cannot be represented (an intermediate a fused op
cannot output is read elsewhere, an unknown step) keeps its original nodes, with the reason.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from .errors import VerificationError
from .files import write_file
from .onnx_ops import DOMAIN, RESIZE_ATTRIBUTES, evaluator
from .verify import OutputComparison, compare_outputs, format_comparisons, reference_outputs

SIMPLE_ACTIVATIONS = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "LeakyRelu": "leakyrelu",
                      "HardSigmoid": "hardsigmoid", "HardSwish": "hardswish", "Clip": "clip"}
# Element-wise ONNX ops an epilogue's tail takes (onnx_ops.apply_tail), by the step they become.
TAIL_BINARY = {"add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Max": "max", "Min": "min"}
TAIL_SUFFIX = "_elementwise"  # passes/absorb_elementwise_tails.py: the variant grew a tail
# Rewrites whose result is an activation, and the activation they produce.
ACTIVATION_REWRITES = {"gelu_erf": "gelu", "gelu_tanh": "gelu_tanh", "silu": "silu",
                       "hardswish": "hardswish", "hardsigmoid": "hardsigmoid", "clip": "clip"}


class Unrepresentable(Exception):
    """This fusion's nodes cannot become one fused node; the message says why."""


@dataclasses.dataclass
class KeptInstance:
    variant: str
    nodes: list[str]
    reason: str


@dataclasses.dataclass
class FusedOnnx:
    model: onnx.ModelProto
    fused: dict[str, int]  # fused op type -> nodes written
    kept: list[KeptInstance]


class GraphIndex:
    """Producers, consumers, constants and shapes of the simplified graph.

    Shapes and constants come from one run of the graph under onnx.reference on ``inputs``:
    onnxslim leaves some shape arithmetic unfolded (GPT-2's later layers compute the score
    scale from a shape), and ONNX shape inference loses the shapes after it.
    """

    def __init__(self, model: onnx.ModelProto, inputs: dict[str, np.ndarray]):
        self.model = model
        self.nodes = list(model.graph.node)
        self.producer = {out: i for i, node in enumerate(self.nodes) for out in node.output if out}
        with np.errstate(over="ignore", invalid="ignore"):  # masks of -3.4e38 overflow to -inf, as in ORT
            values = ReferenceEvaluator(model).run(None, inputs, intermediate=True)
        self.values = {name: np.asarray(value) for name, value in values.items()
                       if name and isinstance(value, np.ndarray | np.generic)}
        self.shapes = {name: value.shape for name, value in self.values.items()}
        initializers = {t.name for t in model.graph.initializer}
        constant = set(initializers)
        self.folded: set[int] = set()  # nodes computing constants: their outputs become initializers
        for index, node in enumerate(self.nodes):
            if node.op_type in ("Constant", "Shape", "Size") or (  # shapes are bound: Shape is constant
                    node.input and all(not i or i in constant for i in node.input)
                    and not node.op_type.startswith("Random") and node.op_type != "Dropout"):
                constant.update(o for o in node.output if o in self.values)
                self.folded.add(index)
        self.constants = {name: self.values[name] for name in constant if name in self.values}
        self.folded_tensors = constant - initializers
        self.graph_outputs = {o.name for o in model.graph.output}
        self.live = self._live_indices()
        self.consumers: dict[str, list[int]] = collections.defaultdict(list)
        for i in sorted(self.live):
            for name in self.nodes[i].input:
                self.consumers[name].append(i)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    def _live_indices(self) -> set[int]:
        """The nodes the graph outputs depend on, constant ones folded. onnxslim leaves some
        shape arithmetic and dead ends (GPT-2's key transposes read only by a Shape); TVM folds
        and drops them, so do we: a fused node need not output what only they read."""
        needed = set(self.graph_outputs)
        live = set()
        for index in reversed(range(len(self.nodes))):
            node = self.nodes[index]
            if index not in self.folded and needed & set(node.output):
                live.add(index)
                needed.update(node.input)
        return live

    def value_info(self, name: str) -> onnx.ValueInfoProto | None:
        value = self.values.get(name)
        if value is None or value.dtype == object:
            return None
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)

    def scalar(self, name: str) -> float | None:
        value = self.constants.get(name)
        return float(value.reshape(())) if value is not None and value.size == 1 else None

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise Unrepresentable(f"tensor {name!r} has no static shape")
        return self.shapes[name]


class Region:
    """The ONNX nodes one fusion absorbed, and which of the tensors they produce are read outside it."""

    def __init__(self, graph: GraphIndex, indices: Sequence[int]):
        self.graph = graph
        self.indices = sorted(indices)
        self.members = set(indices)
        self.nodes = [graph.nodes[i] for i in self.indices]
        self.outputs = [out for node in self.nodes for out in node.output if out and (
            out in graph.graph_outputs or any(c not in self.members for c in graph.consumers[out]))]

    def producer(self, name: str, op_type: str | None = None) -> onnx.NodeProto | None:
        """The node inside the region that produces ``name`` (of ``op_type``, if given)."""
        index = self.graph.producer.get(name)
        if index not in self.members:
            return None
        node = self.graph.nodes[index]
        return node if op_type is None or node.op_type == op_type else None

    def only(self, *op_types: str) -> onnx.NodeProto:
        found = [n for n in self.nodes if n.op_type in op_types]
        if len(found) != 1:
            raise Unrepresentable(f"expected one {'/'.join(op_types)} node, found {len(found)}")
        return found[0]

    def inside_consumers(self, name: str, done: set[int]) -> list[int]:
        return [i for i in self.graph.consumers[name] if i in self.members and i not in done]


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


def attribute(node: onnx.NodeProto, name: str, default=None):
    for attr in node.attribute:
        if attr.name == name:
            value = helper.get_attribute_value(attr)
            return value.decode() if isinstance(value, bytes) else value
    return default


def node_attributes(node: onnx.NodeProto) -> dict:
    return {attr.name: attribute(node, attr.name) for attr in node.attribute}


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


def fused_node(op_type: str, inputs: list[str], outputs: list[str], **attributes) -> onnx.NodeProto:
    """A ``tvm_fusion`` node; None attributes left out, trailing absent inputs dropped."""
    while inputs and not inputs[-1]:
        inputs = inputs[:-1]
    return helper.make_node(op_type, inputs, outputs, domain=DOMAIN,
                            **{k: v for k, v in attributes.items() if v is not None})


class Tail:
    """The element-wise steps after an epilogue, in a variant that grew a tail
    (passes/absorb_elementwise_tails.py): the fused op's ``tail`` and ``tail_params`` attributes
    and the operands it reads after its other inputs (onnx_ops.apply_tail)."""

    def __init__(self, region: Region, variant: str, what: str):
        self.region, self.what = region, what
        self.allowed = variant.endswith(TAIL_SUFFIX)
        self.steps: list[str] = []
        self.params: list[float] = []
        self.operands: list[str] = []

    def take(self, step: Step) -> None:
        if not self.allowed:
            raise Unrepresentable(f"{step.kind} after the {self.what}'s epilogue")
        if step.kind == "activation":
            self.steps.append(step.activation)
            self.params += step.params
            return
        if step.kind == "Neg":
            self.steps.append("neg")
            return
        name, node = TAIL_BINARY.get(step.kind), step.nodes[0]
        if name is None or len(node.input) != 2 or step.operand is None or self.region.producer(step.operand):
            raise Unrepresentable(f"{step.kind} in the element-wise tail after the {self.what}")
        reversed_operands = node.input[0] == step.operand and name in ("sub", "div")
        self.steps.append("r" + name if reversed_operands else name)
        self.operands.append(step.operand)

    def attributes(self) -> dict:
        return {"tail": self.steps, "tail_params": self.params or None} if self.steps else {}


def is_residual(graph: GraphIndex, step: Step) -> bool:
    """An add of a tensor of the result's shape (a constant scalar added is a tail step)."""
    return step.kind == "add" and graph.shape(step.operand) == graph.shape(step.output)


# builders: one per pattern -------------------------------------------------------------------

def build_gemm(region: Region, variant: str) -> list[onnx.NodeProto]:
    """MatMul/Gemm [+ Reshape of a flattened linear] + bias + activation + residual [+ Dropout]."""
    graph = region.graph
    matmul = region.only("MatMul", "Gemm")
    done = {graph.producer[matmul.output[0]]}
    a, b = matmul.input[0], matmul.input[1]
    flatten = region.producer(a, "Reshape")
    if flatten is not None:
        a = flatten.input[0]
        done.add(graph.producer[flatten.output[0]])
    if attribute(matmul, "transA", 0):
        raise Unrepresentable("Gemm with transA")
    attrs = {"trans_b": attribute(matmul, "transB", 0), "alpha": attribute(matmul, "alpha", 1.0),
             "beta": attribute(matmul, "beta", 1.0)}
    bias = matmul.input[2] if len(matmul.input) > 2 and matmul.input[2] else ""
    residual, act, dropout = "", None, None
    output_shape = graph.shape(matmul.output[0])
    stage = 0  # 0 matmul, 1 bias, 2 activation, 3 residual, 4 dropout
    tail = Tail(region, variant, "matmul")
    steps, end = chain_steps(region, matmul.output[0], done)
    for step in steps:
        if tail.steps:  # once in the tail, the rest is too: the steps' order is the computation's
            tail.take(step)
        elif step.kind == "Reshape" and stage == 0:
            output_shape = graph.shape(step.output)
        elif step.kind == "add" and stage == 0 and not bias and "bias" in variant_parts(variant):
            bias, stage = step.operand, 1
        elif step.kind == "activation" and stage < 2:
            act, stage = step, 2
        elif is_residual(graph, step) and stage < 3:
            residual, stage = step.operand, 3
        elif step.kind == "Dropout" and stage < 4:
            dropout, stage = step.nodes[0], 4
        else:
            tail.take(step)
    check_all_used(region, done)
    attrs.update(activation_attributes(act) if act else {})
    attrs.update(output_shape=list(output_shape), has_bias=int(bool(bias)))
    if dropout is not None:
        return [fused_node("GemmDropout", [a, b, bias], [o for o in dropout.output if o],
                           ratio=dropout_ratio(graph, dropout), seed=dropout_seed(graph, dropout), **attrs)]
    return [fused_node("GemmEpilogue", [a, b, bias, residual, *tail.operands], [end],
                       has_residual=int(bool(residual)), **attrs, **tail.attributes())]


def dropout_ratio(graph: GraphIndex, node: onnx.NodeProto) -> float:
    ratio = graph.scalar(node.input[1]) if len(node.input) > 1 and node.input[1] else 0.5
    if ratio is None:
        raise Unrepresentable("the dropout ratio is computed at run time")
    return ratio


def dropout_seed(graph: GraphIndex, node: onnx.NodeProto) -> int:
    """The Dropout's seed; unseeded ones are numbered in graph order, as the frontend numbers them."""
    seed = attribute(node, "seed")
    if seed is not None:
        return int(seed)
    unseeded = [n for n in graph.nodes if n.op_type == "Dropout" and attribute(n, "seed") is None]
    return unseeded.index(node)


def check_all_used(region: Region, done: set[int]) -> None:
    left = [region.graph.nodes[i] for i in region.indices if i not in done]
    if left:
        raise Unrepresentable("nodes outside the recognized chain: "
                              + ", ".join(n.op_type for n in left))


def build_conv(region: Region, variant: str) -> list[onnx.NodeProto]:
    """[Mul by an SE gate] + Conv/ConvTranspose + bias + BatchNorm + activation + residual (a
    tensor, or a Resize of a small map) + activation."""
    graph = region.graph
    conv = region.only("Conv", "ConvTranspose")
    done = {graph.producer[conv.output[0]]}
    x, gate = conv.input[0], ""
    scale = region.producer(x, "Mul")
    if scale is not None:
        done.add(graph.producer[x])
        first, second = scale.input
        x, gate = (first, second) if graph.shape(second)[2:] == (1, 1) else (second, first)
    bias = conv.input[2] if len(conv.input) > 2 else ""
    attrs = node_attributes(conv)
    bn, residual, stage = ["", "", "", ""], "", 0  # 0 conv, 1 bn, 2 bias add, 3 act, 4 residual, 5 post
    tail = Tail(region, variant, "conv")
    steps, end = chain_steps(region, conv.output[0], done)
    for step in steps:
        if tail.steps:  # once in the tail, the rest is too: the steps' order is the computation's
            tail.take(step)
        elif step.kind == "BatchNormalization" and stage == 0:
            if attribute(step.nodes[0], "training_mode", 0):
                raise Unrepresentable("BatchNormalization in training mode")
            bn, stage = list(step.nodes[0].input[1:5]), 1
            attrs["epsilon"] = attribute(step.nodes[0], "epsilon", 1e-5)
        elif (step.kind == "add" and stage < 2 and not bias and not bn[0] and step.operand in graph.constants
              and "bias" in variant_parts(variant)):
            bias, stage = step.operand, 2
        elif step.kind == "activation" and stage < 3:
            attrs.update(activation_attributes(step))
            stage = 3
        elif is_residual(graph, step) and stage < 4:
            residual, stage = step.operand, 4
            resize = region.producer(residual, "Resize")
            attrs["residual"] = "tensor"
            if resize is not None:
                done.add(graph.producer[residual])
                residual = resize.input[0]
                attrs.update(residual="upsampled", **resize_attributes(graph, [resize]),
                             resize_scales=resize_scales(graph, resize))
        elif step.kind == "activation" and stage == 4:
            attrs.update(activation_attributes(step, "post_activation"))
            stage = 5
        else:
            tail.take(step)
    check_all_used(region, done)
    attrs.update(has_bias=int(bool(bias or bn[0])), batch_norm=int(bool(bn[0])), **tail.attributes())
    if conv.op_type == "Conv":
        return [fused_node("ConvEpilogue", [x, conv.input[1], bias, gate, *bn, residual, *tail.operands], [end],
                           scaled=int(bool(gate)), **attrs)]
    return [fused_node("ConvTransposeEpilogue", [x, conv.input[1], bias, *bn, residual, *tail.operands], [end],
                       **attrs)]


def resize_attributes(graph: GraphIndex, resizes: list[onnx.NodeProto]) -> dict:
    """The Resize attributes, prefixed ``resize_``, shared by every Resize in the fusion."""
    found = {tuple(sorted((k, str(v)) for k, v in node_attributes(node).items())) for node in resizes}
    if len(found) > 1:
        raise Unrepresentable("the fused Resizes differ in their attributes")
    attrs = node_attributes(resizes[0])
    if attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        raise Unrepresentable("Resize with tf_crop_and_resize reads a region of interest")
    return {f"resize_{k}": v for k, v in attrs.items() if k in RESIZE_ATTRIBUTES}


def resize_scales(graph: GraphIndex, resize: onnx.NodeProto) -> list[float]:
    """The Resize's scales input, or output / input size when it was given sizes."""
    scales = graph.constants.get(resize.input[2]) if len(resize.input) > 2 and resize.input[2] else None
    if scales is not None and scales.size:
        return [float(s) for s in scales]
    source, target = graph.shape(resize.input[0]), graph.shape(resize.output[0])
    return [t / s for s, t in zip(source, target)]


def build_squeeze_excitation(region: Region, variant: str) -> list[onnx.NodeProto]:
    """GlobalAveragePool -> Conv + bias -> activation -> Conv + bias -> gate."""
    graph = region.graph
    pool = region.only("GlobalAveragePool", "ReduceMean")
    done = {graph.producer[pool.output[0]]}
    weights, acts, pending_conv = [], [], None
    steps, end = chain_steps(region, pool.output[0], done)
    for step in steps:
        if step.kind == "Conv" and pending_conv is None and len(weights) < 2:
            node = step.nodes[0]
            pending_conv = node
            weights.append([node.input[1], node.input[2] if len(node.input) > 2 else ""])
        elif step.kind == "add" and pending_conv is not None and not weights[-1][1]:
            weights[-1][1] = step.operand
        elif step.kind == "activation" and pending_conv is not None:
            acts.append(step)
            pending_conv = None
        else:
            raise Unrepresentable(f"{step.kind} in the squeeze-excitation block")
    check_all_used(region, done)
    if len(weights) != 2 or len(acts) != 2 or not all(b for _, b in weights):
        raise Unrepresentable("not two 1x1 convs with biases, each followed by an activation")
    return [fused_node("SqueezeExcitation", [pool.input[0], *weights[0], *weights[1]], [end],
                       **activation_attributes(acts[0]), **activation_attributes(acts[1], "gate"))]


def build_resize_merge(region: Region, variant: str) -> list[onnx.NodeProto]:
    """Resizes + Add (+ activation) of a lateral map, or Resizes + Concat."""
    graph = region.graph
    merge = region.only("Add", "Concat")
    done = {graph.producer[merge.output[0]]}
    inputs, resized, scales, resizes = [], [], [], []
    for name in merge.input:
        resize = region.producer(name, "Resize")
        if resize is not None:
            done.add(graph.producer[name])
            resizes.append(resize)
            scales += resize_scales(graph, resize)
            name = resize.input[0]
        inputs.append(name)
        resized.append(int(resize is not None))
    attrs = {"merge": "add" if merge.op_type == "Add" else "concat", "resized": resized, "scales": scales}
    if merge.op_type == "Concat":
        attrs["axis"] = attribute(merge, "axis")
    steps, end = chain_steps(region, merge.output[0], done)
    for step in steps:
        if step.kind != "activation" or "activation" in attrs:
            raise Unrepresentable(f"{step.kind} after the merge")
        attrs.update(activation_attributes(step))
    check_all_used(region, done)
    return [fused_node("ResizeMerge", inputs, [end], **attrs, **resize_attributes(graph, resizes))]


def build_attention(region: Region, variant: str) -> list[onnx.NodeProto]:
    """Head split + Q·Kᵀ + scale + causal Where + mask + Softmax + ·V + head merge."""
    graph = region.graph
    probs = region.only("Softmax")
    attrs: dict = {}
    causal, mask = "", ""
    logits = probs.input[0]
    while (node := region.producer(logits)) is not None and node.op_type != "MatMul":
        if node.op_type == "Add":
            chain = node.input[0] if region.producer(node.input[0]) is not None else node.input[1]
            mask, logits = (node.input[1] if chain == node.input[0] else node.input[0]), chain
        elif node.op_type == "Where":
            fill = graph.scalar(node.input[2])
            if fill is None:
                raise Unrepresentable("the causal fill value is not a constant scalar")
            causal, attrs["causal_fill"], logits = node.input[0], fill, node.input[1]
        elif node.op_type in ("Div", "Mul"):
            factor = graph.scalar(node.input[1])
            if factor is None:
                raise Unrepresentable("the score scale is not a constant scalar")
            attrs["scale"] = 1 / factor if node.op_type == "Div" else factor
            logits = node.input[0]
        else:
            raise Unrepresentable(f"{node.op_type} between the scores and the softmax")
    scores = region.producer(logits, "MatMul")
    if scores is None:
        raise Unrepresentable("no Q·Kᵀ MatMul before the softmax")
    context = _single_consumer(region, probs.output[0], "MatMul")
    query, q_heads = split_heads(region, scores.input[0], (0, 2, 1, 3))
    key, k_heads = split_heads(region, scores.input[1], (0, 2, 3, 1))
    value, v_heads = split_heads(region, context.input[1], (0, 2, 1, 3))
    if not q_heads:
        transposed = region.producer(scores.input[1], "Transpose")
        if transposed is None or tuple(attribute(transposed, "perm")) != (0, 1, 3, 2):
            raise Unrepresentable("K is not transposed as [batch, heads, dim, seq]")
        query, key, attrs["qk_form"] = scores.input[0], transposed.input[0], "heads"
    merged = _single_consumer(region, context.output[0], "Transpose")
    if tuple(attribute(merged, "perm")) != (0, 2, 1, 3):
        raise Unrepresentable("the head merge is not a (0, 2, 1, 3) transpose")
    output = merged.output[0]
    reshape = [graph.nodes[i] for i in region.inside_consumers(output, set())]
    if reshape:
        if len(reshape) != 1 or reshape[0].op_type != "Reshape":
            raise Unrepresentable("the merged heads go on to more than a Reshape")
        output = reshape[0].output[0]
    inputs = [query, key, value]
    split = region.producer(query, "Split")
    if split is not None:
        if list(split.output) != [query, key, value] or attribute(split, "axis") not in (-1, 2):
            raise Unrepresentable("the packed QKV split is not Q, K, V along the last axis")
        inputs = [split.input[0], "", ""]
        attrs.update(qk_form="packed", qkv_split=[graph.shape(name)[-1] for name in split.output])
    num_heads = graph.shape(scores.output[0])[1]
    return [fused_node("Attention", [*inputs, causal, mask], [output], num_heads=num_heads,
                       output_shape=list(graph.shape(output)), **attrs)]


def _single_consumer(region: Region, name: str, op_type: str) -> onnx.NodeProto:
    consumers = region.inside_consumers(name, set())
    if len(consumers) != 1 or region.graph.nodes[consumers[0]].op_type != op_type:
        raise Unrepresentable(f"{name!r} is not read by exactly one {op_type} inside the fusion")
    return region.graph.nodes[consumers[0]]


def split_heads(region: Region, name: str, perm: tuple[int, ...]) -> tuple[str, bool]:
    """(projection, True) for ``Transpose(perm)(Reshape(projection))``; (name, False) otherwise."""
    transpose = region.producer(name, "Transpose")
    reshape = transpose is not None and region.producer(transpose.input[0], "Reshape")
    if not reshape or tuple(attribute(transpose, "perm")) != perm:
        return name, False
    return reshape.input[0], True


def build_softmax(region: Region, variant: str) -> list[onnx.NodeProto]:
    """Scale + causal Where + mask + Softmax + multiply/cast epilogue."""
    graph = region.graph
    probs = region.only("Softmax")
    axis = attribute(probs, "axis", -1 if graph.opset >= 13 else 1)
    rank = len(graph.shape(probs.input[0]))
    if axis % rank != rank - 1:
        raise Unrepresentable(f"softmax over axis {axis}, not the last")
    attrs: dict = {"axis": -1}
    causal, mask, logits = "", "", probs.input[0]
    done = {graph.producer[probs.output[0]]}
    while (node := region.producer(logits)) is not None:
        done.add(graph.producer[logits])
        if node.op_type == "Add":
            chain = node.input[1] if region.producer(node.input[1]) is not None else node.input[0]
            mask, logits = (node.input[0] if chain == node.input[1] else node.input[1]), chain
        elif node.op_type == "Where":
            attrs["causal_fill"] = graph.scalar(node.input[2])
            if attrs["causal_fill"] is None:
                raise Unrepresentable("the causal fill value is not a constant scalar")
            causal, logits = node.input[0], node.input[1]
        elif node.op_type in ("Div", "Mul"):
            factor = graph.scalar(node.input[1])
            if factor is None:
                raise Unrepresentable("the softmax scale is not a constant scalar")
            attrs["scale"], logits = (1 / factor if node.op_type == "Div" else factor), node.input[0]
        else:
            raise Unrepresentable(f"{node.op_type} before the softmax")
    operand = ""
    steps, end = chain_steps(region, probs.output[0], done)
    for step in steps:
        if step.kind == "Mul" and "epilogue" not in attrs:
            attrs["epilogue"], operand = "multiply", step.operand
        elif step.kind == "Cast" and "epilogue" not in attrs:
            attrs.update(epilogue="cast", to=attribute(step.nodes[0], "to"))
        else:
            raise Unrepresentable(f"{step.kind} after the softmax")
    check_all_used(region, done)
    return [fused_node("FusedSoftmax", [logits, causal, mask, operand], [end], **attrs)]


def build_skip_norm(region: Region, variant: str) -> list[onnx.NodeProto]:
    """(input + bias) + skip, normalized; the sum as a second output when it is read elsewhere.

    Where the bias is a Gemm's (a flattened linear), the matmul is not part of the fusion: it
    is written back as the original Reshape -> Gemm -> Reshape without the bias.
    """
    graph = region.graph
    norm_nodes, summed = norm_region(region)
    outer = region.producer(summed, "Add")
    if outer is None:
        raise Unrepresentable("the normalized tensor is not a sum")
    inner = next((n for n in map(region.producer, outer.input) if n is not None and n.op_type == "Add"), None)
    x, skip = outer.input
    bias, extra = "", []
    if inner is not None:
        skip = outer.input[1] if inner.output[0] == outer.input[0] else outer.input[0]
        x, bias = inner.input
        if bias not in graph.constants or (x in graph.constants and bias not in graph.constants):
            x, bias = bias, x
    else:
        linear = next((n for n in map(region.producer, outer.input) if n is not None), None)
        if linear is not None:
            extra, x, bias = without_bias(region, linear)
            skip = outer.input[1] if linear.output[0] == outer.input[0] else outer.input[0]
    kind, gamma, beta, epsilon, axis, output = norm_nodes
    outputs = [output] + ([summed] if summed in region.outputs else [])
    if set(region.outputs) - set(outputs):
        raise Unrepresentable("an intermediate sum is also read outside the fusion")
    if kind == "layer":
        node = fused_node("SkipLayerNorm", [x, skip, gamma, beta, bias], outputs, epsilon=epsilon, axis=axis)
    else:
        node = fused_node("SkipRMSNorm", [x, skip, gamma, bias], outputs, epsilon=epsilon, axis=axis)
    return [*extra, node]


def without_bias(region: Region, reshape: onnx.NodeProto) -> tuple[list[onnx.NodeProto], str, str]:
    """Reshape -> Gemm(C) -> Reshape rewritten without C: (nodes, their output, C)."""
    gemm = region.producer(reshape.input[0], "Gemm") if reshape.op_type == "Reshape" else None
    if gemm is None or len(gemm.input) < 3 or attribute(gemm, "beta", 1.0) != 1.0:
        raise Unrepresentable(f"{reshape.op_type} feeding the skip sum is not a flattened linear's bias")
    plain_gemm = onnx.NodeProto()
    plain_gemm.CopyFrom(gemm)
    del plain_gemm.input[2:]
    plain_gemm.output[0] = gemm.output[0] + "/without_bias"
    plain_reshape = onnx.NodeProto()
    plain_reshape.CopyFrom(reshape)
    plain_reshape.input[0] = plain_gemm.output[0]
    plain_reshape.output[0] = reshape.output[0] + "/without_bias"
    flatten = region.producer(gemm.input[0])
    nodes = ([flatten] if flatten is not None else []) + [plain_gemm, plain_reshape]
    return nodes, plain_reshape.output[0], gemm.input[2]


def norm_region(region: Region) -> tuple[tuple, str]:
    """((kind, gamma, beta, epsilon, axis, output), normalized input) of the normalization.

    A LayerNormalization / RMSNormalization node, or the decomposed forms exporters write below
    opset 17 / 23 (ReduceMean, Sub, Pow, Add eps, Sqrt, Div, Mul gamma [, Add beta], casts).
    """
    graph = region.graph
    for node in region.nodes:
        if node.op_type in ("LayerNormalization", "RMSNormalization"):
            inputs = [*node.input, "", ""]
            kind = "layer" if node.op_type == "LayerNormalization" else "rms"
            return ((kind, inputs[1], inputs[2] if kind == "layer" else "",
                     attribute(node, "epsilon", 1e-5), attribute(node, "axis", -1), node.output[0]),
                    node.input[0])
    means = [n for n in region.nodes if n.op_type == "ReduceMean"]
    if not means:
        raise Unrepresentable("no normalization among the fused nodes")
    first_mean = means[0]
    source = first_mean.input[0]
    centered = [n for n in region.nodes if n.op_type == "Sub" and source in n.input]
    if not centered:  # RMS: the first mean is over a square of the input
        square = region.producer(source)
        source = square.input[0] if square is not None else source
        while (cast := region.producer(source, "Cast")) is not None:
            source = cast.input[0]
    eps_add = next((n for n in region.nodes if n.op_type == "Add" and any(
        region.producer(i, "ReduceMean") is not None for i in n.input)), None)
    epsilon = next((graph.scalar(i) for i in (eps_add.input if eps_add else []) if graph.scalar(i) is not None),
                   None)
    if epsilon is None:
        raise Unrepresentable("no constant epsilon in the decomposed normalization")
    axes = attribute(first_mean, "axes")
    if axes is None and len(first_mean.input) > 1:
        axes = [int(a) for a in graph.constants[first_mean.input[1]].ravel()]
    rank = len(graph.shape(source))
    axes = sorted(a % rank for a in axes or [])
    if axes != list(range(rank - len(axes), rank)) or not axes:
        raise Unrepresentable(f"normalizes over axes {axes}, not trailing ones")
    affine = {op: "" for op in ("Mul", "Add")}
    for node in region.nodes:
        if node.op_type in affine and node is not eps_add:
            external = [i for i in node.input if region.producer(i) is None and graph.scalar(i) is None
                        and i != source]
            if external:
                affine[node.op_type] = external[0]
    output = region.nodes[-1].output[0]
    return (("layer" if centered else "rms", affine["Mul"], affine["Add"], epsilon, axes[0] - rank, output),
            source)


def build_norm_rewrite(region: Region, variant: str) -> list[onnx.NodeProto]:
    (kind, gamma, beta, epsilon, axis, output), source = norm_region(region)
    if kind == "layer":
        return [fused_node("LayerNorm", [source, gamma, beta], [output], epsilon=epsilon, axis=axis)]
    return [fused_node("RMSNorm", [source, gamma], [output], epsilon=epsilon, axis=axis)]


def build_activation_rewrite(region: Region, variant: str) -> list[onnx.NodeProto]:
    graph = region.graph
    sources = {i for node in region.nodes for i in node.input
               if i and region.producer(i) is None and i not in graph.constants}
    if len(sources) != 1 or len(region.outputs) != 1:
        raise Unrepresentable("the activation does not have one input and one output")
    params = []
    if variant == "hardsigmoid":
        params = [1 / 6, 0.5]
    elif variant == "clip":
        params = activation_params(graph, region.only("Clip"))
    return [fused_node("Activation", [sources.pop()], [region.nodes[-1].output[0]],
                       activation=ACTIVATION_REWRITES[variant], **({"activation_params": params} if params else {}))]


def build_add_eye_like(region: Region, variant: str) -> list[onnx.NodeProto]:
    eye = region.only("EyeLike")
    add = region.only("Add")
    other = add.input[1] if add.input[0] == eye.output[0] else add.input[0]
    return [fused_node("AddEyeLike", [eye.input[0], other], [add.output[0]], k=attribute(eye, "k", 0),
                       dtype=attribute(eye, "dtype"))]


BUILDERS: dict[str, Callable[[Region, str], list[onnx.NodeProto]]] = {
    "gemm_epilogue": build_gemm, "dropout_training": build_gemm, "flattened_linear": build_gemm,
    "conv_epilogue": build_conv, "conv_transpose_epilogue": build_conv, "conv_bn_fold": build_conv,
    "squeeze_excitation": build_squeeze_excitation, "resize_merge": build_resize_merge,
    "attention": build_attention, "softmax": build_softmax,
    "skip_layernorm": build_skip_norm, "skip_rms_norm": build_skip_norm,
    "layernorm_decomposed": build_norm_rewrite, "rmsnorm_decomposed": build_norm_rewrite,
    "eye_like_add": build_add_eye_like,
    **{name: build_activation_rewrite for name in ACTIVATION_REWRITES},
}


# the whole graph -----------------------------------------------------------------------------

def fused_onnx(model: onnx.ModelProto, instances: Sequence, inputs: dict[str, np.ndarray]) -> FusedOnnx:
    """The simplified ``model`` with each of ``instances`` (api.FusedNodes) as one fused node;
    ``inputs``: values to run the graph on once, for its shapes and folded constants."""
    graph = GraphIndex(model, inputs)
    kept: list[KeptInstance] = []
    replacements: dict[int, list[onnx.NodeProto]] = {}
    claimed: set[int] = set()
    for number, instance in enumerate(instances):
        if not instance.indices:
            continue
        is_rewrite = instance.variant == instance.pattern
        if is_rewrite and len(instance.indices) == 1:
            continue  # one ONNX node already (Clip, inference Dropout)
        try:
            if claimed & set(instance.indices):
                raise Unrepresentable("shares nodes with another fusion")
            builder = BUILDERS.get(instance.pattern)
            if builder is None:
                raise Unrepresentable(f"no fused ONNX op for {instance.pattern}")
            region = Region(graph, instance.indices)
            nodes = builder(region, instance.variant)
            produced = {o for node in nodes for o in node.output}
            missing = [o for o in region.outputs if o not in produced]
            if missing:
                raise Unrepresentable(f"{missing[0]!r} is read outside the fusion but is not a fused op output")
        except Unrepresentable as reason:
            kept.append(KeptInstance(instance.variant, list(instance.nodes), str(reason)))
            continue
        absorbed = "absorbed ONNX nodes: " + ", ".join(
            f"{graph.nodes[i].name or f'#{i}'} ({graph.nodes[i].op_type})" for i in instance.indices)
        for node in nodes:
            if node.domain == DOMAIN:
                node.name = f"{instance.variant}/{graph.nodes[instance.indices[-1]].name or instance.indices[-1]}"
                node.doc_string = f"{instance.variant}: {absorbed}"
        replacements[number] = nodes
        claimed |= set(instance.indices)
    while (late := _out_of_order(graph, instances, replacements)) is not None:
        kept.append(KeptInstance(instances[late].variant, list(instances[late].nodes),
                                 "an input of the fused node is produced after its last absorbed node"))
        del replacements[late]
    nodes = _assemble(graph, instances, replacements)
    fused = _model_with(model, graph, nodes)
    onnx.checker.check_model(fused)
    return FusedOnnx(fused,
                     dict(collections.Counter(n.op_type for n in nodes if n.domain == DOMAIN).most_common()),
                     kept)


def _assemble(graph: GraphIndex, instances, replacements) -> list[onnx.NodeProto]:
    """The graph's nodes in order, each replaced fusion's nodes at its last absorbed node."""
    owner = {i: number for number in replacements for i in instances[number].indices}
    nodes = []
    for index, node in enumerate(graph.nodes):
        number = owner.get(index)
        if number is None:
            if index in graph.live:
                nodes.append(node)
        elif index == instances[number].indices[-1]:
            nodes.extend(replacements[number])
    return nodes


def _out_of_order(graph: GraphIndex, instances, replacements) -> int | None:
    """A fusion whose node would read a tensor before it is produced (or be read before), or None."""
    available = {"", *(i.name for i in graph.model.graph.input), *(t.name for t in graph.model.graph.initializer),
                 *graph.folded_tensors}
    made_by = {o: number for number, nodes in replacements.items() for node in nodes for o in node.output}
    owner = {id(node): number for number, nodes in replacements.items() for node in nodes}
    for node in _assemble(graph, instances, replacements):
        for name in node.input:
            if name not in available:
                return owner.get(id(node), made_by.get(name))
        available.update(node.output)
    return None


def _model_with(model: onnx.ModelProto, graph: GraphIndex, nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    """``model`` with ``nodes``, the ``tvm_fusion`` opset, and only the initializers still read."""
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    del fused.graph.node[:]
    fused.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input} | graph.graph_outputs
    kept_initializers = [t for t in model.graph.initializer if t.name in used]
    kept_initializers += [numpy_helper.from_array(graph.values[name], name)
                          for name in sorted(graph.folded_tensors & used)]
    del fused.graph.initializer[:]
    fused.graph.initializer.extend(kept_initializers)
    produced = {o for node in nodes for o in node.output}
    del fused.graph.value_info[:]
    fused.graph.value_info.extend(info for info in map(graph.value_info, sorted(produced - graph.graph_outputs))
                                  if info is not None)
    for output in fused.graph.output:  # an untyped output fails onnx.checker
        if not output.type.tensor_type.elem_type and (info := graph.value_info(output.name)) is not None:
            output.CopyFrom(info)
    if not any(o.domain == DOMAIN for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    fused.graph.doc_string = ("tvm_fusion: each tvm_fusion-domain node is one fused kernel; "
                              "its doc_string lists the ONNX nodes it absorbed")
    return fused


def write_model(model: onnx.ModelProto, path: str | Path) -> Path:
    """``model`` saved atomically (no half-written file if the disk fills or the run is killed)."""
    return write_file(path, lambda staging: onnx.save(model, str(staging)), "the fused ONNX file", "--onnx")


def compare_with_onnxruntime(original: onnx.ModelProto, fused: onnx.ModelProto, inputs: dict[str, np.ndarray],
                             rtol: float, atol: float, threads: int = 1) -> list[OutputComparison]:
    """Each output of the fused graph under onnx.reference (our ops' numpy definitions) against
    the original model under ONNX Runtime, on the same inputs."""
    expected = reference_outputs(original, inputs, threads)
    with np.errstate(over="ignore", invalid="ignore"):
        values = evaluator(fused).run(None, inputs)
    actual = {o.name: np.asarray(v) for o, v in zip(fused.graph.output, values)}
    return compare_outputs(actual, expected, rtol, atol)


def check_comparisons(results: list[OutputComparison], path: Path, rtol: float, atol: float) -> None:
    """VerificationError naming the first output outside the tolerances, with the whole table."""
    failed = [r for r in results if not r.within_tolerance]
    if failed:
        raise VerificationError(
            f"the fused ONNX graph {path} disagrees with ONNX Runtime on output {failed[0].name!r}:\n"
            + format_comparisons(results, rtol, atol),
            "a fused op's reference implementation (tvm_fusion/onnx_ops.py) or its export "
            "(tvm_fusion/onnx_export.py) is wrong: report the model; [verify] rtol/atol set the tolerances")
