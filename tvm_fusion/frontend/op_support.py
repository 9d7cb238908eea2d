"""Which ONNX ops the import can convert: TVM's converters plus the ones only we have.

Both the up-front check in ``onnx.py`` and the importer in ``converters.py`` ask here, so
neither imports the other.
"""

from __future__ import annotations

import collections

import onnx

# Ops converted only by converters.py: TVM's importer (and its unsupported-op check) does not know them.
OWN_OPS = frozenset({"LSTM", "GRU"})
# The same for ops of other domains, as "<domain>.<op>" (skl2onnx writes StandardScaler as one).
OWN_DOMAIN_OPS = frozenset({"ai.onnx.ml.Scaler"})


def unsupported_ops(model: onnx.ModelProto | onnx.GraphProto) -> dict[str, list[str]]:
    """Op type -> node names, for every node neither TVM's importer nor ours can convert."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    supported = set(_get_convert_map()) | OWN_OPS
    missing: dict[str, list[str]] = collections.defaultdict(list)
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    for index, node in enumerate(graph.node):
        default_domain = node.domain in ("", "ai.onnx")
        # A custom-domain op is named with its domain: "com.microsoft.Gelu", not "Gelu".
        op = node.op_type if default_domain else f"{node.domain}.{node.op_type}"
        if op not in (supported if default_domain else OWN_DOMAIN_OPS):
            missing[op].append(node.name or f"#{index}")
    return dict(missing)


def unsupported_ops_message(missing: dict[str, list[str]]) -> tuple[str, str]:
    """The error (message, fix) for ``unsupported_ops``' answer: each op with its first nodes."""
    listing = "; ".join(f"{op} (nodes: {', '.join(nodes[:5])}{', ...' if len(nodes) > 5 else ''})"
                        for op, nodes in sorted(missing.items()))
    return (f"the model uses ONNX ops TVM cannot import: {listing}",
            "replace these ops in the exporter (or export at another opset)")
