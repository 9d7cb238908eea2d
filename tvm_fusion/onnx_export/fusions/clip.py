"""The fused ONNX of ``clip``: one ``Activation`` node, a Clip (its bounds read from the node)."""

from ..spec import OnnxSpec
from .activation import Activation, activation_builder

SPEC = OnnxSpec("clip", activation_builder("clip"), (Activation,))
