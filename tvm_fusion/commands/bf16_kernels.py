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

Where the outputs fail though every kernel passed alone, the errors add up through the layers
after them, and ``emulated_declines`` picks more kernels to keep float32: it emulates the bf16
products in ONNX Runtime (``accuracy/bf16_emulation.py``), measures how far rounding each one
alone moves the outputs, and keeps float32 the fewest of the worst whose emulated outputs are
within a ``margin`` of the gate; compile then rebuilds and the gate judges the artifact again.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm

from ..accuracy.bf16_emulation import Bf16Emulation, match_products, product_weights
from ..accuracy.bf16_gate import classifier_outputs, compare_bf16, compare_bf16_matmul
from ..config import PipelineConfig
from ..frontend.dims import ranges_of
from ..passes.bf16_matmuls import bf16_candidates
from ..native_log import captured_native_stderr, summarize
from ..preparation import PreparedModel, Progress, quiet
from ..provenance import node_label, onnx_nodes_of
from ..session import Fused, ModelSession
from ..verify import ReferenceUnavailable


@dataclasses.dataclass
class Bf16Decline:
    """A matmul kept float32: its ``Bf16Candidate.key`` (a binding of main, or one call of a
    composite), the ONNX nodes it computes, and why: its bf16 error
    alone (``judged_by`` "alone": the error of its own output), or what rounding it moves the
    model's outputs by ("emulation": ``max_abs`` the largest change, ``cosine`` None)."""

    matmul: str
    onnx_nodes: list[str]
    max_abs: float
    cosine: float | None
    reason: str
    judged_by: str = "alone"

    def line(self) -> str:
        how = "alone on its activations in bf16 it fails the gate" if self.judged_by == "alone" else \
            "in bf16 it moves the outputs too far, emulated in ONNX Runtime"
        return f"bf16 gate: kept {', '.join(self.onnx_nodes) or self.matmul} float32: {how} ({self.reason})"


@dataclasses.dataclass
class Bf16KernelGate:
    """What the per-kernel gate judged (``metadata.json``'s ``bf16_gate_per_kernel``)."""

    judged: int = 0
    declined: list[Bf16Decline] = dataclasses.field(default_factory=list)
    # matmuls built bf16 without a judgement: a fused composite computes their activation itself
    unjudged: list[str] = dataclasses.field(default_factory=list)
    # the gate's margins the emulation kept more float32 for, one rebuild each (``emulated_declines``)
    emulation_margins: list[float] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def judge_bf16_kernels(session: ModelSession, prepared: PreparedModel, cfg: PipelineConfig,
                       gate_config: PipelineConfig | None, inputs: dict[str, np.ndarray],
                       say: Progress = quiet) -> Bf16KernelGate:
    """Each bf16 candidate of the fused graph that ``scheduled`` lowers (a static model's; the
    fusion gate's ``gate_config``) judged on ``inputs``; ``say`` names each declined matmul, and
    counts those it could not judge."""
    native: list[str] = []
    with captured_native_stderr(native):
        gate = _judge(session, prepared, cfg, session.fused(prepared, frozenset(), gate_config, say), inputs, say)
    for message in summarize(native):
        say(f"tvm: {message}")
    return gate


def _judge(session: ModelSession, prepared: PreparedModel, cfg: PipelineConfig, fused: Fused,
           inputs: dict[str, np.ndarray], say: Progress) -> Bf16KernelGate:
    if ranges_of(prepared.inputs):
        return Bf16KernelGate()  # the symbolic graph has no candidate (its rows are not static)
    candidates = bf16_candidates(fused.module, cfg.tvm_target(), cfg.winograd)
    gate = Bf16KernelGate(unjudged=[c.key for c in candidates if c.activation is None])
    candidates = [c for c in candidates if c.activation is not None]
    arguments = [tvm.runtime.tensor(np.require(value, requirements="C")) for value in inputs.values()]
    activations = session.float32_values(fused.module, cfg, [c.activation for c in candidates],
                                         arguments) if candidates else []
    gate.judged = len(candidates)
    failed = [(c, r) for c, r in ((c, compare_bf16_matmul(c.name, c.rows(a), c.weight, cfg.bf16_tolerance()))
                                  for c, a in zip(candidates, activations)) if not r.passed]
    nodes = _onnx_nodes(prepared, fused, [c for c, _ in failed], inputs, cfg.threads)
    for candidate, result in failed:
        gate.declined.append(Bf16Decline(candidate.key, nodes[candidate.key], result.max_abs, result.cosine,
                                         result.note))
        say(gate.declined[-1].line())
    if gate.unjudged:
        say(f"bf16 gate: {len(gate.unjudged)} matmul(s) built bf16 without a judgement of their own (a fused "
            "kernel computes their activation): the outputs' gate judges them")
    return gate


def _onnx_nodes(prepared: PreparedModel, fused: Fused, candidates: list, inputs: dict[str, np.ndarray],
                threads: int) -> dict[str, list[str]]:
    """Each candidate's ONNX nodes by key: a call of a composite by its weight's columns
    (``match_products``: the composite's own nodes are its first call's), a binding of main, or
    a call no product matches, by its name's provenance."""
    calls = {c.key: [c.weight] for c in candidates if c.call is not None}
    model = prepared.simplified_with_weights() if calls else prepared.simplified
    try:
        matched = match_products(calls, product_weights(model, inputs, threads)) if calls else {}
    except ReferenceUnavailable:  # named by provenance, as a binding of main is
        matched = {}
    return {c.key: [node_label(model, i) for i in matched[c.key]] if c.key in matched
            else onnx_nodes_of([c.name], fused.report, prepared.simplified) for c in candidates}


def emulated_declines(session: ModelSession, prepared: PreparedModel, cfg: PipelineConfig,
                      gate_config: PipelineConfig | None, gate: Bf16KernelGate,
                      reference: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], margin: float,
                      say: Progress = quiet) -> list[Bf16Decline]:
    """More matmuls to keep float32, beyond ``gate.declined``, for outputs that failed the gate
    on ``reference``'s inputs (with ONNX Runtime's float32 outputs for them): the fewest of those
    whose rounding alone moves the outputs most, such that the emulated outputs pass the gate with
    its allowances times ``margin``. Empty where emulation cannot help: no bf16 matmul maps to an
    ONNX product, or the outputs pass with all of them rounded, or fail with none."""
    inputs, expected = reference
    floats = [name for name, value in expected.items() if np.issubdtype(value.dtype, np.floating)]
    fused = session.fused(prepared, frozenset(), gate_config, say)
    kept = {d.matmul for d in gate.declined}
    weights = {candidate.key: [candidate.weight] for candidate in
               bf16_candidates(fused.module, cfg.tvm_target(), cfg.winograd) if candidate.key not in kept}
    if not weights:
        return []
    model = prepared.simplified_with_weights()
    try:
        matched = match_products(weights, product_weights(model, inputs, cfg.threads))
        names = sorted(matched)
        if not names or not floats:  # shares are of float outputs
            return []
        unmatched = len(weights) - len(names)
        say(f"bf16 gate: emulating {len(names)} bf16 matmul(s) in ONNX Runtime to find which to keep float32"
            + (f" ({unmatched} more matched no ONNX product and stay bf16)" if unmatched else ""))
        emulation = Bf16Emulation(model, [matched[name] for name in names], inputs, cfg.threads)
        chosen = _fewest_of_the_worst(emulation, expected, floats, cfg, classifier_outputs(prepared.onnx_model),
                                      margin)
    except ReferenceUnavailable as err:  # a model ONNX Runtime runs, whose emulation it cannot
        say(f"bf16 gate: no emulation: {err.message}")
        return []
    declines = []
    for k, (share, output, change) in chosen:
        nodes = [node_label(model, i) for i in matched[names[k]]]
        declines.append(Bf16Decline(names[k], nodes, change, None,
                                    f"alone {share:.2g}x the gate's allowance on {output}", judged_by="emulation"))
        say(declines[-1].line())
    return declines


def _fewest_of_the_worst(emulation: Bf16Emulation, expected: dict[str, np.ndarray], floats: list[str],
                         cfg: PipelineConfig, classifiers: dict[str, str], margin: float) -> list[tuple]:
    """The switches to turn off, each with (its share of the gate's allowance alone, the output
    it moves most, by how much): the fewest of those that move the outputs most, such that the
    rest pass the gate at ``margin``; none where the outputs pass with all on or fail with none."""
    tolerance = cfg.bf16_tolerance()
    target = tolerance.scaled(margin)

    def passes(outputs: dict[str, np.ndarray]) -> bool:
        return all(r.passed for r in compare_bf16(outputs, expected, target, classifiers, cfg.rtol, cfg.atol))

    count = len(emulation.switches)
    everything = set(range(count))
    base = emulation.run(set())
    if not passes(base) or passes(emulation.run(everything)):
        return []
    moves = []
    for k in range(count):
        moved = emulation.run({k})
        moves.append(max((tolerance.share(moved[output] - base[output], expected[output]), output,
                          float(np.abs(moved[output] - base[output]).max())) for output in floats))
    order = sorted(range(count), key=lambda k: -moves[k][0])

    def passes_without(taken: int) -> bool:
        return passes(emulation.run(everything - set(order[:taken])))

    # doubling to a count that passes, then halving back between
    low, high = 0, 1
    while high < count and not passes_without(high):
        low, high = high, min(2 * high, count)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if passes_without(middle) else (middle, high)
    return [(k, moves[k]) for k in order[:high]]
