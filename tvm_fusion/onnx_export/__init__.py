"""The fused graph as ONNX (``tvm-fusion inspect --onnx``): one ``tvm_fusion``-domain node per fusion.

Built from the shape-simplified ONNX graph and the ONNX nodes each fusion absorbed
(``api.FusedNodes``), not from Relax: every parameter of a fused node (activation, epsilon,
scale, conv attributes) is read from the absorbed nodes themselves, their op types and
constant inputs. Fused nodes take the original tensors as inputs and outputs (scalar
constants become attributes), so the file lines up with the model it came from, Netron draws
it, and ``evaluator`` runs it under ``onnx.reference`` with each op's numpy definition.

Rewrites that no fusion absorbed become custom ops too (``Activation``, ``LayerNorm``,
``RMSNorm``) rather than standard ``Gelu`` (opset 20) or ``LayerNormalization`` (opset 17):
those would need the model's default opset raised, which changes other ops' signatures
(Split, Squeeze, ReduceMean). A rewrite of a single node (ONNX Clip, inference Dropout) keeps
that node: it is one op already. Whatever cannot be represented (an intermediate a fused op
cannot output is read elsewhere, an unknown step) keeps its original nodes, with the reason.

Each pattern's fused op has one module, ``fusions/<pattern>.py``: its builder, its OpRun and its
``SPEC``; ``registry`` finds them for the patterns of the pattern registry (plugins bring
theirs by entry point), so no list here names a pattern.

The modules, one job each:
  graph          the simplified graph as the builders read it; ``Unrepresentable``
  chains         element-wise chains after an anchor, activations, the epilogue's tail, a
                 softmax's prologue
  norms          the normalization inside a fused norm's nodes
  reference_ops  what the ops' numpy definitions share;  standard_ops: standard ONNX ops
  spec           ``OnnxSpec``: a pattern's builder and the OpRuns of the ops it writes
  fusions/       one module per pattern: its builder, its OpRun, its ``SPEC``
  registry       the specs of the registered patterns: builders, ops, ``evaluator``
  assemble       graph surgery: builders' nodes in place, a valid file, what was kept and why
  check          the fused file under onnx.reference against ONNX Runtime (``--check``)
"""

from .assemble import FusedOnnx, KeptInstance, fused_onnx, write_model
from .check import check_comparisons, compare_with_onnxruntime
from .graph import Unrepresentable
from .reference_ops import DOMAIN
from .registry import builders, evaluator, fused_ops, onnx_specs
from .spec import OnnxSpec

__all__ = ["DOMAIN", "FusedOnnx", "KeptInstance", "OnnxSpec", "Unrepresentable", "builders", "check_comparisons",
           "compare_with_onnxruntime", "evaluator", "fused_onnx", "fused_ops", "onnx_specs", "write_model"]
