"""The tvm_fusion pipeline, in phases, per target.

    canonicalize  recognize exporter-decomposed activations (one op instead of five), compute
                  Einsum contractions as matmuls and Conv1d as one-row Conv2d, and cancel the
                  transposes channels-last converters wrap around each conv, so that fusion
                  patterns see the graph the model author wrote; merge convs of one input
                  (an STFT's real and imaginary filters) into one, compute a strided
                  one-row conv as a matmul of its input's frames; stack the rows of independent matmuls by one constant weight (an
                  unrolled RNN's input projections) into one matmul
    layout        (``conv_layout = "NCHWc"``, CPU) dense convs in the blocked channel layout,
                  transforms only where the blocked chain starts and ends; (AVX512-VNNI targets)
                  quantized convs, float32 convs of whole numbers, as int8 kernels (``Int8Convs``)
    fuse          our fusion patterns: each match becomes one composite = one kernel
    lower         concats of many tensors split in chunks (no kernel of hundreds of buffers),
                  at bf16 matmuls by constant weights as bf16 kernels (``Bf16Matmuls``),
                  LegalizeOps (blocked 3x3 convs by Winograd when winograd is on; vectorizable
                  exp/erf/tanh when fast_math is on) + TVM's own
                  FuseOps/FuseTIR for everything our patterns left
    schedule      constant weights in the form their kernels read (Winograd convs' transformed
                  weights, matmul weights in column panels, subnormal values flushed to zero),
                  then a tuned schedule
                  from the tuning log, else a hand-written TensorIR schedule (stock CPU
                  schedules none); at bf16, a tensor only bf16 kernels read is written
                  and read as bf16 (``Bf16Activations``); a kernel with AMX tiles restores
                  its caller's tile configuration at its end

The stock comparison pipeline is TVM's "zero" pipeline: the same lowering without our
patterns or schedules.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..config import PipelineConfig
from ..frontend import integer_matmul
from ..kernels.cpu_features import has_vnni
from ..patterns import FusionRule, PatternReport, RewriteRule, get_pattern
from ..schedules import ApplySchedules, RuleError, ScheduleMemo
from ..targets.target_info import vector_lanes
from ..tuning.apply import ApplyTuningRecords
from .apply_rewrite_rules import ApplyRewriteRules
from .batch_shared_weight_matmuls import BatchSharedWeightMatmuls
from .bf16_activations import Bf16Activations
from .bf16_matmuls import Bf16Matmuls
from .blocked_layout import ConvertConvsToBlockedLayout
from .blocked_layout_legalize import blocked_conv2d_legalize, gather_layout_transform_legalize
from .crop_dead_conv_taps import CropDeadConvTaps
from .einsum_as_matmul import EinsumAsMatmul
from .fast_math import fast_math_legalize_map
from .flush_subnormal_constants import FlushSubnormalConstants
from .fold_constants import FoldConstantsSafely
from .fuse_patterns import FusePatterns
from .int8_convs import Int8Convs
from .conv1d_as_conv2d import Conv1dAsConv2d
from .interleave_power_spectrum import InterleavePowerSpectrum
from .merge_sibling_convs import MergeSiblingConvs
from .pack_matmul_weights import PackMatmulWeights
from .precompute_winograd_weights import PrecomputeWinogradWeights
from .restore_tile_config import RestoreTileConfig
from .sink_views import SinkViews
from .split_wide_concats import SplitWideConcats
from .strided_row_conv_as_matmul import StridedRowConvAsMatmul


# The graph-level phases: what inspect and a multi-target compile share before lowering.
GRAPH_PHASES = ("canonicalize", "layout", "fuse")


def fusion_pipeline(config: PipelineConfig, report: PatternReport,
                    phases: tuple[str, ...] = (*GRAPH_PHASES, "lower", "schedule"),
                    schedule_log: dict[str, str] | None = None, tuning=None,
                    excluded: frozenset[str] = frozenset(),
                    rule_errors: list[RuleError] | None = None,
                    schedule_memo: ScheduleMemo | None = None) -> tvm.transform.Pass:
    """The configured pipeline (optionally only some phases, for inspection and tests).

    ``report`` receives fusion counts and near misses; ``schedule_log`` (kernel -> schedule
    rule) what the schedule phase did, and ``rule_errors`` the schedule rules that raised on a
    kernel (which then went on to the next rule). ``tuning`` (tuning.apply.TuningRecords)
    schedules the kernels it has records for before the hand-written rules take the rest.
    ``excluded``: binding names no fusion may take (instances the numeric gate undid).
    ``schedule_memo`` answers for the kernels a build of the same model scheduled before.
    """
    rules = [get_pattern(name) for name in config.patterns]
    rewrites = [rule for rule in rules if isinstance(rule, RewriteRule)]
    fusions = [rule for rule in rules if isinstance(rule, FusionRule)]
    passes = {
        "canonicalize": lambda: [
            relax.transform.ConvertToDataflow(),
            # Folds the importer's constant bound/shape computations so rules see constants.
            FoldConstantsSafely(),
            EinsumAsMatmul(),
            Conv1dAsConv2d(),
            CropDeadConvTaps(),
            SinkViews(),
            ApplyRewriteRules(rewrites, report),
            relax.transform.DeadCodeElimination(),
            # After the rewrites: batch norms are folded and channels-last views sunk, so a
            # conv's bias and activation read it directly and keep the conv out of both.
            MergeSiblingConvs(report),
            StridedRowConvAsMatmul(report),
            InterleavePowerSpectrum(report),
            BatchSharedWeightMatmuls(report),
            relax.transform.ConvertToDataflow(),
        ],
        "layout": lambda: layout_passes(config, report),
        "fuse": lambda: [FusePatterns(fusions, report, excluded)],
        "lower": lambda: lowering_passes(config.fast_math, config.winograd, bf16_target(config),
                                         frozenset(config.bf16_declined), is_cpu(config)),
        "schedule": lambda: schedule_passes(config, schedule_log, tuning, rule_errors, schedule_memo),
    }
    return tvm.transform.Sequential([p for phase in phases for p in passes[phase]()],
                                    name="tvm_fusion.Pipeline")


def layout_passes(config: PipelineConfig, report: PatternReport) -> list[tvm.transform.Pass]:
    block = _conv_block(config)
    blocked = [] if block is None else [ConvertConvsToBlockedLayout(block[0], report, block[1])]
    return [*blocked, *([Int8Convs(config.tvm_target())] if _int8_convs(config) else [])]


def graph_phases_key(config: PipelineConfig) -> tuple:
    """What the graph phases read of a config: two configs with equal keys fuse a model alike
    (targets that share a conv block width and AVX512-VNNI or not share one fused graph)."""
    return config.patterns, _conv_block(config), _int8_convs(config)


def _int8_convs(config: PipelineConfig) -> bool:
    """Whether quantized convs become int8 kernels (``Int8Convs``): CPUs with AVX512-VNNI (AMX
    tiles or ``vpdpbusd`` registers compute them)."""
    return integer_matmul.INT8_KERNELS and has_vnni(config.tvm_target())


def _conv_block(config: PipelineConfig) -> tuple[int, bool] | None:
    """(channel block width, depthwise blocked too) of the blocked conv layout, or None."""
    target = config.tvm_target()
    if config.conv_layout != "NCHWc" or target.kind.name != "llvm":
        return None
    return vector_lanes(target, "float32"), config.blocked_depthwise


def legalize_map(fast_math: bool = True, winograd: bool = True, cpu: bool = True) -> dict:
    """Our legalizations over TVM's: the blocked conv (TVM's refuses it; Winograd with
    ``winograd``), fast-math exp/erf/tanh (softmax as a ``cpu`` target's rules read it)."""
    legalize = {"relax.nn.conv2d": lambda bb, call: blocked_conv2d_legalize(bb, call, winograd),
                "relax.layout_transform": gather_layout_transform_legalize}
    if fast_math:
        legalize.update(fast_math_legalize_map(cpu))
    return legalize


def is_cpu(config: PipelineConfig) -> bool:
    """Whether the config builds for a CPU (its kernels then take the CPU rules' legalizations)."""
    return config.tvm_target().kind.name == "llvm"


def bf16_target(config: PipelineConfig) -> tvm.target.Target | None:
    """The target to build bf16 kernels for, None where the config builds float32 ones."""
    return config.tvm_target() if config.bf16_kernels() else None


def lowering_passes(fast_math: bool = True, winograd: bool = True, bf16: tvm.target.Target | None = None,
                    bf16_declined: frozenset[str] = frozenset(), cpu: bool = True) -> list[tvm.transform.Pass]:
    """With ``bf16`` (a target), matmuls by constant weights become its bf16 kernels before
    LegalizeOps and FuseOps, so that TVM's fusion puts their float32 epilogues in the same kernel;
    those named in ``bf16_declined`` stay float32."""
    return [
        SplitWideConcats(),
        *([Bf16Matmuls(bf16, bf16_declined, winograd)] if bf16 is not None else []),
        relax.transform.LegalizeOps(legalize_map(fast_math, winograd, cpu)),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def schedule_passes(config: PipelineConfig, schedule_log: dict[str, str] | None, tuning=None,
                    rule_errors: list[RuleError] | None = None,
                    memo: ScheduleMemo | None = None) -> list[tvm.transform.Pass]:
    if config.schedule == "none":
        return []
    tuned = []
    if tuning is not None and len(tuning):
        tuned = [ApplyTuningRecords(tuning, config.tvm_target(), log=schedule_log)]
    # Weights are transformed before the tuning log is read: MetaSchedule tunes the kernels
    # that take them (tuning/tasks.py), so records and hand schedules see the same kernel.
    narrowed = [Bf16Activations(schedule_log)] if config.bf16_kernels() else []
    return [*weight_passes(config), *tuned,
            ApplySchedules(config.tvm_target(), log=schedule_log, errors=rule_errors, memo=memo), *narrowed,
            RestoreTileConfig()]


def weight_passes(config: PipelineConfig) -> list[tvm.transform.Pass]:
    """Constant weights put in the form their kernels read, once at build time: Winograd
    convs' transformed weights, matmul weights in column panels; then, with
    ``flush_subnormals``, every float32 constant's subnormal values flushed to zero (each costs
    an FMA assist per use)."""
    target = config.tvm_target()
    flush = [FlushSubnormalConstants()] if config.flush_subnormals else []
    return [PrecomputeWinogradWeights(target), PackMatmulWeights(target), *flush]


def stock_fusion_pipeline() -> tvm.transform.Pass:
    """TVM's own fusion (LegalizeOps, FuseOps, FuseTIR), for kernel-count comparison."""
    return relax.get_pipeline("zero")
