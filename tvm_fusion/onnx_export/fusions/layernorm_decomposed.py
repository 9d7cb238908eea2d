"""``LayerNorm``: the fused ONNX of ``layernorm_decomposed`` (a LayerNorm an exporter decomposed,
rewritten as one op), its builder and its reference implementation. ``rmsnorm_decomposed``
(``RMSNorm``) uses the builder too: it writes whichever norm the nodes compute."""

from __future__ import annotations

import onnx

from ..graph import Region, fused_node
from ..norms import norm_region
from ..reference_ops import FusedOp, layer_norm
from ..spec import OnnxSpec


def build_norm_rewrite(region: Region, variant: str) -> list[onnx.NodeProto]:
    (kind, gamma, beta, epsilon, axis, output), source = norm_region(region)
    if kind == "layer":
        return [fused_node("LayerNorm", [source, gamma, beta], [output], epsilon=epsilon, axis=axis)]
    return [fused_node("RMSNorm", [source, gamma], [output], epsilon=epsilon, axis=axis)]


class LayerNorm(FusedOp):
    """A LayerNorm the exporter decomposed (below opset 17), as one op."""

    def _run(self, x, gamma=None, beta=None, epsilon=1e-5, axis=-1):
        return (layer_norm(x, 1 if gamma is None else gamma, beta, epsilon, axis),)


SPEC = OnnxSpec("layernorm_decomposed", build_norm_rewrite, (LayerNorm,))
