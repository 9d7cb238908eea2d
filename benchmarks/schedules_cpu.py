"""Time BERT-tiny-sized kernels: unscheduled vs tvm_fusion's CPU schedules vs numpy, 2 threads.

    python benchmarks/schedules_cpu.py [--mcpu znver5] [--runs 50]

numpy's GELU uses the tanh form (numpy has no erf); its cost is of the same order.
"""

import argparse
import os

for _var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "2")  # must precede the imports that start thread pools

import time  # noqa: E402

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.op import add, matmul, nn  # noqa: E402

from tvm_fusion.schedules import ApplySchedules  # noqa: E402


def _np_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_layer_norm(x, g, b):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b


# name, relax body, numpy body, input shapes, matmul flops
KERNELS = [
    ("matmul+bias+gelu 128x256x1024", lambda x, w, b: nn.gelu(add(matmul(x, w), b)),
     lambda x, w, b: _np_gelu(x @ w + b), [(128, 256), (256, 1024), (1024,)], 2 * 128 * 256 * 1024),
    ("matmul+bias+residual 128x1024x256", lambda x, w, b, r: add(add(matmul(x, w), b), r),
     lambda x, w, b, r: x @ w + b + r, [(128, 1024), (1024, 256), (256,), (128, 256)],
     2 * 128 * 1024 * 256),
    ("matmul+bias 128x256x256", lambda x, w, b: add(matmul(x, w), b),
     lambda x, w, b: x @ w + b, [(128, 256), (256, 256), (256,)], 2 * 128 * 256 * 256),
    ("attn QK^T [4,128,64]x[4,64,128]", matmul, np.matmul, [(4, 128, 64), (4, 64, 128)],
     2 * 4 * 128 * 64 * 128),
    ("attn PV [4,128,128]x[4,128,64]", matmul, np.matmul, [(4, 128, 128), (4, 128, 64)],
     2 * 4 * 128 * 128 * 64),
    ("softmax [1,4,128,128]", lambda x: nn.softmax(x, axis=-1), _np_softmax, [(1, 4, 128, 128)], 0),
    ("layer_norm [128,256]", lambda x, g, b: nn.layer_norm(x, g, b, axes=[-1]), _np_layer_norm,
     [(128, 256), (256,), (256,)], 0),
]


def _lower(body, shapes) -> tvm.IRModule:
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(*params))
        bb.emit_func_output(out)
    return relax.get_pipeline("zero")(bb.get())


def _median_ms(fn, runs: int) -> float:
    fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) * 1e3


def _tvm_ms(mod, target, inputs, runs) -> tuple[float, np.ndarray]:
    dev = tvm.cpu()
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), dev)
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    out = vm["main"](*args).numpy()
    return _median_ms(lambda: vm["main"](*args), runs), out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mcpu", default="znver5")
    parser.add_argument("--runs", type=int, default=100)
    opts = parser.parse_args()
    target = tvm.target.Target({"kind": "llvm", "mcpu": opts.mcpu, "num-cores": 2})
    rng = np.random.default_rng(0)
    print(f"threads: TVM {os.environ['TVM_NUM_THREADS']}, target {target}")
    header = f"{'kernel':36} {'unsched ms':>10} {'sched ms':>9} {'numpy ms':>9} {'speedup':>8} {'vs numpy':>8} {'GFLOP/s':>8}  rule"
    print(header)
    print("-" * len(header))
    for name, body, numpy_body, shapes, flops in KERNELS:
        inputs = [rng.standard_normal(s).astype("float32") for s in shapes]
        mod = _lower(body, shapes)
        schedules = ApplySchedules(target)
        scheduled = schedules(mod.clone())
        naive_ms, expected = _tvm_ms(mod, target, inputs, max(opts.runs // 20, 3))
        sched_ms, actual = _tvm_ms(scheduled, target, inputs, opts.runs)
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)
        numpy_ms = _median_ms(lambda: numpy_body(*inputs), opts.runs)
        gflops = f"{flops / sched_ms / 1e6:8.1f}" if flops else f"{'':8}"
        rules = ",".join(sorted(set(schedules.applied.values())))
        print(f"{name:36} {naive_ms:10.3f} {sched_ms:9.4f} {numpy_ms:9.4f} "
              f"{naive_ms / sched_ms:7.1f}x {numpy_ms / sched_ms:7.2f}x {gflops}  {rules}")


if __name__ == "__main__":
    main()
