"""The fused ONNX of ``hardswish``: one ``Activation`` node, a HardSwish."""

from ..spec import OnnxSpec
from .activation import Activation, activation_builder

SPEC = OnnxSpec("hardswish", activation_builder("hardswish"), (Activation,))
