"""Subnormal float32 weights in the zoo's models, and what flushing them to zero saves.

Per model: how many subnormal values its constants hold once our pipeline has folded and
transformed them (``flush_subnormals = false``), then, where there are any, the whole model
built both ways (flushed, the default, and kept) and timed in interleaved rounds in one
process on the profile's seeded inputs, at the config's thread count; medians, and the largest
difference between the two builds' outputs. Writes benchmarks/results/subnormals.json
(atomically). Models come from the zoo cache (scripts/fetch_zoo.py).

    .venv/bin/python benchmarks/bench_subnormals.py [--only ppocrv4-rec ...] [--rounds 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from tvm_fusion import api
from tvm_fusion.commands import zoo
from tvm_fusion.config import load_config
from tvm_fusion.frontend.sample_inputs import random_inputs
from tvm_fusion.passes.flush_subnormal_constants import subnormal_count
from tvm_fusion.report import table, write_json
from tvm_fusion.runtime import set_threads

ROOT = Path(__file__).resolve().parent.parent


def measure(name: str, rounds: int) -> dict:
    import tvm
    from tvm import relax

    model = zoo.load_manifest()[name]
    config = model.config() or load_config()
    set_threads(config.threads)
    prepared = api.prepare(zoo.model_path(name), config, list(model.input_shapes))
    built = {}
    for label, flush in (("kept", False), ("flushed", True)):
        # The flag acts in the schedule phase only: one import serves both builds.
        variant = dataclasses.replace(prepared, config=dataclasses.replace(config, flush_subnormals=flush))
        optimized = api.optimize(variant, tuning_log=False)
        if label == "kept":
            subnormals = subnormal_count(optimized.module)
            if subnormals == 0:
                return {"model": name, "subnormals": 0}
        built[label] = relax.VirtualMachine(api.build(optimized.module, variant.config), tvm.cpu())["main"]
    inputs = random_inputs(prepared.onnx_model, prepared.inputs, config.seed)
    args = [tvm.runtime.tensor(np.require(value, requirements="C")) for value in inputs.values()]
    outputs = {label: _arrays(run(*args)) for label, run in built.items()}
    seconds: dict[str, list[float]] = {label: [] for label in built}
    for _ in range(rounds):
        for label, run in built.items():
            start = time.perf_counter()
            run(*args)
            seconds[label].append(time.perf_counter() - start)
    kept, flushed = (float(np.median(seconds[label])) * 1e3 for label in ("kept", "flushed"))
    return {"model": name, "subnormals": subnormals, "kept_ms": kept, "flushed_ms": flushed,
            "ratio": flushed / kept, "rounds": rounds, "threads": config.threads,
            "max_abs_difference": max(float(np.max(np.abs(a - b))) for a, b in
                                      zip(outputs["kept"], outputs["flushed"], strict=True))}


def _arrays(result) -> list[np.ndarray]:
    return [result.numpy()] if hasattr(result, "numpy") else [item.numpy() for item in result]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="zoo models (default: every cached one)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "subnormals.json"))
    args = parser.parse_args()
    names = args.only or [name for name in zoo.load_manifest() if zoo.model_path(name).exists()]
    results = []
    for name in names:
        print(f"{name} ...", flush=True)
        results.append(measure(name, args.rounds))
    rows = [[r["model"], r["subnormals"], *(f"{r[key]:.3f}" if key in r else "-" for key in
                                            ("kept_ms", "flushed_ms", "ratio")),
             f"{r['max_abs_difference']:.1e}" if "max_abs_difference" in r else "-"] for r in results]
    print(table(["model", "subnormal weights", "kept ms", "flushed ms", "flushed / kept", "max |kept - flushed|"],
                rows, "lrrrrr"))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
