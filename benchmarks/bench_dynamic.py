"""One artifact for a range of sizes against one static artifact per size, and ONNX Runtime.

For each model a dynamic module is built once for its range; at each size a static module is
built for exactly that size. At each size the three run interleaved round by round (a new
random order each round) in one process, on the same inputs, untuned (hand schedules), at the
config's thread count. Reported: medians, dynamic/static and dynamic/ONNX Runtime, and the
dynamic module's max abs error against ONNX Runtime. Raw numbers go to
benchmarks/results/dynamic.json (atomically).

    .venv/bin/python benchmarks/bench_dynamic.py [--repeat 30] [--only bert_tiny] [--config ...]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

from tvm_fusion import api
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.metadata import bench_metadata
from tvm_fusion.native_log import captured_native_stderr
from tvm_fusion.report import table, write_json
from tvm_fusion.runtime import CompiledModel, set_threads
from tvm_fusion.verify import onnxruntime_feeds, onnxruntime_session, run_onnxruntime

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models"
# model, the range flag, and the sizes to time ({dim name: size} per point)
CASES = [
    ("bert_tiny", "input_ids:1x1..512", [{"sequence": s} for s in (8, 32, 128, 384)]),
    ("gpt2_tiny", "input_ids:1x1..512", [{"sequence": s} for s in (8, 32, 128, 384)]),
    ("resnet_tiny", "input:1x3x32..512x32..512",
     [{"height": h, "width": w} for h, w in ((64, 64), (224, 224), (48, 320))]),
    ("mobilenetv3_tiny", "input:1x3x32..512x32..512",
     [{"height": h, "width": w} for h, w in ((64, 64), (224, 224), (48, 320))]),
]


def static_flag(flag: str, sizes: dict[str, int], prepared) -> list[str]:
    """The range flag(s) of ``prepared`` with every range at its size in ``sizes``."""
    return [f"{s.name}:{'x'.join(map(str, s.shape))}" for s in onnx_frontend.inputs_at(prepared.inputs, sizes)]


def built(prepared) -> CompiledModel:
    with captured_native_stderr([]):
        module = api.optimize(prepared, tuning_log=False).module
        return CompiledModel(api.build(module, prepared.config), bench_metadata(prepared))


def time_interleaved(runners: dict, repeat: int, seed: int, warmup: int = 3) -> dict[str, float]:
    times = {name: [] for name in runners}
    order, shuffler = list(runners), random.Random(seed)
    for round_index in range(warmup + repeat):
        shuffler.shuffle(order)
        for name in order:
            start = time.perf_counter()
            runners[name]()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(values)) * 1e3 for name, values in times.items()}


def bench_case(name: str, flag: str, points: list[dict], config, repeat: int) -> list[dict]:
    path = MODELS / f"{name}.onnx"
    dynamic_prepared = api.prepare(path, config, [flag])
    cfg = dynamic_prepared.config
    set_threads(cfg.threads)
    start = time.perf_counter()
    dynamic = built(dynamic_prepared)
    print(f"{name}: dynamic module for {flag} built in {time.perf_counter() - start:.1f} s", flush=True)
    session = onnxruntime_session(dynamic_prepared.onnx_model, cfg.threads)
    rows = []
    for sizes in points:
        static_prepared = api.prepare(path, config, static_flag(flag, sizes, dynamic_prepared))
        static = built(static_prepared)
        inputs = onnx_frontend.random_inputs(dynamic_prepared.onnx_model, static_prepared.inputs, cfg.seed)
        feeds = onnxruntime_feeds(inputs)
        reference = run_onnxruntime(session, feeds)
        produced = dynamic.run(inputs)
        error = max(float(np.abs(produced[k].astype(np.float64) - reference[k].astype(np.float64)).max())
                    for k in reference)
        dynamic_tensors, static_tensors = dynamic.prepare(inputs), static.prepare(inputs)
        medians = time_interleaved({
            "onnxruntime": lambda: run_onnxruntime(session, feeds),
            "static": lambda: static.run_prepared(static_tensors),
            "dynamic": lambda: dynamic.run_prepared(dynamic_tensors),
        }, repeat, cfg.seed)
        row = {"model": name, "range": flag, "sizes": sizes, "medians_ms": medians,
               "dynamic_over_static": medians["dynamic"] / medians["static"],
               "dynamic_over_onnxruntime": medians["dynamic"] / medians["onnxruntime"],
               "max_abs_error": error, "threads": cfg.threads, "repeat": repeat}
        print(f"  {sizes}: ORT {medians['onnxruntime']:.3f} ms, static {medians['static']:.3f} ms, "
              f"dynamic {medians['dynamic']:.3f} ms ({row['dynamic_over_static']:.2f}x static)", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--only", action="append", help="model name (repeatable)")
    parser.add_argument("--config", default=None)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "dynamic.json"))
    args = parser.parse_args()
    results = []
    for name, flag, points in CASES:
        if args.only and name not in args.only:
            continue
        results += bench_case(name, flag, points, args.config, args.repeat)
    print(table(["model", "sizes", "ORT ms", "static ms", "dynamic ms", "dyn/static", "dyn/ORT", "max err"],
                [[r["model"], ",".join(f"{k}={v}" for k, v in r["sizes"].items()),
                  round(r["medians_ms"]["onnxruntime"], 3), round(r["medians_ms"]["static"], 3),
                  round(r["medians_ms"]["dynamic"], 3), round(r["dynamic_over_static"], 2),
                  round(r["dynamic_over_onnxruntime"], 2), f"{r['max_abs_error']:.1e}"] for r in results]))
    write_json(args.json, {"command": "benchmarks/bench_dynamic.py", "results": results})


if __name__ == "__main__":
    main()
