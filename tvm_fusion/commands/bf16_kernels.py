"""compile's per-kernel bf16 gate: each matmul ``Bf16Matmuls`` would build in bf16, judged alone
on the activation the model gives it, and kept float32 where bf16 breaks the gate.

Why the model's own activations, not random ones (what the fusion gate feeds a kernel): with
independent inputs a matmul's bf16 error is about u = 2^-8 of its output whatever its weight.
What makes one ill-conditioned is a cancellation between its activation and its weight (a
large common part in the activation, as after a ReLU or an offset, meeting weight columns that
sum to nearly zero), and only the activations the model computes show it. They come from one
float32 run of the fused graph, built to return each candidate's activation, on compile's
seeded inputs; each matmul is then judged by ``accuracy.bf16_gate.compare_bf16_matmul`` with
the ``[verify] bf16_*`` tolerances. The whole-model gate still judges the outputs after.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm

from ..accuracy.bf16_gate import compare_bf16_matmul
from ..config import PipelineConfig
from ..frontend.dims import ranges_of
from ..passes.bf16_matmuls import bf16_candidates
from ..preparation import PreparedModel, Progress, quiet
from ..provenance import onnx_nodes_of
from ..session import Fused, ModelSession


@dataclasses.dataclass
class Bf16Decline:
    """A matmul kept float32: its binding, the ONNX nodes it computes, and its bf16 error alone."""

    matmul: str
    onnx_nodes: list[str]
    max_abs: float
    cosine: float
    reason: str

    def line(self) -> str:
        return (f"bf16 gate: kept {', '.join(self.onnx_nodes) or self.matmul} float32: alone on its activations "
                f"in bf16 it fails the gate ({self.reason})")


@dataclasses.dataclass
class Bf16KernelGate:
    """What the per-kernel gate judged (``metadata.json``'s ``bf16_gate_per_kernel``)."""

    judged: int = 0
    declined: list[Bf16Decline] = dataclasses.field(default_factory=list)
    # matmuls built bf16 without a judgement: a fused composite computes their activation itself
    unjudged: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def judge_bf16_kernels(session: ModelSession, prepared: PreparedModel, cfg: PipelineConfig, fused: Fused,
                       inputs: dict[str, np.ndarray], say: Progress = quiet) -> Bf16KernelGate:
    """Each bf16 candidate of ``fused`` (a static model's graph) judged on ``inputs``; ``say``
    names each declined matmul, and counts those it could not judge."""
    if ranges_of(prepared.inputs):
        return Bf16KernelGate()  # the symbolic graph has no candidate (its rows are not static)
    candidates = bf16_candidates(fused.module, cfg.tvm_target(), cfg.winograd)
    gate = Bf16KernelGate(unjudged=[c.name for c in candidates if c.activation is None])
    candidates = [c for c in candidates if c.activation is not None]
    arguments = [tvm.runtime.tensor(np.require(value, requirements="C")) for value in inputs.values()]
    activations = session.float32_values(fused.module, cfg, [c.activation for c in candidates],
                                         arguments) if candidates else []
    gate.judged = len(candidates)
    for candidate, activation in zip(candidates, activations):
        result = compare_bf16_matmul(candidate.name, candidate.rows(activation), candidate.weight,
                                     cfg.bf16_tolerance())
        if not result.passed:
            nodes = onnx_nodes_of([candidate.name], fused.report, prepared.simplified)
            gate.declined.append(Bf16Decline(candidate.name, nodes, result.max_abs, result.cosine, result.note))
            say(gate.declined[-1].line())
    if gate.unjudged:
        say(f"bf16 gate: {len(gate.unjudged)} matmul(s) built bf16 without a judgement of their own (a fused "
            "kernel computes their activation): the outputs' gate judges them")
    return gate
