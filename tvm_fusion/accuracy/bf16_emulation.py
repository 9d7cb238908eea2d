"""The bf16 kernels emulated in ONNX Runtime, one switch per kernel, to find which of them a
failing bf16 build should keep float32.

A bf16 build whose outputs fail the gate (``bf16_gate.py``) though every kernel passes alone
(``commands/bf16_kernels.py``) fails by accumulation: each kernel adds an error of about
u = 2^-8 of its output, and the layers after it amplify some of those errors far more than
others (a detector's map through a steep sigmoid, a deep residual stack). Which ones only the
model can say. Rebuilding with TVM per guess costs a compile each; ONNX Runtime can answer in
one run per question instead.

The emulation copies the float32 model and, at each product a bf16 kernel computes (a Conv,
MatMul or Gemm; ``match_products`` finds them by the kernel's weight), rounds its two operands
to bf16 to nearest, as the kernel's prologue and its packed weight do, under a boolean input
per kernel: ``Where(switch, rounded(x), x)``. With every switch off it is the float32 model;
with a switch on, that kernel's operands are rounded and its sums stay float32, as in the
kernel. The order of the float32 sums differs from the kernel's, which float32 has too; a
BatchNorm that TVM folds into a conv's weight before rounding it is rounded after it here. So
the emulation ranks and predicts; the built artifact is still what the gate judges.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..verify import onnxruntime_feeds, onnxruntime_session, run_onnxruntime

# The ONNX ops whose two first operands a bf16 kernel reads rounded.
PRODUCT_OPS = ("Conv", "MatMul", "Gemm")
SWITCH_PREFIX = "tvm_fusion_bf16_switch_"
# Veltkamp's splitter for float32's 24 significant bits to bf16's 8: with t = x * (2^16 + 1),
# t - (t - x) is x rounded to 8 bits, in any opset (Cast to bf16 needs opset 13; many
# exporters write 9-12). It rounds to nearest; a tie may go away from even, which the kernel's
# rounding does not, a difference of one bf16 step in a rare element.
SPLITTER = "tvm_fusion_bf16_splitter"


def emulation_model(model: onnx.ModelProto, groups: list[list[int]]) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with the operands of the nodes in each group (indices into its nodes, each a
    ``PRODUCT_OPS`` node reading float32) rounded to bf16 under one boolean scalar input per
    group, a node in several groups rounded when any of them is on; the inputs' names."""
    emulated = onnx.ModelProto()
    emulated.CopyFrom(model)
    graph = emulated.graph
    graph.initializer.append(helper.make_tensor(SPLITTER, TensorProto.FLOAT, [], [2.0 ** 16 + 1]))
    switches = [f"{SWITCH_PREFIX}{k}" for k in range(len(groups))]
    graph.input.extend(helper.make_tensor_value_info(switch, TensorProto.BOOL, []) for switch in switches)
    owners: dict[int, list[str]] = {}
    for switch, group in zip(switches, groups):
        for index in group:
            owners.setdefault(index, []).append(switch)
    before = {}
    for index, names in owners.items():
        node = graph.node[index]
        if node.op_type not in PRODUCT_OPS:
            raise ValueError(f"node {node.name or index} is a {node.op_type}, not one of {', '.join(PRODUCT_OPS)}")
        stem = f"{SWITCH_PREFIX}node{index}"
        rounding, switch = [], names[0]
        for k, other in enumerate(names[1:]):
            rounding.append(helper.make_node("Or", [switch, other], [f"{stem}_any{k}"]))
            switch = f"{stem}_any{k}"
        for slot in (0, 1):
            source, operand = node.input[slot], f"{stem}_{slot}"
            rounding += [helper.make_node("Mul", [source, SPLITTER], [f"{operand}_scaled"]),
                         helper.make_node("Sub", [f"{operand}_scaled", source], [f"{operand}_excess"]),
                         helper.make_node("Sub", [f"{operand}_scaled", f"{operand}_excess"], [f"{operand}_rounded"]),
                         helper.make_node("Where", [switch, f"{operand}_rounded", source], [operand])]
            node.input[slot] = operand
        before[index] = rounding
    # Right before its product, the rounding reads only what the product read: still in order.
    nodes = [new for index, node in enumerate(graph.node) for new in before.get(index, []) + [node]]
    del graph.node[:]
    graph.node.extend(nodes)
    return emulated, switches


class Bf16Emulation:
    """An ONNX Runtime session of ``emulation_model`` on fixed ``inputs``: ``run(on)`` gives the
    outputs with the groups at the positions in ``on`` rounded, the others float32."""

    def __init__(self, model: onnx.ModelProto, groups: list[list[int]], inputs: dict[str, np.ndarray],
                 threads: int = 1):
        emulated, self.switches = emulation_model(model, groups)
        self.session = onnxruntime_session(emulated, threads)
        self.feeds = onnxruntime_feeds(inputs)
        self.outputs = [o.name for o in model.graph.output]

    def run(self, on: set[int]) -> dict[str, np.ndarray]:
        feeds = dict(self.feeds)
        feeds.update(onnxruntime_feeds({switch: np.array(k in on) for k, switch in enumerate(self.switches)}))
        values = run_onnxruntime(self.session, feeds)
        return {name: values[name] for name in self.outputs}


def product_weights(model: onnx.ModelProto, inputs: dict[str, np.ndarray], threads: int = 1) -> dict[int, np.ndarray]:
    """Each float32 ``PRODUCT_OPS`` node's weight as a ``[K, N]`` matrix, N its outputs (a
    Conv's output channels, a MatMul's or Gemm's columns), by node index: its second operand as
    one run of ``model`` on ``inputs`` computes it, whatever made it (an initializer, a
    Transpose or DequantizeLinear of one, or an activation)."""
    graph = model.graph
    products = {i: node for i, node in enumerate(graph.node) if node.op_type in PRODUCT_OPS and len(node.input) > 1}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in graph.output}
    wanted = sorted({node.input[1] for node in products.values()} - known)
    probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in wanted)
    values = run_onnxruntime(onnxruntime_session(probe, threads), onnxruntime_feeds(inputs))
    weights = {}
    for index, node in products.items():
        weight = values.get(node.input[1])
        if weight is None or weight.dtype != np.float32 or weight.ndim < 2:
            continue
        if node.op_type == "Conv":
            weights[index] = weight.reshape(weight.shape[0], -1).T
        elif node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
            weights[index] = weight.T
        elif weight.ndim == 2:
            weights[index] = weight
    return weights


def column_keys(matrix: np.ndarray) -> list[tuple]:
    """A key per column of ``matrix`` that a rewrite of the weight keeps: the count of its
    nonzero values and the moments of their magnitudes over the largest one, rounded. It holds
    when rows are reordered or zero rows added (a layout, padded channels) and when a column is
    scaled (a BatchNorm folded into it); rounded to 4 digits, a column near a rounding edge
    may miss, which the vote in ``match_products`` outweighs."""
    magnitude = np.abs(matrix.astype(np.float64))
    peak = magnitude.max(axis=0)
    scaled = magnitude / np.where(peak > 0, peak, 1.0)
    counts = np.count_nonzero(magnitude, axis=0)
    moments = [np.round(np.sum(scaled ** p, axis=0) / np.maximum(counts, 1), 4) for p in (1, 2, 4)]
    return list(zip(counts.tolist(), *(m.tolist() for m in moments)))


# A kernel computes an ONNX product when at least this share of its weight's columns are that
# product's: a kernel of several products (a merged QKV) has a share of each.
MIN_COLUMN_SHARE = 0.1


def match_products(weights: dict[str, list[np.ndarray]], products: dict[int, np.ndarray]) -> dict[str, list[int]]:
    """Which ONNX products (``product_weights``) each kernel computes, by its weights (one
    ``[K, N]`` matrix per call of the kernel): those whose columns are a share of at least
    ``MIN_COLUMN_SHARE`` of a call's columns. A kernel with no such product is left out."""
    owner: dict[tuple, set[int]] = {}
    for index, matrix in products.items():
        for key in column_keys(matrix):
            owner.setdefault(key, set()).add(index)
    matched = {}
    for name, matrices in weights.items():
        found: set[int] = set()
        for matrix in matrices:
            votes: dict[int, int] = {}
            keys = column_keys(matrix)
            for key in keys:
                for index in owner.get(key, ()):
                    votes[index] = votes.get(index, 0) + 1
            found |= {index for index, count in votes.items() if count >= MIN_COLUMN_SHARE * len(keys)}
        if found:
            matched[name] = sorted(found)
    return matched
