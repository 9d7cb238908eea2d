"""matmul + bias + GELU + training dropout: one fused kernel vs the same ops as separate kernels.

    python benchmarks/bench_dropout.py [--repeat 50] [--mcpu znver5] [--out benchmarks/results/dropout.json]

The seed's headline: fusing bias, GELU and dropout into the matmul epilogue saved ~15 % of a
training step. Three builds of one Relax graph (the frontend's form of ONNX MatMul -> Add ->
Gelu -> Dropout(training_mode=true)), all scheduled by tvm_fusion's CPU rules, 2 threads, timed
in one process, interleaved round by round:

    separate   every op its own kernel (matmul, add, gelu, dropout): four passes over the output
    gemm_epi   gemm_epilogue only: matmul+bias+GELU in one kernel, dropout a second kernel
    fused      dropout_training: all four in one kernel, values and mask written per tile

Outputs are checked equal (values and mask, bit for bit) before timing.
"""

import argparse
import os

os.environ.setdefault("TVM_NUM_THREADS", "2")  # must precede the first TVM run

import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from tvm_fusion.passes import FusePatterns  # noqa: E402
from tvm_fusion.passes.fast_math import fast_math_legalize_map  # noqa: E402
from tvm_fusion.passes.pipeline import lowering_passes  # noqa: E402
from tvm_fusion.patterns import PatternReport, get_pattern  # noqa: E402
from tvm_fusion.kernels.dropout_training import emit_dropout_training  # noqa: E402
from tvm_fusion.report import table, write_json  # noqa: E402
from tvm_fusion.schedules import ApplySchedules  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"BERT-tiny FFN 128x256x1024": (128, 256, 1024), "BERT-base FFN 512x768x3072": (512, 768, 3072)}
RATIO, SEED = 0.1, 42


def ffn_dropout(m: int, k: int, n: int) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            g = bb.emit(relax.op.nn.gelu(relax.op.add(relax.op.matmul(x, w), b)))
            out = bb.emit_output(emit_dropout_training(bb, g, relax.const(RATIO, "float32"), SEED))
        bb.emit_func_output(out)
    return bb.get()


def build(mod: tvm.IRModule, variant: str, target) -> tuple[relax.VirtualMachine, dict]:
    if variant == "separate":  # LegalizeOps without FuseOps: one kernel per op
        passes = [relax.transform.LegalizeOps(fast_math_legalize_map()), relax.transform.AnnotateTIROpPattern()]
    else:
        patterns = {"gemm_epi": ["gemm_epilogue"], "fused": ["dropout_training"]}[variant]
        mod = FusePatterns([get_pattern(p) for p in patterns], PatternReport())(mod)
        passes = lowering_passes()
    rules: dict[str, str] = {}
    lowered = tvm.transform.Sequential([*passes, ApplySchedules(target, rules)])(mod)
    return relax.VirtualMachine(tvm.compile(lowered, target=target), tvm.cpu()), rules


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--mcpu", default="znver5")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dropout.json"))
    args = parser.parse_args()
    target = tvm.target.Target({"kind": "llvm", "mcpu": args.mcpu, "num-cores": 2})
    rows, results = [], {}
    for label, (m, k, n) in SHAPES.items():
        mod = ffn_dropout(m, k, n)
        rng = np.random.default_rng(0)
        inputs = [tvm.runtime.tensor(a) for a in (rng.standard_normal((m, k)).astype("float32"),
                                                  (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float32"),
                                                  rng.standard_normal(n).astype("float32"))]
        builds = {variant: build(mod, variant, target) for variant in ("separate", "gemm_epi", "fused")}
        outputs = {v: [t.numpy() for t in vm["main"](*inputs)] for v, (vm, _) in builds.items()}
        for variant, (values, mask) in outputs.items():
            np.testing.assert_array_equal(mask, outputs["separate"][1], err_msg=variant)
            np.testing.assert_array_equal(values, outputs["separate"][0], err_msg=variant)
        times = {variant: [] for variant in builds}
        for round_index in range(3 + args.repeat):  # 3 warm-up rounds
            for variant, (vm, _) in builds.items():
                start = time.perf_counter()
                vm["main"](*inputs)
                if round_index >= 3:
                    times[variant].append(time.perf_counter() - start)
        medians = {v: float(np.median(t)) * 1e3 for v, t in times.items()}
        kernels = {v: len(r) for v, (_, r) in builds.items()}
        results[label] = {"shape_mkn": [m, k, n], "ratio": RATIO, "threads": int(os.environ["TVM_NUM_THREADS"]),
                          "repeat": args.repeat, "median_ms": medians, "kernels": kernels,
                          "schedules": {v: r for v, (_, r) in builds.items()},
                          "fused_over_separate": medians["fused"] / medians["separate"],
                          "keep_fraction": float(outputs["fused"][1].mean())}
        rows.append([label, medians["separate"], medians["gemm_epi"], medians["fused"],
                     medians["fused"] / medians["separate"], medians["fused"] / medians["gemm_epi"],
                     f"{kernels['separate']}/{kernels['gemm_epi']}/{kernels['fused']}"])
    print(f"threads {os.environ['TVM_NUM_THREADS']}, target {target}, {args.repeat} interleaved rounds, "
          f"medians; outputs equal bit for bit")
    print(table(["shape (M x K x N)", "separate ms", "gemm_epi ms", "fused ms", "fused/separate",
                 "fused/gemm_epi", "kernels"], rows))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
