"""Pipeline config: one TOML file per target (shipped ones by name), validated into a dataclass.

Every mistake in a config file is reported with the file, the key and the allowed values,
because a silently ignored typo would compile a different pipeline than the user asked for.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import psutil
import tvm
from tvm.target import codegen

from . import bundled
from .accuracy.bf16_gate import Bf16Tolerance
from .dispatch.buckets import parse_bucket
from .errors import ConfigError, ShapeError
from .frontend.dims import parse_range
from .kernels.cpu_features import has_bf16_kernels
from .patterns import registered_patterns

DEFAULT_CONFIG = bundled.config_dir() / f"{bundled.DEFAULT_CONFIG_NAME}.toml"

TARGET_KINDS = ("llvm", "cuda")
TARGET_KEYS = ("kind", "mcpu", "mtriple", "mattr", "num-cores", "arch", "host")
SCHEDULE_MODES = ("default", "none")
CONV_LAYOUTS = ("NCHW", "NCHWc")
# "bf16": matmul/conv operands in bfloat16, float32 sums; "auto": bf16 per kernel where the gate holds (docs/precision.md)
PRECISIONS = ("float32", "bf16", "auto")
SECTIONS = {
    "target": TARGET_KEYS,
    "pipeline": ("patterns", "enable", "disable", "schedule", "fast_math", "conv_layout", "blocked_depthwise",
                 "winograd", "flush_subnormals", "precision"),
    "verify": ("rtol", "atol", "seed", "bf16_rtol", "bf16_atol", "bf16_min_cosine", "bf16_min_top1"),
    "runtime": ("threads",),
    "inputs": None,  # free-form: dynamic dim name -> size
    "buckets": ("sizes",),
    "tuning": ("trials", "per_task_trials", "trials_per_iter", "time_limit_s", "exclude", "log_dir"),
}


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """``[tuning]``: MetaSchedule budget and where the tuning logs live (absolute paths).

    ``log_dir`` is where ``tune`` writes and what compile reads first; ``shipped_dir`` holds the
    records shipped with tvm_fusion, read for a target that ``log_dir`` has no store for. A
    config that names its own ``log_dir`` reads that alone."""

    trials: int = 200
    per_task_trials: int = 64
    trials_per_iter: int = 16
    time_limit_s: float = 0.0  # 0 = no limit
    exclude: tuple[str, ...] = ()  # kernel-name glob patterns left to the hand schedules
    log_dir: str = dataclasses.field(default_factory=lambda: str(bundled.user_tuning_logs()))
    shipped_dir: str | None = dataclasses.field(default_factory=lambda: str(bundled.shipped_tuning_logs()))

    def read_dirs(self) -> list[str]:
        return [self.log_dir] + ([self.shipped_dir] if self.shipped_dir else [])


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A validated pipeline config; ``target`` is a TVM target JSON dict with host values resolved."""

    name: str
    path: str
    target: dict[str, Any]
    patterns: tuple[str, ...]
    schedule: str = "default"
    fast_math: bool = True
    conv_layout: str = "NCHW"  # "NCHWc": dense convs in the blocked channel layout (CPU)
    blocked_depthwise: bool = True  # with NCHWc: depthwise convs in it too
    winograd: bool = True  # with NCHWc: 3x3 stride-1 convs by Winograd F(4x4 or 2x2, 3x3)
    flush_subnormals: bool = True  # float32 constants' subnormal values set to zero at build time
    precision: str = "float32"  # one of PRECISIONS
    bf16_declined: tuple[str, ...] = ()  # matmul bindings compile's per-kernel bf16 gate keeps float32
    rtol: float = 1e-4
    atol: float = 1e-4
    # The bf16 accuracy gate (accuracy/bf16_gate.py); atol is a fraction of the output's largest |value|.
    bf16_rtol: float = Bf16Tolerance.rtol
    bf16_atol: float = Bf16Tolerance.atol
    bf16_min_cosine: float = Bf16Tolerance.min_cosine
    bf16_min_top1: float = Bf16Tolerance.min_top1
    seed: int = 0
    threads: int = 1
    # dynamic dim name -> a size, or a (low, high, step) range compiled symbolically
    dim_defaults: dict[str, int | tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    # shape buckets (dispatch/buckets.py): exact points of the ranges, each ((dim name, size), ...)
    buckets: tuple[tuple[tuple[str, int], ...], ...] = ()
    tuning: TuningConfig = dataclasses.field(default_factory=TuningConfig)

    def tvm_target(self):
        target = dict(self.target)
        host = target.pop("host", None)
        return tvm.target.Target(target, host=host) if host else tvm.target.Target(target)

    def bf16_tolerance(self) -> Bf16Tolerance:
        return Bf16Tolerance(self.bf16_rtol, self.bf16_atol, self.bf16_min_cosine, self.bf16_min_top1)

    def bf16_kernels(self) -> bool:
        """Whether the pipeline builds bf16 kernels: at ``bf16`` (checked against the target by
        ``check_precision``), and at ``auto`` where the target has them (``has_bf16_kernels``)."""
        return self.precision == "bf16" or (self.precision == "auto" and has_bf16_kernels(self.tvm_target()))


def host_cpu_name() -> str:
    """The LLVM CPU name of this machine: without it LLVM emits generic x86-64 (no AVX-512)."""
    return str(tvm.target.Target.from_device(tvm.cpu()).attrs["mcpu"])


def host_core_count() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def resolve_config_path(path: str | os.PathLike | None) -> Path:
    """A config file by path, or a shipped config by name (``x86_64-avx2``); ``None`` means the
    shipped host config. A file of that name in the current directory wins over a shipped one."""
    if path is None:
        return DEFAULT_CONFIG
    given = Path(path)
    if given.is_file():
        return given
    shipped = bundled.config_path(str(path)) if not given.exists() else None
    if shipped is not None:
        return shipped
    problem = "is a directory, not a file" if given.is_dir() else "does not exist"
    raise ConfigError(f"config file {given} {problem}",
                      f"pass an existing file with --config, or a shipped config by name: "
                      f"{', '.join(bundled.config_names())} (`tvm-fusion configs` lists them)")


@dataclasses.dataclass(frozen=True)
class ShippedConfig:
    name: str
    path: Path
    target: str  # kind and CPU or arch, as the file writes them ("llvm host", "cuda sm_90")
    summary: str  # the file's first comment line


def shipped_configs() -> list[ShippedConfig]:
    """The configs that ship with tvm_fusion, for ``--config NAME``."""
    found = []
    for name in bundled.config_names():
        path = bundled.config_path(name)
        assert path is not None  # a name config_names() listed
        text = path.read_text()
        target = tomllib.loads(text).get("target", {})
        comment = next((line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), "")
        found.append(ShippedConfig(name, path, f"{target.get('kind', 'llvm')} "
                                   f"{target.get('mcpu') or target.get('arch') or 'generic'}", comment))
    return found


def load_config(path: str | os.PathLike | None = None) -> PipelineConfig:
    """Read and validate a config file, or a shipped one by name; ``None`` means the shipped host config."""
    path = resolve_config_path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}", "fix the syntax of the file") from err
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}",
                          "check the file's permissions") from err
    return parse_config(raw, name=path.stem, path=str(path))


def _check_platform_keys(target: dict[str, Any], fail) -> None:
    """The keys tvm_fusion.targets needs to pick a toolchain: a triple it can link, an nvcc arch."""
    triple = target.get("mtriple", "x86_64")
    if not isinstance(triple, str) or not triple.startswith(("x86_64", "aarch64")):
        raise fail("target.mtriple", f"has value {triple!r}", '"x86_64-linux-gnu" or "aarch64-linux-gnu"')
    if target["kind"] == "llvm":
        for key in ("arch", "host"):
            if key in target:
                raise fail(f"target.{key}", "is only for a cuda target", "remove it, or set kind = \"cuda\"")
        return
    if not (isinstance(target["arch"], str) and re.fullmatch(r"sm_\d+a?", target["arch"])):
        raise fail("target.arch", f"has value {target['arch']!r}", 'an nvcc arch like "sm_80" or "sm_90"')
    host = target.get("host", {"kind": "llvm"})
    if not isinstance(host, dict) or host.get("kind") != "llvm":
        raise fail("target.host", f"has value {host!r}", 'a table like {kind = "llvm", mcpu = "x86-64-v3"}')


def llvm_cpu_names(triple: str) -> list[str]:
    """The CPU names LLVM accepts as ``mcpu`` for ``triple`` (what ``-mcpu=help`` would list)."""
    return sorted(set(codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm", "mtriple": triple}))))


def _check_mcpu(key: str, mcpu: Any, triple: str | None, fail) -> None:
    """An unknown CPU name is not an error in LLVM: it warns and emits generic code, silently slow."""
    if mcpu is None:
        return
    triple = triple or str(codegen.llvm_get_system_triple())
    if isinstance(mcpu, str) and codegen.llvm_is_valid_cpu(mcpu, triple):
        return
    close = difflib.get_close_matches(str(mcpu), llvm_cpu_names(triple), n=4, cutoff=0.5)
    raise fail(key, f"names CPU {mcpu!r}, which LLVM does not know for {triple}",
               "an LLVM CPU name" + (f" such as {', '.join(close)}" if close else "") + "; list them all with "
               f"`python -c \"from tvm_fusion.config import llvm_cpu_names; print(*llvm_cpu_names('{triple}'))\"`")


def parse_config(raw: dict[str, Any], name: str, path: str = "<config>") -> PipelineConfig:
    """Validate a parsed TOML document; every error names the file, the key and what is allowed."""
    def fail(key: str, problem: str, allowed: str) -> ConfigError:
        return ConfigError(f"{path}: key '{key}' {problem}", f"allowed: {allowed}")

    for section, value in raw.items():
        if section not in SECTIONS:
            raise fail(section, "is not a known section", ", ".join(SECTIONS))
        if not isinstance(value, dict):
            raise fail(section, "must be a table ([section])", ", ".join(SECTIONS))
        allowed = SECTIONS[section]
        for key in value:
            if allowed is not None and key not in allowed:
                raise fail(f"{section}.{key}", "is not a known key", ", ".join(allowed))

    target = dict(raw.get("target", {"kind": "llvm", "mcpu": "host", "num-cores": "host"}))
    kind = target.get("kind")
    if kind not in TARGET_KINDS:
        raise fail("target.kind", f"has value {kind!r}", ", ".join(TARGET_KINDS))
    if target.get("mcpu") == "host":
        target["mcpu"] = host_cpu_name()
    if target.get("num-cores") == "host":
        target["num-cores"] = host_core_count()
    cores = target.get("num-cores", 1)
    if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
        raise fail("target.num-cores", f"has value {cores!r}", "a positive integer or \"host\"")
    if "mattr" in target and not (isinstance(target["mattr"], list)
                                  and all(isinstance(a, str) for a in target["mattr"])):
        raise fail("target.mattr", f"has value {target['mattr']!r}", 'a list of strings like ["+avx2"]')
    if kind == "cuda" and "arch" not in target:
        raise fail("target.arch", "is missing for a cuda target", 'an arch like "sm_80" or "sm_90"')
    _check_platform_keys(target, fail)
    if kind == "llvm":
        _check_mcpu("target.mcpu", target.get("mcpu"), target.get("mtriple"), fail)
    elif isinstance(target.get("host"), dict):
        _check_mcpu("target.host.mcpu", target["host"].get("mcpu"), target["host"].get("mtriple"), fail)

    pipeline = raw.get("pipeline", {})
    patterns = _parse_patterns(pipeline, registered_patterns(), fail)
    schedule = pipeline.get("schedule", "default")
    if schedule not in SCHEDULE_MODES:
        raise fail("pipeline.schedule", f"has value {schedule!r}", ", ".join(SCHEDULE_MODES))

    fast_math = pipeline.get("fast_math", True)
    if not isinstance(fast_math, bool):
        raise fail("pipeline.fast_math", f"has value {fast_math!r}", "true or false")
    conv_layout = pipeline.get("conv_layout", "NCHW")
    if conv_layout not in CONV_LAYOUTS:
        raise fail("pipeline.conv_layout", f"has value {conv_layout!r}", ", ".join(CONV_LAYOUTS))
    blocked_depthwise = pipeline.get("blocked_depthwise", True)
    if not isinstance(blocked_depthwise, bool):
        raise fail("pipeline.blocked_depthwise", f"has value {blocked_depthwise!r}", "true or false")
    winograd = pipeline.get("winograd", True)
    if not isinstance(winograd, bool):
        raise fail("pipeline.winograd", f"has value {winograd!r}", "true or false")
    flush_subnormals = pipeline.get("flush_subnormals", True)
    if not isinstance(flush_subnormals, bool):
        raise fail("pipeline.flush_subnormals", f"has value {flush_subnormals!r}", "true or false")

    precision = pipeline.get("precision", "float32")
    if precision not in PRECISIONS:
        raise fail("pipeline.precision", f"has value {precision!r}", ", ".join(f'"{p}"' for p in PRECISIONS))
    verify = raw.get("verify", {})
    tolerances = {}
    for key, default in (("rtol", 1e-4), ("atol", 1e-4), ("bf16_rtol", Bf16Tolerance.rtol),
                         ("bf16_atol", Bf16Tolerance.atol)):
        value = verify.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise fail(f"verify.{key}", f"has value {value!r}", "a non-negative number such as 1e-4")
        tolerances[key] = float(value)
    for key, default in (("bf16_min_cosine", Bf16Tolerance.min_cosine), ("bf16_min_top1", Bf16Tolerance.min_top1)):
        value = verify.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise fail(f"verify.{key}", f"has value {value!r}", "a number from 0 to 1")
        tolerances[key] = float(value)
    seed = verify.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail("verify.seed", f"has value {seed!r}", "an integer")

    threads = raw.get("runtime", {}).get("threads", 0)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise fail("runtime.threads", f"has value {threads!r}", "0 (= target num-cores) or a positive integer")

    dims = dict(raw.get("inputs", {}))
    for dim, size in dims.items():
        if isinstance(size, str):
            try:
                dims[dim] = parse_range(size, f"{path}: key 'inputs.{dim}'")
            except ShapeError as err:
                raise ConfigError(err.message, "allowed: a positive integer size, or a range \"LOW..HIGH\" such as "
                                  "\"1..512\" (compiled once for every size in it; \"32..640/32\": its multiples of 32)") from err
        elif isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise fail(f"inputs.{dim}", f"has value {size!r}",
                       "a positive integer size for that dynamic dim, or a range \"LOW..HIGH\"")

    sizes = raw.get("buckets", {}).get("sizes", [])
    if not isinstance(sizes, list) or not all(isinstance(text, str) for text in sizes):
        raise fail("buckets.sizes", f"has value {sizes!r}", 'a list of points like ["sequence=128", "sequence=384"]')
    try:
        buckets = tuple(parse_bucket(text, f"{path}: key 'buckets.sizes'") for text in sizes)
    except ShapeError as err:
        raise ConfigError(err.message, err.hint) from err

    config = PipelineConfig(
        name=name, path=path, target=target, patterns=tuple(patterns), schedule=schedule, fast_math=fast_math,
        conv_layout=conv_layout, blocked_depthwise=blocked_depthwise, winograd=winograd,
        flush_subnormals=flush_subnormals, precision=precision, bf16_declined=(), **tolerances, seed=seed,
        threads=threads or cores, dim_defaults=dims, buckets=buckets,
        tuning=_parse_tuning(raw.get("tuning", {}), path, fail))
    check_precision(config, f"{path}: key 'pipeline.precision'")
    return config


def with_precision(config: PipelineConfig, precision: str | None) -> PipelineConfig:
    """``config`` at ``precision`` (``--precision``; None: as the config says), checked against its target."""
    if precision is None or precision == config.precision:
        return config
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r} is not a precision", f"allowed: {', '.join(PRECISIONS)}")
    check_precision(changed := dataclasses.replace(config, precision=precision), "--precision")
    return changed


def check_precision(config: PipelineConfig, source: str) -> None:
    """bf16 on a target that cannot run bf16 kernels is refused, never built in float32 under a
    bf16 label; ``auto`` there is float32 (``bf16_kernels``)."""
    if config.precision != "bf16":
        return
    target = config.tvm_target()
    if target.kind.name != "llvm":
        raise ConfigError(f"{source}: precision bf16 is for CPU targets; target {config.name} is {target.kind.name}",
                          'use precision "float32" (or "auto") for a GPU target')
    if not has_bf16_kernels(target):
        raise ConfigError(f"{source}: precision bf16 needs AVX512_BF16 (avx512bf16) or AMX-BF16 (amx-bf16), which "
                          f"target {config.name} (mcpu {config.target.get('mcpu') or 'generic'}) lacks",
                          'use precision "float32" or "auto", or a CPU with bf16 dot products (mcpu "znver4", '
                          '"sapphirerapids", "emeraldrapids"); see docs/precision.md')


def _parse_patterns(pipeline: dict[str, Any], known: list[str], fail) -> list[str]:
    """``patterns = "default"`` (or no key): every registered pattern in the registry's order,
    so a new pattern is on in every config; ``enable``/``disable`` adjust that list. An explicit
    list is taken as written (its order is the order they are tried in)."""
    patterns = pipeline.get("patterns", "default")
    if patterns == "default":
        patterns = list(known)
    elif not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise fail("pipeline.patterns", f"has value {patterns!r}", '"default" or a list of pattern names')
    for key in ("enable", "disable"):
        names = pipeline.get(key, [])
        if not isinstance(names, list) or not all(isinstance(p, str) for p in names):
            raise fail(f"pipeline.{key}", f"has value {names!r}", "a list of pattern names")
        for name in names:
            if name not in known:
                raise fail(f"pipeline.{key}", f"names unknown pattern {name!r}", ", ".join(known))
    disabled = set(pipeline.get("disable", []))
    both = disabled & set(pipeline.get("enable", []))
    if both:
        raise fail("pipeline.enable", f"and pipeline.disable both name {sorted(both)}", "each pattern in one of them")
    enabled = [name for name in known if name in pipeline.get("enable", []) and name not in patterns]
    patterns = [name for name in patterns + enabled if name not in disabled]
    for pattern in patterns:
        if pattern not in known:
            raise fail("pipeline.patterns", f"names unknown pattern {pattern!r}", ", ".join(known))
    if len(set(patterns)) != len(patterns):
        raise fail("pipeline.patterns", "lists a pattern twice", "each pattern at most once")
    return patterns


def _parse_tuning(section: dict[str, Any], path: str, fail) -> TuningConfig:
    """``log_dir`` is relative to the config file's folder, so a config finds its logs from any cwd."""
    counts: dict[str, Any] = {}
    for key in ("trials", "per_task_trials", "trials_per_iter"):
        value = section.get(key, getattr(TuningConfig, key))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(f"tuning.{key}", f"has value {value!r}", "a positive integer")
        counts[key] = value
    limit = section.get("time_limit_s", 0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit < 0:
        raise fail("tuning.time_limit_s", f"has value {limit!r}", "seconds as a non-negative number (0 = no limit)")
    exclude = section.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(p, str) and p for p in exclude):
        raise fail("tuning.exclude", f"has value {exclude!r}", 'a list of kernel-name patterns like ["*transpose*"]')
    settings = TuningConfig(**counts, time_limit_s=float(limit), exclude=tuple(exclude))
    if "log_dir" not in section:
        return settings
    log_dir = section["log_dir"]
    if not isinstance(log_dir, str) or not log_dir:
        raise fail("tuning.log_dir", f"has value {log_dir!r}", "a directory path (relative to the config file)")
    base = Path(path).parent if path != "<config>" else Path.cwd()
    return dataclasses.replace(settings, log_dir=str((base / log_dir).expanduser().resolve()), shipped_dir=None)
