"""The fused ONNX of ``silu``: one ``Activation`` node, a SiLU."""

from ..spec import OnnxSpec
from .activation import Activation, activation_builder

SPEC = OnnxSpec("silu", activation_builder("silu"), (Activation,))
