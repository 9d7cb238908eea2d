"""``OnnxSpec``: what ``inspect --onnx`` needs of one pattern beside its match and replacement."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx
from onnx.reference.op_run import OpRun

from .graph import Region

Builder = Callable[[Region, str], list[onnx.NodeProto]]


@dataclasses.dataclass(frozen=True)
class OnnxSpec:
    """The fused ONNX of the pattern named ``pattern``: ``build(region, variant)`` writes one of
    its matches (the ONNX nodes it absorbed) as ``tvm_fusion`` nodes, or raises
    ``Unrepresentable``; ``ops`` are the OpRun classes (numpy definitions) of the ops it writes.

    A built-in pattern's spec is the ``SPEC`` of ``fusions/<pattern>.py``; a plugin names its
    own through the ``tvm_fusion.onnx_export`` entry point group (``registry``).
    """

    pattern: str
    build: Builder
    ops: tuple[type[OpRun], ...]
