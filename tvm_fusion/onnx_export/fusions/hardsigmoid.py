"""The fused ONNX of ``hardsigmoid``: one ``Activation`` node, ``Clip(x + 3, 0, 6) / 6`` being a
HardSigmoid of alpha 1/6, beta 0.5."""

from ..spec import OnnxSpec
from .activation import Activation, activation_builder

SPEC = OnnxSpec("hardsigmoid", activation_builder("hardsigmoid", (1 / 6, 0.5)), (Activation,))
