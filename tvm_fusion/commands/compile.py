"""Compile a model for one or more targets: the session imports and fuses once, then per target
it lowers and schedules; here each target is built, exported, and its exported library checked
against ONNX Runtime at each size before it is committed."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from ..accuracy.bf16_gate import (Bf16GateFailure, check_bf16, classifier_outputs, compare_bf16,
                                   judge_bf16_conditioning, spread_summary)
from ..dispatch.buckets import parse_bucket
from ..build import build, kernel_calls
from ..config import PipelineConfig, with_precision
from ..errors import ArtifactError, ConfigError, TvmFusionError, VerificationError
from ..export import artifact_dir, write_artifact
from ..files import check_writable
from ..frontend.dims import ranges_of, size_points
from ..metadata import artifact_metadata
from ..native_log import captured_native_stderr, summarize
from ..patterns import PatternReport
from ..preparation import PreparedModel, Progress, ShapeArg, quiet, resolve_config
from ..runtime import METADATA_NAME
from ..session import ModelSession
from ..targets import ToolchainError, check_toolchain, execution_here, export_options, platform_of, unscheduled_gpu_kernels
from ..verify import (SPREAD_MULTIPLE, OutputComparison, ReferenceUnavailable, check_outputs, compare_outputs,
                      ill_conditioned, judge_conditioning)
from .bf16_kernels import Bf16KernelGate, emulated_declines, judge_bf16_kernels
from .generic_kernels import generic_kernels
from .int8_precision import Int8Model, accuracy_against_float, format_accuracy, quantize_for_int8
from .library_run import cuda_source_modules, run_library
from .references import References, branch_inputs


@dataclasses.dataclass
class CompileResult:
    artifact: Path | None
    metadata: dict
    report: PatternReport
    comparisons: list[OutputComparison]


def compile_model(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
                  output_dir: str | Path = "build", verify: bool = True,
                  progress: Progress = quiet, tuning_log: str | Path | bool | None = None,
                  fusion_gate: bool = True, buckets: list[str] | None = None,
                  precision: str | None = None, calibration: str | Path | None = None) -> CompileResult:
    """Compile an ONNX model into ``<output_dir>/<model>.<target>/``, verified against ONNX Runtime.

    With ``verify`` a mismatch raises VerificationError and nothing is written. One target of
    ``compile_targets``, whose error (missing toolchain, mismatch) is raised here.
    """
    (result,) = compile_targets(model_path, [config], input_shapes, output_dir, verify, progress,
                                tuning_log=tuning_log, fusion_gate=fusion_gate, buckets=buckets,
                                precision=precision, calibration=calibration)
    if result.error is not None:
        raise result.error
    return result


@dataclasses.dataclass
class TargetResult(CompileResult):
    """One target of ``compile_targets``: its artifact, or the error that stopped it."""

    target: str = ""
    # How the artifact was checked against ONNX Runtime, or why it was not.
    verification: str = ""
    error: TvmFusionError | None = None


def compile_targets(model_path: str | Path, configs: list, input_shapes: ShapeArg = None,
                    output_dir: str | Path = "build", verify: bool = True,
                    progress: Progress = quiet, tuning_log: str | Path | bool | None = None,
                    fusion_gate: bool = True, buckets: list[str] | None = None,
                    precision: str | None = None, calibration: str | Path | None = None) -> list[TargetResult]:
    """Compile one model for several targets (configs) into ``<output_dir>/<model>.<target>/`` each.

    One ``ModelSession`` serves every target: the ONNX import runs once per distinct
    ``[inputs]`` table and the fusion phases once per pattern list and layout; lowering,
    schedules, build and export run per target. A target
    whose toolchain is missing, or whose artifact disagrees with ONNX Runtime, gets its error
    in its result and the other targets still build; a bad model, config or shape raises.
    Each artifact is run (natively or under qemu-user) and compared with ONNX Runtime before
    it is committed; where it cannot run here (CUDA without a GPU), or ONNX Runtime cannot run
    the model (no kernel for an op at its dtype), its result says so. With ``fusion_gate``, each
    fused instance is checked against its unfused nodes first and undone if it differs
    (``fusion_gate.py``; on targets that run here). ``buckets`` (``["sequence=128", ...]``, as
    ``--bucket`` takes them) replaces the configs' ``[buckets] sizes`` (see ``dispatch/buckets.py``).
    ``precision`` (``--precision``) replaces the configs' ``[pipeline] precision``; at bf16 and
    auto each matmul is judged alone first and kept float32 where bf16 breaks the gate
    (``bf16_kernels.py``), then the artifact is judged by the bf16 accuracy gate
    (``accuracy/bf16_gate.py``); at auto a model that still fails it is built float32 instead,
    the metadata saying why. At ``int8`` (``--precision int8``; ``calibration`` a folder of
    samples, else seeded random inputs) ONNX Runtime quantizes the float model to int8 QDQ
    first, and that model is compiled (``int8_precision.py``).
    """
    started = time.perf_counter()
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ArtifactError(f"output directory {output_dir} is an existing file",
                            "pass a directory with -o/--output-dir")
    check_writable(output_dir, "the artifact", "-o/--output-dir")
    int8 = precision == "int8"
    if calibration is not None and not int8:
        raise ConfigError("--calibration is for --precision int8 (its samples calibrate the quantization)",
                          "add --precision int8, or leave --calibration out")
    configs = [with_precision(resolve_config(config), None if int8 else precision) for config in (configs or [None])]
    if buckets is not None:
        points = tuple(parse_bucket(text, "--bucket") for text in buckets)
        configs = [dataclasses.replace(cfg, buckets=points) for cfg in configs]
    names = [cfg.name for cfg in configs]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"two configs are named {name!r}: both would write <model>.{name}/",
                              "give each target's config file its own name")
    quantized = None
    if int8:
        quantized = quantize_for_int8(model_path, configs[0], input_shapes, calibration, output_dir, progress)
        model_path = quantized.path
    session = ModelSession(model_path, input_shapes, progress)
    references = References()
    # The gate checks the fusions with a target whose code runs here; what it undoes is undone
    # for every target. It checks them in float32: it judges fusion, not precision.
    gate_config = next((dataclasses.replace(cfg, precision="float32") for cfg in configs
                        if execution_here(cfg.target).how == "native"), None) if fusion_gate else None
    results = []
    for cfg in configs:
        # With several targets, each line says which one it is about.
        def say(message: str, label: str = f"[{cfg.name}] " if len(configs) > 1 else "") -> None:
            progress(label + message)

        try:
            toolchain = check_toolchain(cfg.name, cfg.target)
            result = _compile_gated(session, references, cfg, toolchain, output_dir, verify, say,
                                    tuning_log=tuning_log, gate_config=gate_config, int8=quantized)
            results.append(result)
        except (ToolchainError, VerificationError, ArtifactError) as err:
            say(f"FAILED: {err.message}")
            results.append(TargetResult(None, {}, PatternReport(), [], target=cfg.name,
                                        verification="not built", error=err))
    progress(f"done in {time.perf_counter() - started:.1f} s")
    return results


# The margins of the gate (its allowances times each) that the emulation picks more float32
# kernels for while the outputs fail it, one rebuild each: a prediction within half the
# allowances leaves room for what the emulation does not model (``accuracy/bf16_emulation.py``).
EMULATION_MARGINS = (0.5, 0.25)


def _compile_gated(session: ModelSession, references: References, cfg: PipelineConfig, toolchain: dict,
                   output_dir, verify: bool, say: Progress, **options) -> TargetResult:
    """One target. At bf16 and auto, the matmuls the per-kernel gate declines stay float32;
    while the outputs still fail the gate, the emulation keeps more float32 and the target is
    rebuilt (``bf16_kernels.py``). Where it cannot pass, bf16 raises and auto builds float32."""
    gate = _kernel_gate(session, references, cfg, verify, options.get("gate_config"), say)
    margins = list(EMULATION_MARGINS) if gate is not None else []
    while True:
        try:
            return _compile_target(session, references, cfg, toolchain, output_dir, verify, say,
                                   kernel_gate=gate, **options)
        except Bf16GateFailure as err:
            failure = err
        prepared = session.prepared(cfg)
        if margins and gate is not None and not ranges_of(prepared.inputs):  # a range has no bf16 matmul
            margin = margins.pop(0)
            more = emulated_declines(session, prepared, cfg, options.get("gate_config"), gate,
                                     references.get(cfg, prepared, True, {}), margin, say)
            if more:
                gate.declined += more
                gate.emulation_margins.append(margin)
                say(f"bf16 gate: rebuilding with {len(gate.declined)} matmul(s) kept float32")
                continue
        if cfg.precision != "auto":
            raise failure
        kept = f" with {len(gate.declined)} matmul(s) kept float32" if gate is not None and gate.declined else ""
        fallback = f"bf16 failed the accuracy gate{kept} ({'; '.join(failure.failures)}): built float32"
        say(f"precision auto: {fallback}")
        return _compile_target(session, references, dataclasses.replace(cfg, precision="float32"), toolchain,
                               output_dir, verify, say, precision_note=fallback, **options)


def _kernel_gate(session: ModelSession, references: References, cfg: PipelineConfig, verify: bool,
                 gate_config: PipelineConfig | None, say: Progress) -> Bf16KernelGate | None:
    """Each bf16 matmul judged alone where the build is bf16 and verified here; else None."""
    if not (cfg.bf16_kernels() and verify and execution_here(cfg.target).how == "native"):
        return None
    prepared = session.prepared(cfg)
    return judge_bf16_kernels(session, prepared, cfg, gate_config, references.get(cfg, prepared, False, {})[0], say)


def _compile_target(session: ModelSession, references: References, cfg: PipelineConfig, toolchain: dict,
                    output_dir, verify: bool, say: Progress, tuning_log: str | Path | bool | None = None,
                    gate_config: PipelineConfig | None = None, precision_note: str | None = None,
                    int8: Int8Model | None = None, kernel_gate: Bf16KernelGate | None = None) -> TargetResult:
    native: list[str] = []
    with captured_native_stderr(native):
        prepared = session.prepared(cfg)
        if kernel_gate is not None:
            cfg = dataclasses.replace(cfg, bf16_declined=tuple(d.matmul for d in kernel_gate.declined))
        scheduled = session.scheduled(cfg, tuning_log, gate_config=gate_config, say=say)
        plat = platform_of(cfg.target)
        if plat.device == "cuda":
            unscheduled = unscheduled_gpu_kernels(scheduled.module)
            if unscheduled:
                raise ArtifactError(f"target {cfg.name}: no GPU schedule for {', '.join(unscheduled)}; "
                                    "they would silently build as host code", "report the model")
        say("building for " + str(cfg.target))
        with cuda_source_modules(plat.device == "cuda"):
            executable = build(scheduled.module, cfg)
    for message in summarize(native):
        say(f"tvm: {message}")
    metadata = artifact_metadata(prepared, cfg, scheduled.dynamic_module, plat, toolchain, scheduled.report,
                                 scheduled.records, scheduled.gate, scheduled.schedule_rules)
    if precision_note:
        metadata["precision_fallback"] = {"requested": "auto", "reason": precision_note}
    if int8 is not None:
        metadata["precision"] = "int8"
        metadata["int8"] = int8.to_json()
    if kernel_gate is not None and (kernel_gate.judged or kernel_gate.unjudged or kernel_gate.declined):
        metadata["bf16_gate_per_kernel"] = kernel_gate.to_json()
    if cfg.bf16_kernels() and not metadata["bf16_kernels"]:
        declined = kernel_gate.declined if kernel_gate else []
        kept = f" ({len(declined)} kept float32 by the per-kernel bf16 gate)" if declined else ""
        say(f"WARNING: precision {cfg.precision}, but no matmul by a constant float32 weight became a bf16 kernel"
            f"{kept}: every kernel computes in float32, and the artifact says precision float32")
    generic = generic_kernels(scheduled, prepared)
    for kernel in generic:
        say(f"WARNING: {kernel.line()}")
    metadata["generic_kernels"] = [dataclasses.asdict(kernel) for kernel in generic]
    for error in scheduled.schedule_rule_errors:
        say(f"WARNING: {error.line()}")
    metadata["schedule_rule_errors"] = [dataclasses.asdict(error) for error in scheduled.schedule_rule_errors]
    if scheduled.buckets:
        metadata["buckets"] = [{"sizes": b.sizes, "kernels": kernel_calls(b.module),
                                "fusion_gate": b.gate.to_json() if b.gate is not None else None}
                               for b in scheduled.buckets]
    device_code: dict = {}
    changes, unreached = branch_inputs(references, cfg, prepared, scheduled.branch_condition) if verify else ([], [])
    for taken in unreached:
        say(f"NOTE: no input value tried makes {scheduled.branch_condition} {taken}: that branch is not verified")
    check = _ArtifactCheck(references, cfg, prepared, metadata, [b.sizes for b in scheduled.buckets], verify,
                           device_code, say, int8, changes)
    target_dir = artifact_dir(output_dir, prepared.name, cfg.name)
    options = export_options(cfg.name, cfg.target, device_code)
    report = scheduled.report
    # The check loads the library, and TVM's loader holds a few copies of its weights for a
    # moment: the scheduled module's and the executable's (the packed weights) go first.
    session.release(scheduled)
    handoff = [executable]
    del scheduled, executable
    say(f"writing {target_dir}")
    with captured_native_stderr([]):  # one "Scope Saving" line per function: noise
        write_artifact(handoff, metadata, target_dir, options, check, export_state=device_code)
    metadata = json.loads((target_dir / METADATA_NAME).read_text())
    return TargetResult(target_dir, metadata, report, check.comparisons, target=cfg.name,
                        verification=check.status())


class _ArtifactCheck:
    """Runs on the exported library in the staging directory (what ships is what is checked):
    its outputs against ONNX Runtime's at each size, and what the metadata says about that."""

    def __init__(self, references: References, cfg: PipelineConfig, prepared: PreparedModel, metadata: dict,
                 buckets: list[dict[str, int]], verify: bool, device_code: dict, say: Progress,
                 int8: Int8Model | None = None, changes: list | None = None):
        self.references, self.cfg, self.prepared, self.metadata = references, cfg, prepared, metadata
        self.int8 = int8
        self.verify, self.device_code, self.say = verify, device_code, say
        self.execution = execution_here(cfg.target)
        # A range is checked at its low end, a typical size and its high end (a kernel's tail
        # handling can be wrong at some sizes only), and at every bucket (its own kernels).
        checked_at = size_points(ranges_of(prepared.inputs))
        sizes = checked_at + [point for point in buckets if point not in checked_at]
        # ... and on inputs changed to take each branch the seeded ones do not (``dispatch/branches.py``).
        self.points: list[tuple[dict, dict]] = [(point, {}) for point in sizes] + [({}, changed) for changed in changes or []]
        self.comparisons: list[OutputComparison] = []
        # With bf16 kernels the artifact is judged against float32 by the bf16 gate (its own tolerances).
        self.bf16 = metadata["precision"] == "bf16"
        self.classifiers = classifier_outputs(prepared.onnx_model) if self.bf16 else {}
        self.no_reference: list[str] = []  # why ONNX Runtime could not give a reference, when it could not

    def __call__(self, library: Path) -> dict:
        cfg, say, execution = self.cfg, self.say, self.execution
        updates: dict = {"device_code": dict(self.device_code)} if self.device_code else {}
        if execution.how is None:
            if self.verify:
                say(f"NOT VERIFIED: the artifact cannot run here: {execution.reason} "
                    "(pass --no-verify to say that is intended)")
                updates["verification"] = {"reference": "onnxruntime", "status": "not run",
                                           "reason": execution.reason}
            return updates
        checked_sizes: list[dict] = []
        checked_branches: list[dict] = []
        for sizes, changed in self.points:
            label = ", ".join([*(f"{name}={size}" for name, size in sizes.items()),
                               *(f"{name}={_shown(value)}" for name, value in changed.items())])
            at = f" {'with' if changed else 'at'} {label}" if label else ""
            compare = self.verify and not self.no_reference
            try:
                inputs, expected = self.references.get(cfg, self.prepared, compare, sizes, changed)
            except ReferenceUnavailable as err:
                say(f"NOT VERIFIED: {err.message}")
                self.no_reference.append(err.message)
                updates["verification"] = {"reference": "onnxruntime", "status": "not run", "reason": err.message}
                inputs, expected = self.references.get(cfg, self.prepared, False, sizes, changed)
            say(f"running the artifact{at} ({'natively' if execution.how == 'native' else 'under qemu-aarch64'})")
            outputs = run_library(library, self.metadata, execution.how, inputs)
            if not sizes and not changed:
                updates["outputs"] = [{"name": name, "shape": list(value.shape), "dtype": str(value.dtype)}
                                      for name, value in outputs.items()]
            if self.int8 is not None:
                accuracy = accuracy_against_float(self.int8, outputs, inputs, cfg.threads)
                say(format_accuracy(accuracy))
                updates["int8_accuracy_against_float"] = accuracy
            if self.verify and not self.no_reference and self.bf16:
                say(f"verifying the bf16 build against ONNX Runtime float32{at}")
                gated = compare_bf16(outputs, expected, cfg.bf16_tolerance(), self.classifiers, cfg.rtol, cfg.atol)
                gated = judge_bf16_conditioning(gated, outputs, expected,
                                                lambda: self.references.variants(cfg, self.prepared, sizes, changed),
                                                cfg.bf16_tolerance())
                for c in ill_conditioned(gated):
                    say(f"ILL-CONDITIONED output {c.name}{at}: {spread_summary(c)}")
                if label:
                    gated = [dataclasses.replace(c, name=f"{c.name} @ {label}") for c in gated]
                self.comparisons.extend(gated)
                check_bf16(gated, cfg.bf16_tolerance(), at)
                (checked_branches if changed else checked_sizes).append(changed or sizes)
            elif self.verify and not self.no_reference:
                say(f"verifying against ONNX Runtime{at}")
                compared = compare_outputs(outputs, expected, cfg.rtol, cfg.atol)
                compared = judge_conditioning(compared, outputs, expected,
                                              lambda: self.references.variants(cfg, self.prepared, sizes, changed),
                                              cfg.rtol, cfg.atol)
                for c in ill_conditioned(compared):
                    if c.reference_spread is not None:
                        say(f"ILL-CONDITIONED output {c.name}{at}: {c.reference_spread.summary()} "
                            f"({SPREAD_MULTIPLE:g}x ONNX Runtime's own)")
                if label:  # one row per output and size or branch: say which
                    compared = [dataclasses.replace(c, name=f"{c.name} @ {label}") for c in compared]
                self.comparisons.extend(compared)
                check_outputs(compared, cfg.rtol, cfg.atol, at)
                (checked_branches if changed else checked_sizes).append(changed or sizes)
        if self.verify and not self.no_reference:
            updates["verification"] = {"reference": "onnxruntime", "rtol": cfg.rtol, "atol": cfg.atol,
                                       "seed": cfg.seed, "outputs": [c.to_json() for c in self.comparisons]}
            if self.bf16:  # rtol/atol above judge the integer outputs only
                updates["verification"]["bf16_gate"] = dataclasses.asdict(cfg.bf16_tolerance())
            if ill_conditioned(self.comparisons):
                updates["verification"]["ill_conditioned"] = {
                    "outputs": [c.name for c in ill_conditioned(self.comparisons)],
                    "rule": f"ONNX Runtime against itself outside the tolerance; ours within "
                            f"{SPREAD_MULTIPLE:g}x its own worst difference, in multiples of atol + rtol * |reference|"}
            if checked_sizes != [{}]:
                updates["verification"]["sizes"] = checked_sizes
            if checked_branches:  # the inputs changed so that another branch of an If ran
                updates["verification"]["branch_inputs"] = [{name: value.tolist() for name, value in changed.items()}
                                                            for changed in checked_branches]
            if execution.how != "native":
                updates["verification"]["ran"] = "qemu-aarch64"
        return updates

    def status(self) -> str:
        """How the artifact was checked against ONNX Runtime, or why it was not."""
        if not self.verify:
            return "skipped (--no-verify)"
        if self.execution.how is None:
            return f"NOT VERIFIED: {self.execution.reason}"
        if self.no_reference:
            return f"NOT VERIFIED: {self.no_reference[0]}"
        shaky = ill_conditioned(self.comparisons)
        if self.bf16:
            return ("bf16 within the accuracy gate against ONNX Runtime float32"
                    + (f"; ILL-CONDITIONED, within {SPREAD_MULTIPLE:g}x ONNX Runtime's own spread: "
                       f"{', '.join(c.name for c in shaky)}" if shaky else ""))
        return ("matches ONNX Runtime" + (" (run under qemu-aarch64)" if self.execution.how == "qemu" else "")
                + (f"; ILL-CONDITIONED, within {SPREAD_MULTIPLE:g}x ONNX Runtime's own spread: "
                   f"{', '.join(c.name for c in shaky)}" if shaky else ""))


def _shown(value) -> str:
    """An input's value as a check's label gives it: the number of a one-element input."""
    return str(value.ravel()[0]) if value.size == 1 else f"[{value.size} values]"
