"""Activation patterns shared by the epilogue fusions (GEMM, conv, squeeze-and-excitation).

They match the canonical forms the rewrite rules leave: ``nn.gelu`` for the decomposed erf
GELU, ``clip`` for the importer's maximum/minimum pair, ``x * clip(x * 1/6 + 0.5, 0, 1)`` for
HardSwish and so on, so an exporter's spelling does not matter to the fusions.
"""

from __future__ import annotations

from tvm.relax.dpl import is_const, is_op, wildcard


def hardsigmoid_pattern(x):
    scaled = is_op("relax.multiply")(x, is_const())
    return is_op("relax.clip")(is_op("relax.add")(scaled, is_const()), wildcard(), wildcard())


def prelu_pattern(x):
    """PRelu in its canonical form (``prelu.py``): ``max(x, 0) + min(x, 0) * slope``."""
    return is_op("relax.add")(is_op("relax.maximum")(x, is_const()),
                              is_op("relax.multiply")(is_op("relax.minimum")(x, is_const()), is_const()))


ACTIVATIONS = {
    "relu": lambda x: is_op("relax.nn.relu")(x),
    "gelu": lambda x: is_op("relax.nn.gelu")(x),
    "gelu_tanh": lambda x: is_op("relax.nn.gelu_tanh")(x),
    "sigmoid": lambda x: is_op("relax.sigmoid")(x),
    "silu": lambda x: is_op("relax.nn.silu")(x),
    "clip": lambda x: is_op("relax.clip")(x, wildcard(), wildcard()),
    "leakyrelu": lambda x: is_op("relax.nn.leakyrelu")(x),
    "hardsigmoid": hardsigmoid_pattern,
    "hardswish": lambda x: is_op("relax.multiply")(x, hardsigmoid_pattern(x)),
    "prelu": prelu_pattern,
}


def activation_patterns(names: tuple[str, ...]) -> dict:
    """The shared patterns of ``names`` only, in that order (what one fusion's kernel supports)."""
    return {name: ACTIVATIONS[name] for name in names}
