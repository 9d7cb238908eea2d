"""What an artifact's metadata.json says about the model, the build and the tuning log, and
what ``CompiledModel`` needs to run a module built in this process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
import onnxruntime
import tvm
import tvm_ffi
from tvm import s_tir

from . import __version__
from .build import kernel_calls
from .config import PipelineConfig, TuningConfig, load_config
from .files import sha256_of
from .frontend import onnx as onnx_frontend
from .frontend.bf16_matmul import KERNEL_NAME as BF16_KERNEL
from .frontend.dims import ranges_of
from .patterns import PatternReport
from .preparation import PreparedModel
from .schedules.cpu.int8_sum import is_int8_sum
from .tuning.store_contents import target_key


def artifact_metadata(prepared: PreparedModel, cfg: PipelineConfig, module, platform, toolchain: dict,
                      report: PatternReport, records, gate, schedule_rules: dict[str, str]) -> dict:
    """metadata.json before the artifact is run: ``verification`` is filled in by the run, and
    ``outputs`` gets concrete shapes there for a static model.

    ``module`` is the scheduled module that is built, ``platform`` the target's
    ``targets.Platform``, ``records`` the tuning records (or None), ``gate`` the fusion gate's
    result (or None when it did not run), ``schedule_rules`` the rule (or tuning record) that
    scheduled each kernel.
    """
    bf16 = bf16_kernels(module) if cfg.bf16_kernels() else []
    return {
        "model": prepared.name,
        "model_sha256": model_sha256(prepared),
        "inputs": input_metadata(prepared),
        "dims": {name: r.to_json() for name, r in ranges_of(prepared.inputs).items()},
        "outputs": declared_outputs(module, prepared.output_names),
        "target": cfg.target,
        "config": cfg.name,
        "platform": platform.to_json(),
        "toolchain": toolchain,
        "pipeline": list(cfg.patterns),
        "schedule": cfg.schedule,
        # What the kernels compute in (``auto`` resolved; bf16 only where a kernel is): built_from's
        # config says what was asked.
        "precision": "bf16" if bf16 else "float32",
        **({"bf16_kernels": bf16} if cfg.bf16_kernels() else {}),
        "fusions": {name: count for name, count in sorted(report.fired.items())},
        "fusion_variants": {name: count for name, count in sorted(report.variants.items())},
        "kernels": kernel_calls(module),
        "schedule_rules": dict(sorted(schedule_rules.items())),
        "threads": cfg.threads,
        "versions": {"tvm": tvm.__version__, "tvm_fusion": __version__},
        "verification": None,
        "tuning": tuning_metadata(records),
        "fusion_gate": gate.to_json() if gate is not None else None,
        "built_from": built_from(prepared, cfg, records),
    }


def bf16_kernels(module) -> list[str]:
    """The kernels that sum bf16 products (``frontend/bf16_matmul.py``'s block, or its tiles)."""
    return _kernels_holding(module, lambda block: block.name_hint.startswith(BF16_KERNEL))


def int8_kernels(module) -> list[str]:
    """The kernels of ``module`` (before schedules) that hold a uint8 x int8 -> int32 sum
    (``frontend/integer_matmul.py``'s block, a quantized matmul's or ``int8_conv.py``'s conv's):
    ``profile`` counts their integer operations and sets them against the int8 roof."""
    return _kernels_holding(module, is_int8_sum)


def _kernels_holding(module, holds) -> list[str]:
    """The names of the PrimFuncs with a block that ``holds`` is true of, sorted."""
    found = []
    for gvar, func in module.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            blocks: list = []
            tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, blocks.append)])
            if any(holds(block) for block in blocks):
                found.append(gvar.name_hint)
    return sorted(found)


def versions() -> dict[str, str]:
    """``--version``: what a bug report needs, the target key of this machine's host config included."""
    import onnxslim  # deferred: ~0.3 s to import (frontend/onnx.py's _slim), read here for its version

    return {"tvm_fusion": __version__, "tvm": tvm.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "onnxslim": onnxslim.__version__,
            "target key (x86_64-host here)": target_key(load_config(None).tvm_target())}


def model_sha256(prepared: PreparedModel) -> str:
    """The model file's sha256 (as ``sha256sum`` prints it): what ``profile ARTIFACT`` checks the
    file against. Not the loaded model's: preparing it rewrites a few fields in place."""
    return sha256_of(prepared.path)


def built_from(prepared: PreparedModel, cfg: PipelineConfig, records) -> dict:
    """What the artifact's kernels were built from, for ``profile ARTIFACT`` to build them again:
    the model file, the config as loaded (every field) and the tuning-log root (None: none)."""
    return {"model_path": str(prepared.path),
            "config": dataclasses.asdict(cfg),
            "tuning_log": str(Path(records.directory).resolve().parent) if records is not None else None}


def config_from_json(saved: dict) -> PipelineConfig:
    """The PipelineConfig ``built_from`` saved (JSON lists back to tuples)."""
    known = {field.name for field in dataclasses.fields(PipelineConfig)}
    values = {key: value for key, value in saved.items() if key in known}
    values["patterns"] = tuple(values["patterns"])
    values["bf16_declined"] = tuple(values.get("bf16_declined", ()))
    values["dim_defaults"] = {name: tuple(size) if isinstance(size, list) else size
                              for name, size in values.get("dim_defaults", {}).items()}
    values["buckets"] = tuple(tuple(tuple(dim) for dim in bucket) for bucket in values.get("buckets", ()))
    tuning = {key: value for key, value in values.get("tuning", {}).items()
              if key in {field.name for field in dataclasses.fields(TuningConfig)}}
    values["tuning"] = TuningConfig(**{**tuning, "exclude": tuple(tuning.get("exclude", ()))})
    return PipelineConfig(**values)


def tuning_metadata(records) -> dict | None:
    """metadata.json's ``tuning``: which log was used and the kernels its records scheduled."""
    if records is None:
        return None
    return {"log": str(records.directory), "target_key": records.target_key,
            "tuned_kernels": sorted(records.applied),
            "hand_schedule_measured_fastest": sorted(records.hand_best),
            "details": {name: dataclasses.asdict(k) for name, k in sorted(records.applied.items())}}


def input_metadata(prepared: PreparedModel) -> list[dict]:
    """Names, shapes, dtypes; for an input that indexes a table (token ids), the valid range,
    which ``CompiledModel.prepare`` checks: TVM's gather does not, and reads out of bounds."""
    tables = onnx_frontend.index_tables(prepared.onnx_model)
    specs = []
    for spec in prepared.inputs:
        entry = spec.to_json()
        if spec.name in tables and spec.dtype not in (*onnx_frontend.FLOAT_DTYPES, "bool"):
            table, rows = tables[spec.name]
            entry.update(index_range=[-rows, rows - 1], index_table=table)  # ONNX Gather: negatives from the end
        specs.append(entry)
    return specs


def declared_outputs(module, names: list[str]) -> list[dict]:
    """Output names, shapes and dtypes from ``main``'s return type: a symbolic dim as its
    expression over the input ranges (``"sequence"``, ``"(height - 1) // 32 + 1"``)."""
    returned = module["main"].ret_ty
    fields = list(returned.fields) if hasattr(returned, "fields") else [returned]
    specs = []
    for name, field in zip(names, fields):
        try:
            shape = [int(dim) if hasattr(dim, "value") else str(dim) for dim in field.shape.values]
        except (AttributeError, TypeError, ValueError):  # data-dependent: known only from a run
            shape = None
        specs.append({"name": name, "shape": shape, "dtype": str(field.dtype)})
    return specs


def bench_metadata(prepared: PreparedModel) -> dict:
    """The metadata ``CompiledModel`` needs to run a module built in this process (no artifact):
    inputs, ranges, output names, threads."""
    return {"inputs": [s.to_json() for s in prepared.inputs],
            "dims": {name: r.to_json() for name, r in ranges_of(prepared.inputs).items()},
            "outputs": [{"name": n} for n in prepared.output_names],
            "threads": prepared.config.threads}
