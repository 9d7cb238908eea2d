"""``tvm-fusion ablate``: what each pattern is worth on one model.

The model is built with every pattern, with each pattern that fired switched off in turn, and
with none; all variants are timed in one process, in interleaved rounds in a new random order
each round (drift in machine load hits them alike), and medians compared. A pattern's worth is
what switching it off adds to the latency, as a share of the latency with every pattern on.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..build import build, kernel_calls
from ..frontend import onnx as onnx_frontend
from ..native_log import captured_native_stderr
from ..preparation import at_one_size
from ..runtime import CompiledModel, set_threads
from ..session import ModelSession

Progress = Callable[[str], None]
ALL, NONE = "all patterns", "no patterns"


@dataclasses.dataclass
class Variant:
    name: str                 # ALL, NONE, or "without <pattern>"
    patterns: list[str]
    kernels: int              # kernel launches per run
    median_ms: float = 0.0

    def worth(self, full_ms: float) -> float:
        """What switching the pattern(s) off adds, in % of the latency with all on."""
        return 100.0 * (self.median_ms - full_ms) / full_ms


@dataclasses.dataclass
class AblationReport:
    model: str
    threads: int
    rounds: int
    variants: list[Variant]
    not_fired: list[str]      # configured patterns that do nothing on this model

    @property
    def full(self) -> Variant:
        return self.variants[0]

    def lines(self) -> list[str]:
        return [f"{v.name.removeprefix('without ')}: {v.worth(self.full.median_ms):.0f} % of the latency on "
                f"this model" for v in self.variants[1:]]

    def to_json(self) -> dict:
        return {"model": self.model, "threads": self.threads, "rounds": self.rounds,
                "not_fired": self.not_fired,
                "variants": [{**dataclasses.asdict(v), "worth_percent": v.worth(self.full.median_ms)}
                             for v in self.variants],
                "summary": self.lines()}


def ablate_model(model_path: str | Path, config=None, input_shapes=None, rounds: int = 30, warmup: int = 3,
                 progress: Progress = lambda _m: None) -> AblationReport:
    session = ModelSession(model_path, input_shapes, progress)
    with captured_native_stderr([]):
        prepared = session.prepared(config)
        at_one_size(prepared, "ablate")
        cfg = prepared.config
        set_threads(cfg.threads)
        full = session.scheduled(cfg, tuning_log=False)
        fired = [name for name in cfg.patterns if full.report.fired.get(name)]
        specs = [(ALL, list(cfg.patterns))]
        specs += [(f"without {name}", [p for p in cfg.patterns if p != name]) for name in fired]
        specs.append((NONE, []))
        variants, runners = [], {}
        metadata = {"inputs": [s.to_json() for s in prepared.inputs],
                    "outputs": [{"name": n} for n in prepared.output_names], "threads": cfg.threads}
        for name, patterns in specs:
            progress(f"building: {name}")
            variant_cfg = dataclasses.replace(cfg, patterns=tuple(patterns))
            module = session.scheduled(variant_cfg, tuning_log=False).module
            variants.append(Variant(name, patterns, kernel_calls(module)))
            runners[name] = CompiledModel(build(module, cfg), metadata)
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, prepared.inputs, cfg.seed)
    tensors = {name: model.prepare(inputs) for name, model in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    order, shuffler = list(runners), random.Random(cfg.seed)
    progress(f"timing {len(runners)} variants, {rounds} interleaved rounds")
    for round_index in range(warmup + rounds):
        shuffler.shuffle(order)
        for name in order:
            start = time.perf_counter()
            runners[name].run_prepared(tensors[name])
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    for variant in variants:
        variant.median_ms = float(np.median(times[variant.name])) * 1e3
    return AblationReport(prepared.name, cfg.threads, rounds, variants,
                          [name for name in cfg.patterns if name not in fired])
