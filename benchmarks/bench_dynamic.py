"""One artifact for a range of sizes against one static artifact per size, and ONNX Runtime.

For each model two dynamic modules are built once for its range: symbolic kernels only, and
the same with shape buckets at the model's bucket sizes (static kernels behind a dispatch on
the exact size, ``tvm_fusion/dispatch/buckets.py``). At each size a static module is built for exactly
that size. The timed sizes are the bucket sizes plus one size off every bucket, where the
bucketed module runs its symbolic kernels. At each size the four run interleaved round by
round (a new random order each round) in one process, on the same inputs, untuned (hand
schedules), at the config's thread count. Reported: medians, each dynamic module over the
static one and over ONNX Runtime, and the largest abs error of either dynamic module against
ONNX Runtime. Raw numbers go to benchmarks/results/dynamic.json (atomically).

    .venv/bin/python benchmarks/bench_dynamic.py [--repeat 30] [--only bert_tiny] [--config ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path

import numpy as np

from tvm_fusion import api
from tvm_fusion.dispatch.buckets import bucket_text
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.metadata import bench_metadata
from tvm_fusion.native_log import captured_native_stderr
from tvm_fusion.report import table, write_json
from tvm_fusion.runtime import CompiledModel, set_threads
from tvm_fusion.verify import onnxruntime_feeds, onnxruntime_session, run_onnxruntime

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models"
SEQUENCES = [{"sequence": s} for s in (8, 32, 128, 384)]
IMAGES = [{"height": h, "width": w} for h, w in ((64, 64), (224, 224), (48, 320))]
# model, the range flag, the bucket sizes, and a size off the buckets ({dim name: size} per point)
CASES = [
    ("bert_tiny", "input_ids:1x1..512", SEQUENCES, {"sequence": 100}),
    ("gpt2_tiny", "input_ids:1x1..512", SEQUENCES, {"sequence": 100}),
    ("resnet_tiny", "input:1x3x32..512x32..512", IMAGES, {"height": 160, "width": 96}),
    ("mobilenetv3_tiny", "input:1x3x32..512x32..512", IMAGES, {"height": 160, "width": 96}),
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


def bench_case(name: str, flag: str, buckets: list[dict], off_bucket: dict, config, repeat: int) -> list[dict]:
    path = MODELS / f"{name}.onnx"
    dynamic_prepared = api.prepare(path, config, [flag])
    cfg = dynamic_prepared.config
    set_threads(cfg.threads)
    start = time.perf_counter()
    dynamic = built(dynamic_prepared)
    print(f"{name}: dynamic module for {flag} built in {time.perf_counter() - start:.1f} s", flush=True)
    bucketed_prepared = dataclasses.replace(dynamic_prepared, config=dataclasses.replace(
        cfg, buckets=tuple(tuple(point.items()) for point in buckets)))
    start = time.perf_counter()
    bucketed = built(bucketed_prepared)
    print(f"{name}: with buckets at {'; '.join(map(bucket_text, buckets))} built in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    session = onnxruntime_session(dynamic_prepared.onnx_model, cfg.threads)
    rows = []
    for sizes in [*buckets, off_bucket]:
        static_prepared = api.prepare(path, config, static_flag(flag, sizes, dynamic_prepared))
        static = built(static_prepared)
        inputs = onnx_frontend.random_inputs(dynamic_prepared.onnx_model, static_prepared.inputs, cfg.seed)
        feeds = onnxruntime_feeds(inputs)
        reference = run_onnxruntime(session, feeds)
        error = max(float(np.abs(produced[k].astype(np.float64) - reference[k].astype(np.float64)).max())
                    for module in (dynamic, bucketed) for produced in [module.run(inputs)] for k in reference)
        tensors = {"static": static.prepare(inputs), "dynamic": dynamic.prepare(inputs),
                   "bucketed": bucketed.prepare(inputs)}
        medians = time_interleaved({
            "onnxruntime": lambda: run_onnxruntime(session, feeds),
            "static": lambda: static.run_prepared(tensors["static"]),
            "dynamic": lambda: dynamic.run_prepared(tensors["dynamic"]),
            "bucketed": lambda: bucketed.run_prepared(tensors["bucketed"]),
        }, repeat, cfg.seed)
        row = {"model": name, "range": flag, "sizes": sizes, "bucket": sizes in buckets, "medians_ms": medians,
               "dynamic_over_static": medians["dynamic"] / medians["static"],
               "dynamic_over_onnxruntime": medians["dynamic"] / medians["onnxruntime"],
               "bucketed_over_static": medians["bucketed"] / medians["static"],
               "bucketed_over_onnxruntime": medians["bucketed"] / medians["onnxruntime"],
               "max_abs_error": error, "threads": cfg.threads, "repeat": repeat}
        print(f"  {sizes}: ORT {medians['onnxruntime']:.3f} ms, static {medians['static']:.3f} ms, "
              f"dynamic {medians['dynamic']:.3f} ms ({row['dynamic_over_static']:.2f}x static), "
              f"bucketed {medians['bucketed']:.3f} ms ({row['bucketed_over_static']:.2f}x static)", flush=True)
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
    for name, flag, buckets, off_bucket in CASES:
        if args.only and name not in args.only:
            continue
        results += bench_case(name, flag, buckets, off_bucket, args.config, args.repeat)
    print(table(["model", "sizes", "bucket", "ORT ms", "static ms", "dynamic ms", "bucketed ms", "dyn/static",
                 "bucketed/static", "bucketed/ORT", "max err"],
                [[r["model"], ",".join(f"{k}={v}" for k, v in r["sizes"].items()), "yes" if r["bucket"] else "no",
                  *(round(r["medians_ms"][k], 3) for k in ("onnxruntime", "static", "dynamic", "bucketed")),
                  round(r["dynamic_over_static"], 2), round(r["bucketed_over_static"], 2),
                  round(r["bucketed_over_onnxruntime"], 2), f"{r['max_abs_error']:.1e}"] for r in results]))
    write_json(args.json, {"command": "benchmarks/bench_dynamic.py", "results": results})


if __name__ == "__main__":
    main()
