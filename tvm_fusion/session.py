"""One model's way from ONNX to kernels, in stages that every command shares.

    prepared   the ONNX file loaded, its input shapes bound, simplified by onnxslim and imported
               into Relax with bindings named after ONNX nodes: once per shape set
    fused      canonicalize, layout and fuse; with a gate config, each fusion checked against
               its unfused nodes and undone where it differs (``fusion_gate``)
    lowered    LegalizeOps and TVM's FuseOps/FuseTIR, with which kernel came from which group
    scheduled  weights transformed, tuning records applied, hand schedules for the rest; a
               dynamic model's shape buckets built static and dispatched by ``main``, and so
               the branches of an If the input values decide (``dispatch/branches.py``)
    built      ``tvm.compile``

Each stage is cached on the session, so compile (one target or several), inspect, bench,
profile, ablate, tune and the fusion gate ask for what they need and no stage runs twice.
Only the session composes the phases of ``passes.pipeline``.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import tvm
from tvm import relax

from . import fusion_gate
from .dispatch.branches import SUFFIXES, branch_condition, with_branches
from .dispatch.buckets import bucket_points, bucket_suffix, bucket_text, with_buckets
from .build import build, callable_module, kernel_calls, load_tuning
from .config import PipelineConfig
from .frontend.dims import ranges_of
from .frontend.integer_matmul import integer_kernels_enabled
from .fusion_gate import GateReport
from .passes import GRAPH_PHASES, fusion_pipeline, stock_fusion_pipeline
from .passes.pipeline import bf16_target, graph_phases_key, is_cpu, lowering_passes, weight_passes
from .patterns import PatternReport
from .preparation import (PreparedModel, Progress, ShapeArg, prepare, prepare_at, prepare_branch, quiet,
                          resolve_config)
from .provenance import onnx_nodes_of
from .schedules import RuleError, ScheduleMemo


@dataclasses.dataclass
class Fused:
    module: object
    report: PatternReport
    gate: GateReport | None = None


@dataclasses.dataclass
class Lowered:
    module: object
    kernel_patterns: dict[str, str]  # kernel -> Composite name, "tvm FuseOps" or "single op"
    kernel_bindings: dict[str, list[str]]  # kernel -> the binding names it computes


@dataclasses.dataclass
class Bucket:
    sizes: dict[str, int]
    module: object  # the static module (before dispatch), kernel names suffixed in the artifact
    gate: GateReport | None


@dataclasses.dataclass
class Scheduled:
    """What the scheduled stage made: ``module`` is what ``build`` compiles."""

    module: object
    report: PatternReport
    schedule_rules: dict[str, str]
    tuned: dict  # kernel -> tuning.apply.TunedKernel, for kernels a tuning record scheduled
    records: object = None  # tuning.apply.TuningRecords, or None
    gate: GateReport | None = None
    dynamic_module: object = None  # ``module`` without the buckets' dispatch
    lowered: Lowered | None = None  # before schedules (of the dynamic module, or of the branches' builds)
    buckets: list[Bucket] = dataclasses.field(default_factory=list)
    # schedule rules that raised on a kernel (it went on to the next rule), buckets' included
    schedule_rule_errors: list[RuleError] = dataclasses.field(default_factory=list)
    # the If condition ``main`` dispatches on, each branch a build of its own (``dispatch/branches.py``)
    branch_condition: str | None = None


class ModelSession:
    """The stages of one model at one set of input shapes, each computed once.

    Configs may differ per call (targets, pattern lists): a stage is cached under what it
    depends on, so the import runs once per ``[inputs]`` table and the graph phases once per
    pattern list and layout.
    """

    def __init__(self, model_path: str | Path, input_shapes: ShapeArg = None, progress: Progress = quiet):
        self.model_path, self.input_shapes, self.progress = model_path, input_shapes, progress
        self._prepared: dict = {}
        self._views: dict = {}
        self._fused: dict = {}
        self._gates: dict = {}
        self._lowered: dict = {}
        self._scheduled: dict = {}
        self._schedule_memo = ScheduleMemo()  # the hand schedules of every kernel built so far

    @classmethod
    def of(cls, prepared: PreparedModel, progress: Progress = quiet) -> ModelSession:
        """A session that starts from a model already prepared (for scripts and tests)."""
        session = cls(prepared.path, None, progress)
        session._prepared[_inputs_key(prepared.config)] = prepared
        return session

    # prepared -----------------------------------------------------------------------------------

    def prepared(self, config=None) -> PreparedModel:
        """The model imported with ``config``'s ``[inputs]`` defaults, carrying ``config``."""
        cfg = resolve_config(config)
        key = _inputs_key(cfg)
        if key not in self._prepared:
            self._prepared[key] = prepare(self.model_path, cfg, self.input_shapes, self.progress)
        return self._with_config(self._prepared[key], cfg)

    def _bucket(self, prepared: PreparedModel, sizes: dict[str, int]) -> PreparedModel:
        """``prepared``'s model imported static at one exact size of its ranges."""
        cfg = dataclasses.replace(prepared.config, buckets=())
        key = (_inputs_key(cfg), tuple(sorted(sizes.items())))
        if key not in self._prepared:
            self._prepared[key] = prepare_at(prepared, cfg, sizes, self.progress)
        return self._with_config(self._prepared[key], cfg)

    def _branch(self, prepared: PreparedModel, condition: str, taken: bool | None) -> PreparedModel:
        """``prepared``'s model as one branch of an If computes it, or its condition alone (None)."""
        key = (_inputs_key(prepared.config), id(prepared.relax_module), condition, taken)
        if key not in self._prepared:
            self._prepared[key] = prepare_branch(prepared, prepared.config, condition, taken)
        return self._with_config(self._prepared[key], prepared.config)

    def _with_config(self, prepared: PreparedModel, cfg: PipelineConfig) -> PreparedModel:
        """The same import under another config (stages are cached by the import's identity)."""
        key = (id(prepared.relax_module), repr(cfg))
        if key not in self._views:
            self._views[key] = prepared if prepared.config == cfg else dataclasses.replace(prepared, config=cfg)
        return self._views[key]

    # fused --------------------------------------------------------------------------------------

    def fused(self, prepared: PreparedModel, excluded: frozenset[str] = frozenset(),
              gate_config: PipelineConfig | None = None, say: Progress | None = None) -> Fused:
        """The graph phases on ``prepared``'s import; ``excluded`` bindings stay unfused.

        With ``gate_config`` (a config whose code runs here), each fusion of ``prepared``'s
        patterns is checked against its unfused nodes first, and what fails is undone for every
        target (``excluded`` is then not used).
        """
        if gate_config is None:
            return Fused(*self._fuse(prepared, excluded))
        gate_config = dataclasses.replace(gate_config, patterns=prepared.config.patterns)
        gate_key = (id(prepared.relax_module), graph_phases_key(gate_config))
        if gate_key not in self._gates:
            (say or self.progress)("checking each fusion against its unfused nodes (--no-fusion-gate skips this)")
            gate_prepared = self._with_config(prepared, gate_config)
            self._gates[gate_key] = fusion_gate.gated_fuse(
                lambda excluded: self._fuse(gate_prepared, excluded), gate_config, self._lower_and_schedule,
                lambda names: onnx_nodes_of(names, self._fuse(gate_prepared, frozenset())[1], prepared.simplified),
                say or self.progress)
        module, report, gate = self._gates[gate_key]
        if graph_phases_key(gate_config) != graph_phases_key(prepared.config):  # another target's layout
            module, report = self._fuse(prepared, gate.undone_bindings)
        return Fused(module, report, gate)

    def _fuse(self, prepared: PreparedModel, excluded: frozenset[str]):
        cfg = prepared.config
        key = (id(prepared.relax_module), graph_phases_key(cfg), excluded)
        if key not in self._fused:
            if not excluded:
                self.progress(f"running the tvm_fusion pipeline ({len(cfg.patterns)} patterns)")
            report = PatternReport()
            module = fusion_pipeline(cfg, report, phases=GRAPH_PHASES, excluded=excluded)(prepared.relax_module)
            self._fused[key] = (module, report)
        return self._fused[key]

    # lowered ------------------------------------------------------------------------------------

    def lowered(self, fused: Fused, config: PipelineConfig) -> Lowered:
        """LegalizeOps and TVM's fusion of what our patterns left: one PrimFunc per kernel."""
        bf16 = bf16_target(config)  # in the key as a target: the bf16 kernel may differ per CPU
        cpu = is_cpu(config)
        key = (id(fused.module), config.fast_math, config.winograd, str(bf16), config.bf16_declined, cpu)
        if key not in self._lowered:
            passes = lowering_passes(config.fast_math, config.winograd, bf16, frozenset(config.bf16_declined), cpu)
            split = [p.info.name for p in passes].index("FuseTIR")
            grouped = tvm.transform.Sequential(passes[:split])(fused.module)
            patterns, bindings = kernel_groups(grouped)
            self._lowered[key] = Lowered(tvm.transform.Sequential(passes[split:])(grouped), patterns, bindings)
        return self._lowered[key]

    def tuning_module(self, config=None):
        """The module whose kernels MetaSchedule tunes: lowered, weights in the form the kernels
        read (the schedule phase's first step), so that a record matches what compile builds."""
        cfg = resolve_config(config)
        lowered = self.lowered(self.fused(self.prepared(cfg)), cfg)
        return tvm.transform.Sequential(weight_passes(cfg))(lowered.module)

    def float32_values(self, fused: tvm.IRModule, config: PipelineConfig, values: list, inputs: list) -> list:
        """``values`` (expressions of ``fused``'s ``main``, a fused stage's module) as one float32
        run of its graph computes them on ``inputs`` (``main``'s arguments, a static model's): the
        activations compile's per-kernel bf16 gate judges each matmul on (``commands/bf16_kernels.py``)."""
        main = fused["main"]
        blocks = list(main.body.blocks)
        taps = list(values)
        for index, block in enumerate(blocks):  # a block's own variables leave it as outputs
            own = {binding.var for binding in block.bindings}
            extra = [(i, relax.Var(f"bf16_tap{i}", value.ty)) for i, value in enumerate(values) if value in own]
            for i, tap in extra:
                taps[i] = tap
            blocks[index] = type(block)([*block.bindings, *(relax.VarBinding(tap, values[i]) for i, tap in extra)])
        module = tvm.IRModule(dict(fused.functions_items()), fused.attrs, fused.global_infos)
        module["main"] = relax.Function(main.params, relax.SeqExpr(blocks, relax.Tuple(taps)),
                                        relax.TupleType([tap.ty for tap in taps]), main.is_pure, main.attrs)
        module = relax.transform.DeadCodeElimination(["main"])(relax.transform.Normalize()(module))
        float32 = dataclasses.replace(config, precision="float32", bf16_declined=())
        vm = relax.VirtualMachine(build(self._lower_and_schedule(module, float32), float32), tvm.cpu())
        result = vm["main"](*inputs)
        return [result[i].numpy() for i in range(len(taps))]

    # scheduled ----------------------------------------------------------------------------------

    def scheduled(self, config=None, tuning_log: str | Path | bool | None = None,
                  gate_config: PipelineConfig | None = None, excluded: frozenset[str] = frozenset(),
                  say: Progress | None = None) -> Scheduled:
        """The configured pipeline to the end: what ``built`` compiles.

        ``tuning_log``: a log root, None for the config's stores, False for hand schedules only
        (``build.load_tuning``). With shape buckets in the config, each bucket is a static
        build of its own and ``main`` dispatches to it (``dispatch/buckets.py``).
        """
        cfg = resolve_config(config)
        key = (repr(cfg), str(tuning_log), repr(gate_config), excluded)
        if key in self._scheduled:
            return self._scheduled[key]
        say = say or self.progress
        prepared = self.prepared(cfg)
        records = load_tuning(cfg, tuning_log, say)
        rules: dict[str, str] = {}
        rule_errors: list[RuleError] = []
        fused = self.fused(prepared, excluded, gate_config, say)
        points = bucket_points(cfg.buckets, _ranges(prepared))
        condition = branch_condition(prepared)  # never with a range, so never with buckets
        buckets = []
        if condition is None:
            lowered = self.lowered(fused, cfg)
            dynamic = callable_module(self._schedule(lowered.module, cfg, records, rules, rule_errors), prepared)
            for point in points:
                say(f"bucket {bucket_text(point)}: a static build for that exact size")
                static = self._bucket(prepared, point)
                bucket_module, bucket_gate, _ = self._variant(static, bucket_suffix(point), excluded, gate_config,
                                                              records, rules, rule_errors, say)
                buckets.append(Bucket(point, bucket_module, bucket_gate))
            module = with_buckets(dynamic, [(b.sizes, b.module) for b in buckets], _ranges(prepared)) if buckets else dynamic
        else:
            say(f"an If decided by the input values ({condition}): a build per branch, main runs the one taken")
            # The branches hold the inlined model's fusions, at its shapes: what its gate undid
            # stays undone in them, without gating each build again.
            undone = fused.gate.undone_bindings if fused.gate is not None else excluded
            builds = [self._variant(self._branch(prepared, condition, taken), SUFFIXES[taken], undone, None,
                                    records, rules, rule_errors, say) for taken in (None, True, False)]
            module = dynamic = with_branches(*(scheduled for scheduled, _, _ in builds))
            # The kernels that run are the branches': profile and the generic-kernel guard read these.
            lowered = _dispatched_lowered([lowered for _, _, lowered in builds])
        if records and records.applied:
            say(f"tuned schedules from {records.directory} for {len(records.applied)} kernel(s)")
        result = Scheduled(module, fused.report, rules, dict(records.applied) if records else {}, records,
                           fused.gate, dynamic, lowered, buckets, rule_errors, condition)
        self._scheduled[key] = result
        return result

    def _variant(self, variant: PreparedModel, suffix: str, excluded: frozenset[str], gate_config,
                 records, rules: dict[str, str], rule_errors: list[RuleError], say: Progress):
        """A static build of a variant of the model (a bucket, a branch), its kernels' rules,
        rule errors and tuning records noted under the names ``suffix`` gives them in the
        artifact; the scheduled module, its fusion gate report and its lowered stage."""
        gate = dataclasses.replace(gate_config, buckets=()) if gate_config is not None else None
        fused = self.fused(variant, excluded, gate, say)
        before = dict(records.applied) if records else {}
        log: dict[str, str] = {}
        errors: list[RuleError] = []
        lowered = self.lowered(fused, variant.config)
        module = callable_module(self._schedule(lowered.module, variant.config, records, log, errors), variant)
        rules.update({name + suffix: rule for name, rule in log.items()})
        rule_errors += [dataclasses.replace(error, kernel=error.kernel + suffix) for error in errors]
        if records:  # the variant's tuned kernels, under their names in the artifact
            tuned = {name: kernel for name, kernel in records.applied.items() if before.get(name) is not kernel}
            records.applied = {**before, **{name + suffix: kernel for name, kernel in tuned.items()}}
        return module, fused.gate, lowered

    def release(self, scheduled: Scheduled) -> None:
        """Forget a scheduled stage that will not be built again (compile, once it has built it),
        so that its packed weights are freed before the artifact is loaded to be checked."""
        self._scheduled = {key: value for key, value in self._scheduled.items() if value is not scheduled}

    def _schedule(self, lowered, cfg: PipelineConfig, records, log: dict[str, str], rule_errors: list[RuleError]):
        return fusion_pipeline(cfg, PatternReport(), phases=("schedule",), tuning=records, schedule_log=log,
                               rule_errors=rule_errors, schedule_memo=self._schedule_memo)(lowered)

    def _lower_and_schedule(self, module, cfg: PipelineConfig):
        """Lower and hand-schedule a module (the fusion gate's fused side)."""
        return fusion_pipeline(cfg, PatternReport(), phases=("lower", "schedule"),
                               schedule_memo=self._schedule_memo)(module)

    # built --------------------------------------------------------------------------------------

    def built(self, config=None, tuning_log: str | Path | bool | None = None, **scheduled):
        """``tvm.compile`` of the scheduled module (a Relax VM executable)."""
        cfg = resolve_config(config)
        return build(self.scheduled(cfg, tuning_log, **scheduled).module, cfg)

    def stock_built(self, config=None):
        """Stock TVM: its default pipeline on the same import (no fusion, no CPU schedules)."""
        prepared = self.prepared(config)
        return tvm.compile(callable_module(prepared.relax_module, prepared), target=prepared.config.tvm_target())

    def stock_kernel_calls(self, config=None) -> int:
        """Kernel launches per call with TVM's own fusion instead of ours."""
        return kernel_calls(stock_fusion_pipeline()(self.prepared(config).relax_module))


def through_pipeline(module, config: PipelineConfig):
    """A Relax module that is no ONNX model (a probe's hand-built graph) through every phase."""
    return fusion_pipeline(config, PatternReport())(module)


def optimize(prepared: PreparedModel, tuning_log: str | Path | bool | None = None,
             progress: Progress = quiet) -> Scheduled:
    """The scheduled stage of an already prepared model (scripts and tests build piece by piece)."""
    return ModelSession.of(prepared, progress).scheduled(prepared.config, tuning_log)


def _dispatched_lowered(builds: list[Lowered]) -> Lowered:
    """The lowered stages of the condition's, the then branch's and the else branch's builds as
    one, under the names their kernels have in the artifact."""
    def renamed(field: str) -> dict:
        return {name + SUFFIXES[taken]: value for taken, build in zip((None, True, False), builds)
                for name, value in getattr(build, field).items()}

    return Lowered(with_branches(*(build.module for build in builds)), renamed("kernel_patterns"),
                   renamed("kernel_bindings"))


def kernel_groups(grouped) -> tuple[dict[str, str], dict[str, list[str]]]:
    """After FuseOps, before FuseTIR (which names each kernel after its group): kernel -> how it
    was grouped, and kernel -> the binding names it computes (its group's, or its own)."""
    patterns: dict[str, str] = {}
    covered: dict[str, list[str]] = collections.defaultdict(list)
    for block in grouped["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call):
                continue
            if isinstance(value.op, relax.GlobalVar):
                func = grouped[value.op]
                name = value.op.name_hint
                composite = func.attrs.get("Composite") if func.attrs else None
                patterns[name] = str(composite) if composite else "tvm FuseOps"
                covered[name] += [b.var.name for inner in func.body.blocks for b in inner.bindings]
            elif getattr(value.op, "name", "") == "relax.call_tir":
                name = value.args[0].name_hint
                patterns.setdefault(name, "single op")
                covered[name].append(binding.var.name)
    return patterns, dict(covered)


def _inputs_key(cfg: PipelineConfig):
    """What an import depends on: the dims' defaults, and whether the target takes the int8
    matmul kernel (``frontend/integer_matmul.py``)."""
    with cfg.tvm_target():
        int8 = integer_kernels_enabled()
    return repr((sorted(cfg.dim_defaults.items()), int8))




def _ranges(prepared: PreparedModel):
    return ranges_of(prepared.inputs)
