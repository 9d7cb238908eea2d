"""Kernel time, bytes moved, GB/s (and GFLOP/s) of the softmax and attention fusions, vs what
they replace; the machine's memory bandwidth; whole-model tvm_fusion vs ONNX Runtime.

    python benchmarks/bench_fusions.py [--config configs/x86_64-host.toml] [--repeat 15]
                                       [--json benchmarks/results/fusions.json] [--no-models]

Shapes: batch 1, 4 heads, head dim 64 (BERT/GPT-2 tiny), sequence 128 and 512.
Every kernel a case compiles to is timed alone (median of ``--repeat`` rounds of 20 direct
calls; rounds go over all kernels in turn) at the config's target and thread count, with the
constants ``main`` passes it. Bytes moved = every kernel
argument read or written once: what the kernel must move at least.

Memory bandwidth is measured two ways, both on 64 MiB arrays (far larger than the caches):
a STREAM-like triad ``a = b + 3 c`` compiled by tvm_fusion (parallel, vectorized, at the config's
thread count; 3 arrays moved) and numpy's single-threaded ``copyto`` (2 arrays moved). "% bw" is
a kernel's GB/s over the triad's. The softmax and attention working sets are smaller than L2/L3,
so they can exceed 100 %; attention is compute-bound (S/4 flops per byte), its GFLOP/s is the
number to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BATCH, HEADS, HEAD_DIM = 1, 4, 64
SEQUENCES = (128, 512)
BANDWIDTH_ELEMENTS = 16 * 1024 * 1024  # float32: 64 MiB per array
MODELS = {"bert_tiny": ["input_ids:1x128", "attention_mask:1x128"], "gpt2_tiny": ["input_ids:1x128"]}


@dataclasses.dataclass
class Case:
    name: str
    kind: str                 # "softmax", "masked_softmax" or "attention"
    patterns: tuple[str, ...]  # the fusion patterns the pipeline runs with
    rule: str | None = None   # schedule every kernel with this CPU rule instead of the default list


CASES = [
    Case("softmax, Softmax rule (vector row max/sum)", "softmax", ()),
    Case("softmax, generic Reduction rule (before)", "softmax", (), rule="Reduction"),
    Case("x/8+mask -> softmax, softmax fusion", "masked_softmax", ("softmax",)),
    Case("x/8+mask -> softmax, FuseOps split (before)", "masked_softmax", ()),
    Case("attention fusion (one kernel)", "attention", ("attention",)),
    Case("attention unfused (before: split/QK/softmax/PV/merge)", "attention", ()),
]


def build_module(kind: str, seq: int):
    """The Relax graph of a case: softmax [1,H,S,S], its masked form, or a BERT attention."""
    from tvm import relax

    scores_shape = (BATCH, HEADS, seq, seq)
    hidden = HEADS * HEAD_DIM
    if kind == "attention":
        params = [relax.Var(n, relax.TensorType((BATCH, seq, hidden), "float32")) for n in "qkv"]
    else:
        params = [relax.Var("x", relax.TensorType(scores_shape, "float32"))]
    if kind != "softmax":
        params.append(relax.Var("mask", relax.TensorType((BATCH, 1, 1, seq), "float32")))

    def heads_first(x, axes):
        return relax.op.permute_dims(relax.op.reshape(x, (BATCH, seq, HEADS, HEAD_DIM)), axes)

    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            if kind == "attention":
                scores = relax.op.matmul(heads_first(params[0], [0, 2, 1, 3]),
                                         heads_first(params[1], [0, 2, 3, 1]))
            else:
                scores = params[0]
            logits = scores
            if kind != "softmax":
                logits = relax.op.add(relax.op.divide(scores, relax.const(8.0, "float32")), params[-1])
            out = relax.op.nn.softmax(logits, axis=-1)
            if kind == "attention":
                context = relax.op.matmul(out, heads_first(params[2], [0, 2, 1, 3]))
                out = relax.op.reshape(relax.op.permute_dims(context, [0, 2, 1, 3]), (BATCH, seq, hidden))
            result = bb.emit_output(out)
        bb.emit_func_output(result)
    return bb.get()


def compile_case(case: Case, seq: int, base):
    """The case's module through the pipeline (optionally scheduled by one named rule)."""
    import tvm

    from tvm_fusion.passes import fusion_pipeline
    from tvm_fusion.patterns import PatternReport
    from tvm_fusion.schedules import cpu

    config = dataclasses.replace(base, patterns=case.patterns)
    phases = ("canonicalize", "fuse", "lower") + (() if case.rule else ("schedule",))
    module = fusion_pipeline(config, PatternReport(), phases=phases)(build_module(case.kind, seq))
    if case.rule:
        rule = getattr(cpu, case.rule)()
        for gvar, func in list(module.functions_items()):
            if isinstance(func, tvm.tirx.PrimFunc):
                sch = rule.apply(func, config.tvm_target(), False) or cpu.Fallback().apply(
                    func, config.tvm_target(), False)
                module[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return module, config.tvm_target()


@dataclasses.dataclass
class Kernel:
    name: str
    run: object   # the compiled PrimFunc
    args: list    # its arguments: the constants ``main`` passes (the score scale), else random data
    bytes: int    # every argument read or written once
    samples: list = dataclasses.field(default_factory=list)


def compile_kernels(module, target) -> list[Kernel]:
    """Every kernel ``main`` calls, compiled alone."""
    import tvm
    from tvm import relax

    rng = np.random.default_rng(0)
    calls = {}
    relax.analysis.post_order_visit(module["main"], lambda e: calls.setdefault(e.args[0].name_hint, e)
                                    if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.call_tir"
                                    else None)
    kernels = []
    for name, call in calls.items():
        func = module[name].with_attr("global_symbol", name)
        run = tvm.compile(tvm.IRModule({name: func}), target=target)[name]
        constants = [getattr(arg, "value", None) for arg in call.args[1].fields]
        args = []
        for index, param in enumerate(func.params):
            value = constants[index] if index < len(constants) else None
            shape, dtype = [int(d) for d in param.ty.shape], str(param.ty.dtype)
            args.append(tvm.runtime.tensor(value.numpy() if value is not None
                                           else rng.standard_normal(shape).astype(dtype)))
        kernels.append(Kernel(name, run, args, sum(a.numpy().nbytes for a in args)))
    return kernels


def time_round_robin(kernels: list[Kernel], repeat: int, number: int = 20) -> None:
    """Fill each kernel's ``samples`` (seconds per call, mean of ``number`` direct calls), one
    round over all kernels at a time so that load drift on a shared machine hits all alike.
    Direct calls, as the VM makes them (``time_evaluator`` read several times slower here)."""
    for kernel in kernels:
        kernel.run(*kernel.args)
    for _ in range(repeat):
        for kernel in kernels:
            start = time.perf_counter()
            for _ in range(number):
                kernel.run(*kernel.args)
            kernel.samples.append((time.perf_counter() - start) / number)


def attention_flops(seq: int) -> int:
    """Q·Kᵀ and probs·V: 2 multiply-adds per (head, query, key, dim)."""
    return 2 * 2 * BATCH * HEADS * seq * seq * HEAD_DIM


def measure_bandwidth(base, repeat: int) -> dict:
    """GB/s of a tvm_fusion-compiled triad (config threads) and of numpy's copy (one thread)."""
    from tvm import relax

    from tvm_fusion.passes import fusion_pipeline
    from tvm_fusion.patterns import PatternReport

    b, c = (relax.Var(n, relax.TensorType((BANDWIDTH_ELEMENTS,), "float32")) for n in "bc")
    bb = relax.BlockBuilder()
    with bb.function("main", [b, c]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(b, relax.op.multiply(c, relax.const(3.0, "float32"))))
        bb.emit_func_output(out)
    module = fusion_pipeline(dataclasses.replace(base, patterns=()), PatternReport())(bb.get())
    (kernel,) = compile_kernels(module, base.tvm_target())
    time_round_robin([kernel], repeat)
    triad = 3 * BANDWIDTH_ELEMENTS * 4 / float(np.median(kernel.samples)) / 1e9

    src = np.random.default_rng(0).standard_normal(BANDWIDTH_ELEMENTS).astype(np.float32)
    dst = np.empty_like(src)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    copy = 2 * src.nbytes / float(np.median(samples)) / 1e9
    return {"triad_gb_per_s": triad, "numpy_copy_1thread_gb_per_s": copy,
            "array_mib": src.nbytes / 2**20}


def bench_models(config_path, repeat: int) -> list[dict]:
    from tvm_fusion import api

    results = []
    for name, shapes in MODELS.items():
        report = api.bench_model(ROOT / "examples" / "models" / f"{name}.onnx", config_path, shapes,
                                 repeat=repeat, include_stock=False)
        results.append({"model": name, **report.to_json()})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="pipeline config (default: configs/x86_64-host.toml)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", metavar="FILE", default=str(ROOT / "benchmarks" / "results" / "fusions.json"))
    parser.add_argument("--no-models", action="store_true", help="skip the whole-model comparison")
    opts = parser.parse_args()

    from tvm_fusion.config import load_config
    from tvm_fusion.report import table, write_json
    from tvm_fusion.runtime import set_threads

    base = load_config(opts.config)
    set_threads(base.threads)
    bandwidth = measure_bandwidth(base, opts.repeat)
    reference = bandwidth["triad_gb_per_s"]

    compiled = [(seq, case, compile_kernels(*compile_case(case, seq, base)))
                for seq in SEQUENCES for case in CASES]
    time_round_robin([kernel for _, _, kernels in compiled for kernel in kernels], opts.repeat)
    rows, records = [], []
    for seq, case, kernels in compiled:
        seconds = sum(float(np.median(kernel.samples)) for kernel in kernels)
        moved = sum(kernel.bytes for kernel in kernels)
        flops = attention_flops(seq) if case.kind == "attention" else 0
        record = {"seq": seq, "case": case.name, "kernels": len(kernels), "median_us": seconds * 1e6,
                  "bytes": moved, "gb_per_s": moved / seconds / 1e9,
                  "percent_of_bandwidth": 100 * moved / seconds / 1e9 / reference,
                  "gflop_per_s": flops / seconds / 1e9 if flops else None,
                  "per_kernel_us": {k.name: float(np.median(k.samples)) * 1e6 for k in kernels}}
        records.append(record)
        rows.append([seq, case.name, len(kernels), record["median_us"], moved / 2**10,
                     record["gb_per_s"], record["percent_of_bandwidth"],
                     f"{record['gflop_per_s']:.0f}" if flops else ""])
    print(f"{base.threads} threads, target {base.target}")
    print(f"memory bandwidth: triad {reference:.1f} GB/s ({base.threads} threads), "
          f"numpy copy {bandwidth['numpy_copy_1thread_gb_per_s']:.1f} GB/s (1 thread), "
          f"{bandwidth['array_mib']:.0f} MiB arrays")
    print(table(["seq", "case", "kernels", "median us", "KiB moved", "GB/s", "% bw", "GFLOP/s"], rows,
                "rlrrrrrr"))

    models = [] if opts.no_models else bench_models(opts.config, max(opts.repeat, 20))
    if models:
        print(table(["model", "ORT ms", "tvm_fusion ms", "tvm_fusion/ORT"],
                    [[m["model"], m["medians_ms"]["onnxruntime"], m["medians_ms"]["tvm_fusion"],
                      m["ratio_to_onnxruntime"]["tvm_fusion"]] for m in models]))

    write_json(opts.json, {"threads": base.threads, "target": base.target, "bandwidth": bandwidth, "kernels": records, "models": models})
    return 0


if __name__ == "__main__":
    sys.exit(main())
