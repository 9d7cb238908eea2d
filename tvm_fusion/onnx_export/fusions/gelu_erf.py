"""The fused ONNX of ``gelu_erf``: one ``Activation`` node, an erf GELU."""

from ..spec import OnnxSpec
from .activation import Activation, activation_builder

SPEC = OnnxSpec("gelu_erf", activation_builder("gelu"), (Activation,))
