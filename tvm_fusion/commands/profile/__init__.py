"""``tvm-fusion profile``: where a model's time goes, kernel by kernel, against this machine's roofs.

The model is compiled as ``compile`` does, by the session whose import names bindings after
ONNX nodes (``build``), so each kernel lists the nodes it covers; given an artifact directory
instead of a model, the artifact's own kernels (``artifact``). Each kernel is timed alone and in
the model, the model end to end and with empty kernels (``timing``); its FLOPs and bytes
(``costs``) place it against the machine's roofs (``machine_peak``): a kernel that sums bf16
products against the AMX-BF16 peak (AVX512_BF16's without AMX-BF16), one that sums uint8 x int8 products against the AMX-INT8
peak (AVX512-VNNI's without AMX-INT8), its integer operations counted in place of FLOPs, any
other against the float32 FMA peak. The gap between
the sum of kernel times and the end-to-end time is split into its parts (``report.Gap``);
``mine`` ranks the unfused kernel chains worth a pattern (``mining``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import tvm

from ...frontend import onnx as onnx_frontend
from ...metadata import bf16_kernels, int8_kernels
from ...machine_peak import MachinePeak, machine_peak
from ...native_log import captured_native_stderr
from ...config import with_precision
from ...preparation import at_one_size, resolve_config
from ...runtime import set_threads
from ...session import ModelSession
from .artifact import check_same_kernels, is_artifact, read_artifact
from .build import ProfiledModule, build_profiled
from ...kernels.costs import kernel_costs, kernel_kind, param_bytes
from .mining import kernel_graph, mine_chains
from .report import Gap, KernelProfile, ProfileReport
from .timing import Timings, empty_kernels, time_model

Progress = Callable[[str], None]


def profile_model(model_path: str | Path, config=None, input_shapes=None, rounds: int = 30,
                  mine: bool = False, progress: Progress = lambda _m: None,
                  tuning_log=None, precision: str | None = None) -> ProfileReport:
    """Per-kernel times, costs and roofline position, the end-to-end gap, and (``mine``) the
    unfused kernel chains worth a pattern.

    ``model_path`` is an ONNX file, or an artifact directory written by ``compile``: then its
    model, config, input shapes and tuning log are the ones it was built from (passing any of
    them is an error), and its own library is what is timed. ``precision`` (``--precision``)
    replaces the config's.
    """
    artifact = None
    with captured_native_stderr([]):
        if is_artifact(model_path):
            artifact = read_artifact(model_path, config, input_shapes, tuning_log, precision=precision)
            progress(f"profiling {artifact.directory}, built from {artifact.model_path}")
            model_path, config, input_shapes = artifact.model_path, artifact.config, artifact.input_shapes
            tuning_log = artifact.tuning_log
        session = ModelSession(model_path, input_shapes, progress)
        prepared = session.prepared(with_precision(resolve_config(config), precision))
        at_one_size(prepared, "profile")
        cfg = prepared.config
        set_threads(cfg.threads)
        profiled = build_profiled(session, cfg, tuning_log, artifact.excluded if artifact else frozenset())
        target = cfg.tvm_target()
        if artifact:
            progress("building the empty-kernel twin (the artifact's library is what is timed)")
            executable = artifact.library
        else:
            progress("building the model and its empty-kernel twin")
            executable = tvm.compile(profiled.module, target=target)
        empty_executable = tvm.compile(empty_kernels(profiled.module), target=target)
        progress("probing this machine's peaks (cached per machine class)")
        peak = machine_peak(cfg)
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, prepared.inputs, cfg.seed)
    args = [tvm.runtime.tensor(np.require(value, requirements="C")) for value in inputs.values()]
    funcs = {gv.name_hint: f for gv, f in profiled.lowered.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc)}
    if artifact:
        check_same_kernels(artifact, profiled.module, profiled.tuned, set(funcs), args)
    progress(f"timing {len(funcs)} kernels and the whole model, {rounds} interleaved rounds")
    timings = time_model(executable, empty_executable, set(funcs), args, rounds=rounds)
    kinds = roof_kinds(profiled.lowered)
    as_run = {gv.name_hint: f for gv, f in profiled.module.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    kernels = [kernel_profile(name, funcs[name], profiled, timings, peak, kinds.get(name, "float32"), as_run.get(name))
               for name in timings.calls]
    total = sum(k.total_us for k in kernels) or 1.0
    for kernel in kernels:
        kernel.share = kernel.total_us / total
    kernels.sort(key=lambda k: -k.total_us)
    gap = Gap(timings.end_to_end_ms, total / 1e3,
              sum(timings.in_model_us.get(k.name, 0.0) * k.calls for k in kernels) / 1e3,
              timings.dispatch_ms, timings.builtin_calls)
    chains = None
    if mine:
        per_launch_us = timings.dispatch_ms * 1e3 / max(1, sum(timings.calls.values()))
        chains = mine_chains(kernel_graph(profiled.lowered), {k.name: k for k in kernels},
                             peak.gbytes_per_s, per_launch_us)
    return ProfileReport(prepared.name, cfg.threads, peak, kernels, gap, chains,
                         str(artifact.directory) if artifact else None, timings.end_to_end)


def roof_kinds(lowered) -> dict[str, str]:
    """The kernels of ``lowered`` (before schedules) set against a roof other than the float32
    FMA one, by kind (``machine_peak.ROOF_KINDS``): ``"int8"`` for one that holds an int8 sum
    (``int8_kernels``), ``"bf16"`` for one that sums bf16 products (``bf16_kernels``)."""
    return {**{name: "bf16" for name in bf16_kernels(lowered)}, **{name: "int8" for name in int8_kernels(lowered)}}


def kernel_profile(name, func, profiled: ProfiledModule, timings: Timings, peak: MachinePeak,
                   kind: str, as_run: tvm.tirx.PrimFunc | None = None) -> KernelProfile:
    """Kernel ``name`` (``func`` before schedules) placed on the roofline by its timings;
    ``kind``: the roof it is set against (``roof_kinds``). An int8 kernel's integer operations
    count in its ``flops``: its products are the work, though none of them is a FLOP. Its bytes
    are those of ``as_run`` (the kernel as scheduled) where given: a map between bf16 kernels is
    2 bytes a value there (``passes/bf16_activations.py``)."""
    flops, nbytes = kernel_costs(func, integers=kind == "int8")
    if as_run is not None:
        nbytes = param_bytes(as_run)
    us = timings.alone_us.get(name, 0.0)
    seconds = us / 1e6 or float("inf")
    gflops, gbps = flops / seconds / 1e9, nbytes / seconds / 1e9
    intensity = flops / nbytes if nbytes else 0.0
    roof, roof_gflops, bound, achieved = roof_position(peak, kind, flops, intensity, gflops, gbps)
    pattern = profiled.patterns.get(name, "single op")
    return KernelProfile(name, pattern, profiled.schedule_rules.get(name, "-"), kernel_kind(name, func, pattern),
                         timings.calls[name], us, timings.in_model_us.get(name, 0.0), 0.0, flops, nbytes,
                         gflops, gbps, intensity, bound, 100.0 * achieved, profiled.covers.get(name, []),
                         roof, roof_gflops, kind)


def roof_position(peak: MachinePeak, kind: str, flops: int, intensity: float, gflops: float,
                  gbps: float) -> tuple[str, float, str, float]:
    """(compute roof's name, its GFLOP/s (int8: GOP/s), bound, achieved share of the lower
    roof): a ``kind`` ``"bf16"`` kernel under the AMX-BF16 (or AVX512_BF16) roof, an ``"int8"`` one under the
    AMX-INT8 roof (its bound then says so: ``AMX-INT8 compute``), a ``"float32"`` one under the
    FMA roof (``MachinePeak.compute_roof``); each meets the DRAM roof at its own ridge."""
    roof, roof_gflops = peak.compute_roof(kind)
    bound = "compute" if intensity >= roof_gflops / peak.gbytes_per_s else "memory"
    # A kernel without arithmetic (data movement) is measured against the bandwidth roof only.
    achieved = gflops / min(roof_gflops, intensity * peak.gbytes_per_s) if flops else gbps / peak.gbytes_per_s
    return roof, roof_gflops, bound if roof == "FMA" else f"{roof} {bound}", achieved
