"""One dense layer, x @ W + b then Gelu: our float32 kernel vs the bf16 kernel (issue 43).

    TVM_NUM_THREADS=2 python benchmarks/bench_bf16.py [--repeat 200] [--out benchmarks/results/bf16_<cpu>_<date>.json]

Each shape (rows x K -> N: a BERT-base projection and FFN at one token, 16 and 128) is built
up to four ways from one Relax module, run in one process, interleaved round by round, medians:

    float32       what tvm_fusion builds today: the weight packed in column panels
                  (``PackMatmulWeights``), the float32 matmul rule (``MatmulEpilogue``)
    bf16 amx      ``Bf16Matmuls``: the weight rounded to bf16 and packed, the activation
                  rounded in the kernel, float32 sums on AMX tiles (``Bf16MatmulAmx``); only
                  where the target CPU has AMX-BF16
    bf16 avx512   the same bf16 kernel for the target less its AMX (``mattr`` ``-amx-bf16``):
                  ``vdpbf16ps`` register tiles (``Bf16MatmulAvx512``), what a Zen 4 runs; only
                  where the target CPU has AVX512_BF16
    bf16 generic  the same bf16 kernel for the target less AMX-BF16 and AVX512_BF16: each bf16
                  widened to float32 by a shift, float32 FMAs under the generic rules; what an
                  AVX2 CPU would run if ``Bf16Matmuls`` did not decline there, which is why it
                  declines

Every bf16 output is checked against numpy on the bf16-rounded operands first, and the
float32 output against numpy in float32. Target: the default config's (this host's CPU).
"""

import argparse
import os

os.environ.setdefault("TVM_NUM_THREADS", "2")  # must precede the first TVM run

import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from tvm_fusion.config import host_cpu_name, load_config  # noqa: E402
from tvm_fusion.kernels.cpu_features import has_amx_bf16, has_avx512_bf16  # noqa: E402
from tvm_fusion.passes.bf16_matmuls import Bf16Matmuls  # noqa: E402
from tvm_fusion.passes.pack_matmul_weights import PackMatmulWeights  # noqa: E402
from tvm_fusion.passes.pipeline import lowering_passes  # noqa: E402
from tvm_fusion.report import table, write_json  # noqa: E402
from tvm_fusion.schedules import ApplySchedules  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(rows, k, n) for rows in (1, 16, 128) for k, n in ((768, 768), (768, 3072))]


def dense_gelu(rows: int, depth: int, columns: int) -> tuple[tvm.IRModule, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((depth, columns)) / np.sqrt(depth)).astype(np.float32)
    bias = rng.standard_normal(columns).astype(np.float32)
    x = relax.Var("x", relax.TensorType((rows, depth), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = relax.op.add(relax.op.matmul(x, relax.const(weight)), relax.const(bias))
            out = bb.emit_output(relax.op.nn.gelu(y))
        bb.emit_func_output(out)
    return bb.get(), weight, bias


def build(mod: tvm.IRModule, target, bf16: bool, schedule_target) -> tuple[relax.VirtualMachine, dict]:
    """(VM, kernel -> schedule rule) of ``mod`` lowered (bf16 kernels or not) and scheduled for
    ``schedule_target``, compiled for ``target``."""
    log: dict = {}
    passes = [*([Bf16Matmuls(target)] if bf16 else []), *lowering_passes(),
              PackMatmulWeights(schedule_target), ApplySchedules(schedule_target, log=log)]
    lowered = tvm.transform.Sequential(passes)(mod)
    return relax.VirtualMachine(tvm.compile(lowered, target=target), tvm.cpu()), log


def less(target, *features: str):
    """``target`` without these CPU features (``mattr`` ``-feature``)."""
    spec = target.export()
    return tvm.target.Target({**spec, "mattr": [*spec.get("mattr", []), *(f"-{f}" for f in features)]})


def gelu(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1 + np.vectorize(math.erf)(v / np.sqrt(2)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", default=None, help="a JSON results file (default: none written)")
    args = parser.parse_args()
    threads = int(os.environ["TVM_NUM_THREADS"])
    target = load_config(None).tvm_target()
    # the bf16 builds this target can run: (name, the target its kernels are scheduled for)
    variants = [("bf16 amx", target)] if has_amx_bf16(target) else []
    if has_avx512_bf16(target):
        variants.append(("bf16 avx512", less(target, "amx-bf16")))
    variants.append(("bf16 generic", less(target, "amx-bf16", "avx512bf16")))
    results = {"machine": {"cpu": host_cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
               "date": time.strftime("%Y-%m-%d"), "threads": threads, "target": str(target), "repeat": args.repeat,
               "shapes": {}}
    rows_out = []
    for rows, depth, columns in SHAPES:
        mod, weight, bias = dense_gelu(rows, depth, columns)
        builds = {"float32": build(mod, target, False, target)}
        builds.update((name, build(mod, target, True, schedule_target)) for name, schedule_target in variants)
        x = np.random.default_rng(1).standard_normal((rows, depth)).astype(np.float32)
        feeds = [tvm.runtime.tensor(x)]
        ra, rw = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (x, weight))
        errors = {}
        for name, (vm, _) in builds.items():
            expected = gelu((ra @ rw if name.startswith("bf16") else x.astype(np.float64) @ weight) + bias)
            errors[name] = float(np.abs(vm["main"](*feeds).numpy() - expected).max())
            assert errors[name] < 1e-4, (name, errors[name])
        times = {name: [] for name in builds}
        for round_index in range(10 + args.repeat):  # 10 warm-up rounds
            for name, (vm, _) in builds.items():
                start = time.perf_counter()
                vm["main"](*feeds)
                if round_index >= 10:
                    times[name].append(time.perf_counter() - start)
        medians = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        label = f"{rows}x{depth}->{columns}"
        results["shapes"][label] = {
            "rows_k_n": [rows, depth, columns], "median_ms": medians, "max_abs_error_vs_numpy": errors,
            "gflops": {name: 2 * rows * depth * columns / ms / 1e6 for name, ms in medians.items()},
            "schedules": {name: log for name, (_, log) in builds.items()}}
        rows_out.append([label, medians["float32"], *(medians[name] for name, _ in variants),
                         *(medians["float32"] / medians[name] for name, _ in variants)])
    print(f"threads {threads}, target {target}, {args.repeat} interleaved rounds, medians")
    names = [name for name, _ in variants]
    print(table(["shape", "float32 ms", *(f"{n} ms" for n in names), *(f"f32/{n.split()[1]}" for n in names)], rows_out))
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
