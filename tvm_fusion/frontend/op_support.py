"""Which ONNX ops the import can convert: TVM's converters plus the ones only we have.

Both the up-front check in ``onnx.py`` and the importer in ``converters.py`` ask here, so
neither imports the other.
"""

from __future__ import annotations

import collections

import onnx
from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

# Ops converted only by converters.py: TVM's importer (and its unsupported-op check) does not know them.
OWN_OPS = frozenset({"LSTM", "GRU", "ConvInteger", "QLinearConv", "QLinearMatMul"})
# Ops TVM's importer builds itself, outside its converter table: If becomes a Relax ``If`` whose
# branches are imported from its subgraphs (checked here like the main graph).
DIRECT_OPS = frozenset({"If"})
# The same for ops of other domains, as "<domain>.<op>" (skl2onnx writes StandardScaler as one,
# onnxruntime's quantize_dynamic a quantized LSTM).
OWN_DOMAIN_OPS = frozenset({"ai.onnx.ml.Scaler", "com.microsoft.DynamicQuantizeLSTM", "com.microsoft.QGemm",
                            "com.microsoft.QLinearAdd", "com.microsoft.QLinearMul",
                            "com.microsoft.MatMulIntegerToFloat", "com.microsoft.DynamicQuantizeMatMul",
                            "com.microsoft.QLinearGlobalAveragePool", "com.microsoft.QLinearAveragePool",
                            "com.microsoft.QLinearSigmoid", "com.microsoft.QLinearLeakyRelu",
                            "com.microsoft.QLinearConcat", "com.microsoft.QLinearSoftmax"})


def unsupported_ops(model: onnx.ModelProto | onnx.GraphProto) -> dict[str, list[str]]:
    """Op type -> node names, for every node neither TVM's importer nor ours can convert."""
    supported = set(_get_convert_map()) | OWN_OPS | DIRECT_OPS
    missing: dict[str, list[str]] = collections.defaultdict(list)
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    _collect_missing(graph, supported, missing, prefix="")
    return dict(missing)


def _collect_missing(graph: onnx.GraphProto, supported: set, missing: dict, prefix: str) -> None:
    """``missing`` gets every unconvertible node of ``graph`` and of the If branches in it
    (named ``If_0/then_branch/<node>``)."""
    for index, node in enumerate(graph.node):
        default_domain = node.domain in ("", "ai.onnx")
        # A custom-domain op is named with its domain: "com.microsoft.Gelu", not "Gelu".
        op = node.op_type if default_domain else f"{node.domain}.{node.op_type}"
        name = prefix + (node.name or f"#{index}")
        if op not in (supported if default_domain else OWN_DOMAIN_OPS):
            missing[op].append(name)
        elif op in DIRECT_OPS:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    _collect_missing(attribute.g, supported, missing, f"{name}/{attribute.name}/")


def unsupported_ops_message(missing: dict[str, list[str]]) -> tuple[str, str]:
    """The error (message, fix) for ``unsupported_ops``' answer: each op with its first nodes."""
    listing = "; ".join(f"{op} (nodes: {', '.join(nodes[:5])}{', ...' if len(nodes) > 5 else ''})"
                        for op, nodes in sorted(missing.items()))
    return (f"the model uses ONNX ops TVM cannot import: {listing}",
            "replace these ops in the exporter (or export at another opset)")
