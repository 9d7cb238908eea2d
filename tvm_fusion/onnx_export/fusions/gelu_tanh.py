"""The fused ONNX of ``gelu_tanh``: one ``Activation`` node, a tanh GELU."""

from ..spec import OnnxSpec
from .activation import Activation, activation_builder

SPEC = OnnxSpec("gelu_tanh", activation_builder("gelu_tanh"), (Activation,))
