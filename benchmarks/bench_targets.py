"""AVX-512 vs AVX2 artifacts of the bundled examples, side by side in one process.

Both x86 targets are built in one go (tvm_fusion.api.compile_targets, verified against ONNX
Runtime), loaded back from their artifact directories and timed interleaved round by round
(A B A B ...) on the same inputs at the same thread count. Prints a table of medians and the
AVX2/AVX-512 ratio; writes the raw numbers to benchmarks/results/targets.json (atomically).

    .venv/bin/python benchmarks/bench_targets.py [--repeat 50] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

import tvm_fusion
from tvm_fusion import api
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.report import table, write_json

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["x86_64-avx512", "x86_64-avx2"]
MODELS = ["bert_tiny", "gpt2_tiny"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="default: the configs' thread count")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "targets.json"))
    args = parser.parse_args()

    configs = [ROOT / "configs" / f"{name}.toml" for name in TARGETS]
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_targets_") as build:
        for name in MODELS:
            model_path = ROOT / "examples" / "models" / f"{name}.onnx"
            built = api.compile_targets(model_path, configs, None, build,
                                        progress=lambda m, n=name: print(f"[{n}] {m}", flush=True))
            for result in built:
                if result.error is not None:
                    raise SystemExit(f"{name} {result.target}: {result.error}")
            models = {r.target: tvm_fusion.load(r.artifact) for r in built}
            if args.threads:
                os.environ["TVM_NUM_THREADS"] = str(args.threads)
            meta = built[0].metadata
            specs = [onnx_frontend.TensorSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in meta["inputs"]]
            inputs = onnx_frontend.random_inputs(onnx.load(str(model_path)), specs, seed=0)
            prepared = {target: model.prepare(inputs) for target, model in models.items()}
            times: dict[str, list[float]] = {target: [] for target in models}
            for round_index in range(args.warmup + args.repeat):
                for target, model in models.items():
                    start = time.perf_counter()
                    model.run_prepared(prepared[target])
                    if round_index >= args.warmup:
                        times[target].append(time.perf_counter() - start)
            medians = {t: float(np.median(v)) * 1e3 for t, v in times.items()}
            ratio = medians["x86_64-avx2"] / medians["x86_64-avx512"]
            results[name] = {"threads": args.threads or meta["threads"], "samples": args.repeat,
                             "medians_ms": medians, "avx2_over_avx512": ratio,
                             "inputs": {s.name: list(s.shape) for s in specs},
                             "verification": {r.target: r.verification for r in built}}
            rows.append([name, medians["x86_64-avx512"], medians["x86_64-avx2"], ratio])

    print(table(["model", "AVX-512 median ms", "AVX2 median ms", "AVX2 / AVX-512"], rows, "lrrr"))
    print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
