"""EyeLike + Add before and after fusion, 10,000 runs each, as the seed measured it.

    python benchmarks/bench_eyelike.py [--shape 512x512] [--runs 10000] [--out benchmarks/results/eyelike.json]

The seed's worked example: an ONNX graph EyeLike -> Add, run 10,000 times before and after
replacing the two nodes by one (1.1428 s -> 0.8636 s, max difference 0). Here the same graph is
compiled by tvm_fusion with the ``eye_like_add`` pattern disabled (TVM's FuseOps may still put
both kernels in one function, but the identity is computed into a scratch buffer and read back)
and enabled (one loop: ``b + (j - i == k)``), and run by ONNX Runtime for reference. 2 threads,
one process; the 10,000 runs of each are interleaved in blocks of 1,000.
"""

import argparse
import os

os.environ.setdefault("TVM_NUM_THREADS", "2")  # must precede the first TVM run

import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from tvm_fusion import api  # noqa: E402
from tvm_fusion.config import load_config  # noqa: E402
from tvm_fusion.report import table, write_json  # noqa: E402
from tvm_fusion.runtime import CompiledModel  # noqa: E402
from tvm_fusion.verify import onnxruntime_session  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
THREADS = 2
BLOCK = 1000


def eye_like_add(shape: tuple[int, int], k: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("EyeLike", ["x"], ["eye"], k=k), helper.make_node("Add", ["eye", "b"], ["y"])],
        "eye_like_add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def compiled(path: Path, patterns: list[str]):
    config = load_config()
    config = config.__class__(**{**config.__dict__, "patterns": tuple(patterns), "threads": THREADS})
    prepared = api.prepare(path, config)
    optimized = api.optimize(prepared)
    model = CompiledModel(api.build(optimized.module, config),
                          {"inputs": [s.to_json() for s in prepared.inputs],
                           "outputs": [{"name": n} for n in prepared.output_names], "threads": THREADS})
    return model, optimized


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="512x512")
    parser.add_argument("--k", type=int, default=0)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eyelike.json"))
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split("x"))
    model = eye_like_add(shape, args.k)
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(shape).astype("float32"), "b": rng.standard_normal(shape).astype("float32")}

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "eye_like_add.onnx"
        onnx.save(model, str(path))
        others = [p for p in load_config().patterns if p != "eye_like_add"]
        before, _ = compiled(path, others)
        after, optimized = compiled(path, [*others, "eye_like_add"])
    assert optimized.report.fired["eye_like_add"] == 1, optimized.report
    session = onnxruntime_session(model, THREADS)
    prepared = {"before": before.prepare(inputs), "after": after.prepare(inputs)}
    runners = {"tvm_fusion before (pattern off)": lambda: before.run_prepared(prepared["before"]),
               "tvm_fusion after (pattern on)": lambda: after.run_prepared(prepared["after"]),
               "onnxruntime (EyeLike, Add)": lambda: session.run(["y"], inputs)}
    outputs = {"before": before.run(inputs)["y"], "after": after.run(inputs)["y"],
               "onnxruntime": session.run(["y"], inputs)[0]}
    reference = np.eye(*shape, k=args.k, dtype="float32") + inputs["b"]
    max_diff = {name: float(np.abs(value - outputs["before"]).max()) for name, value in outputs.items()}
    max_diff_numpy = {name: float(np.abs(value - reference).max()) for name, value in outputs.items()}

    for run in runners.values():  # warm-up
        run()
    totals = dict.fromkeys(runners, 0.0)
    for _ in range(args.runs // BLOCK):
        for name, run in runners.items():
            start = time.perf_counter()
            for _ in range(BLOCK):
                run()
            totals[name] += time.perf_counter() - start
    runs = args.runs // BLOCK * BLOCK
    before_s, after_s = totals["tvm_fusion before (pattern off)"], totals["tvm_fusion after (pattern on)"]
    rows = [[name, runs, seconds, seconds / runs * 1e6] for name, seconds in totals.items()]
    print(f"EyeLike(k={args.k}) + Add at {args.shape}, {THREADS} threads, {runs} runs each "
          f"(interleaved in blocks of {BLOCK})")
    print(table(["runner", "runs", "total s", "us per run"], rows))
    print(f"after/before {after_s / before_s:.3f}; max |after - before| {max_diff['after']:g}, "
          f"max |ORT - before| {max_diff['onnxruntime']:g}   (seed: 1.1428 s -> 0.8636 s, ratio 0.756, diff 0)")
    result = {"shape": list(shape), "k": args.k, "threads": THREADS, "runs": runs,
              "total_s": totals, "after_over_before": after_s / before_s,
              "max_abs_diff_vs_before": max_diff, "max_abs_diff_vs_numpy": max_diff_numpy,
              "seed": {"before_s": 1.1428, "after_s": 0.8636, "max_diff": 0.0}}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
