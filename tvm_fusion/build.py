"""Building blocks of the later stages: tuning records for a target, ``tvm.compile`` with our
Relax pipeline, the module ``main`` callers see, and kernel-launch counts."""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import relax

from .config import PipelineConfig
from .frontend.dims import ranges_of
from .frontend.stepped_dims import expose_input_dims
from .passes.mark_shape_functions_noalias import MarkShapeFunctionsNoAlias
from .preparation import PreparedModel, Progress, quiet
from .tuning.apply import load_records


def load_tuning(config: PipelineConfig, tuning_log: str | Path | bool | None = None,
                progress: Progress = quiet):
    """The tuning records for the config's target: ``tuning_log`` is a log root (holding
    ``<target-key>/`` stores), None for the config's (``TuningConfig.read_dirs``), False for none.
    What is not applied (damaged lines, other targets or TVM versions) is said via ``progress``."""
    if tuning_log is False:
        return None
    roots = config.tuning.read_dirs() if tuning_log is None or tuning_log is True else [str(tuning_log)]
    target = config.tvm_target()
    found = [records for records in (load_records(root, target) for root in roots) if records is not None]
    # The first root holding a store for this target (the user's before the shipped one).
    records = next((r for r in found if r.directory.is_dir()), found[0] if found else None)
    if records is not None:
        records.say = lambda note: progress(f"tuning log: {note}")
        for note in records.notes:
            records.say(note)
    return records


def build(module, config: PipelineConfig):
    """``tvm.compile`` with Relax's default pipeline, then the VM's shape functions marked
    noalias (see ``passes/mark_shape_functions_noalias.py``: without it a symbolic-shape
    module's kernels keep their accumulators in memory)."""
    pipeline = tvm.transform.Sequential([relax.get_pipeline("default"), MarkShapeFunctionsNoAlias()])
    return tvm.compile(module, target=config.tvm_target(), relax_pipeline=pipeline)


def callable_module(module, prepared: PreparedModel):
    """The module whose ``main`` takes the inputs as given: with a stepped range, the
    pipeline's ``main`` (step counts first) behind one that takes plain dims."""
    return expose_input_dims(module, ranges_of(prepared.inputs))


def kernel_calls(module) -> int:
    """How many kernel launches one call of ``main`` makes: its call_tir sites and those of the
    Relax functions it calls (a stepped range's inner ``main``, a bucket's, a branch's); of an
    If's two arms, the one that launches more."""
    counted: dict = {}

    def launches(expr) -> int:
        if isinstance(expr, relax.SeqExpr):
            return sum(launches(b.value) for block in expr.blocks for b in block.bindings) + launches(expr.body)
        if isinstance(expr, relax.If):
            return max(launches(expr.true_branch), launches(expr.false_branch))
        if not isinstance(expr, relax.Call):
            return 0
        if getattr(expr.op, "name", "") == "relax.call_tir":
            return 1
        if isinstance(expr.op, relax.GlobalVar) and isinstance(module[expr.op], relax.Function):
            if expr.op not in counted:
                counted[expr.op] = launches(module[expr.op].body)
            return counted[expr.op]
        return 0

    return launches(module["main"].body)
