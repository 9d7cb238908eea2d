"""The inputs an artifact is checked on, and ONNX Runtime's outputs for them, computed once per
model and shared by the targets of one compile."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import PipelineConfig
from ..frontend import onnx as onnx_frontend
from ..frontend.if_hoisting import inputs_taking
from ..preparation import PreparedModel
from ..verify import reference_outputs, reference_variants


class References:
    """Seeded inputs and ONNX Runtime's outputs for them, per seed, size and changed inputs;
    and, when an output is outside the tolerance, ONNX Runtime's own spread on them."""

    def __init__(self):
        self.entries: dict = {}
        self.variant_entries: dict = {}

    def variants(self, cfg: PipelineConfig, prepared: PreparedModel, sizes: dict[str, int],
                 changed: Mapping[str, np.ndarray] | None = None) -> dict:
        """ONNX Runtime's outputs under verify.REFERENCE_VARIANTS for the inputs of ``get``."""
        key = _key(prepared, cfg, sizes, changed)
        if key not in self.variant_entries:
            inputs, _ = self.get(cfg, prepared, False, sizes, changed)
            self.variant_entries[key] = reference_variants(prepared.onnx_model, inputs, cfg.threads)
        return self.variant_entries[key]

    def get(self, cfg: PipelineConfig, prepared: PreparedModel, with_reference: bool, sizes: dict[str, int],
            changed: Mapping[str, np.ndarray] | None = None):
        """Seeded inputs at ``sizes`` (one size per range; {} for a static model), those named in
        ``changed`` replaced by its values (another branch's), and, with ``with_reference``, ONNX
        Runtime's outputs for them."""
        key = _key(prepared, cfg, sizes, changed)
        if key not in self.entries:
            specs = onnx_frontend.inputs_at(prepared.inputs, sizes)
            seeded = onnx_frontend.random_inputs(prepared.onnx_model, specs, cfg.seed)
            self.entries[key] = [{**seeded, **(changed or {})}, None]
        entry = self.entries[key]
        if with_reference and entry[1] is None:
            entry[1] = reference_outputs(prepared.onnx_model, entry[0], cfg.threads)
        return entry[0], entry[1]


def branch_inputs(references: References, cfg: PipelineConfig, prepared: PreparedModel,
                  condition: str | None) -> tuple[list[dict[str, np.ndarray]], list[bool]]:
    """For a model built per branch of an If (``dispatch/branches.py``), the inputs to change so that
    each branch the seeded inputs do not take is checked too, and the branches no value tried
    takes (``if_hoisting.inputs_taking``)."""
    if condition is None:
        return [], []
    seeded, _ = references.get(cfg, prepared, False, {})
    model = prepared.simplified_with_weights()
    changes, unreached = [], []
    for taken in (True, False):
        found = inputs_taking(model, condition, seeded, taken)
        if found is None:
            unreached.append(taken)
        elif found is not seeded:
            changes.append({name: value for name, value in found.items() if value is not seeded[name]})
    return changes, unreached


def _key(prepared: PreparedModel, cfg: PipelineConfig, sizes: dict[str, int], changed) -> tuple:
    values = tuple((name, value.dtype.str, value.tobytes()) for name, value in sorted((changed or {}).items()))
    return id(prepared.onnx_model), cfg.seed, tuple(sorted(sizes.items())), values
