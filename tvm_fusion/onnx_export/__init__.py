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

The modules, one job each:
  graph       the simplified graph as the builders read it; ``Unrepresentable``
  chains      element-wise chains after an anchor, activations, the epilogue's tail
  epilogues   matmul, conv, squeeze-excitation and resize-merge builders
  attention   attention and softmax builders (the score prologue they share)
  norms       skip norms and decomposed norms;  rewrites: decomposed activations, AddEyeLike
  assemble    graph surgery: builders' nodes in place, a valid file, what was kept and why
  check       the fused file under onnx.reference against ONNX Runtime (``--check``)
"""

from .assemble import BUILDERS, FusedOnnx, KeptInstance, fused_onnx, write_model
from .check import check_comparisons, compare_with_onnxruntime
from .graph import Unrepresentable

__all__ = ["BUILDERS", "FusedOnnx", "KeptInstance", "Unrepresentable", "check_comparisons",
           "compare_with_onnxruntime", "fused_onnx", "write_model"]
