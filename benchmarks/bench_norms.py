"""Kernel time, bytes moved and GB/s of the skip LayerNorm / RMSNorm kernels, vs the split they replace.

    python benchmarks/bench_norms.py [--config configs/x86_64-host.toml] [--json build/bench-norms.json]

Each case is lowered and scheduled by the tvm_fusion pipeline at the config's target and
thread count; every resulting kernel is timed alone (``time_evaluator``, median of repeats).
"split" is the arrangement before skip_layernorm: one kernel writes the residual sum (the
GEMM epilogue did this), the normalization kernel reads it back. Bytes moved = every
kernel argument read or written once (a lower bound: what the kernel must move).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

SHAPES = [(128, 256), (512, 768)]  # tiny examples at sequence 128; BERT-base at sequence 512


@dataclasses.dataclass
class Case:
    name: str
    patterns: tuple[str, ...]
    split: bool  # sum and normalization in separate functions (separate kernels)
    rms: bool = False
    sum_output: bool = False


CASES = [
    Case("skip_layernorm", ("skip_layernorm",), split=False),
    Case("skip_layernorm + sum output", ("skip_layernorm",), split=False, sum_output=True),
    Case("split: add kernel, layer_norm kernel", (), split=True, sum_output=True),
    Case("skip_rms_norm", ("skip_rms_norm",), split=False, rms=True),
    Case("split: add kernel, rms_norm kernel", (), split=True, rms=True, sum_output=True),
]


def build_module(case: Case, rows: int, hidden: int):
    """main(x, bias, skip, gamma[, beta]) -> norm(x + bias + skip) [and the sum]."""
    from tvm import relax

    x, skip = (relax.Var(n, relax.TensorType((rows, hidden), "float32")) for n in ("x", "skip"))
    bias, gamma, beta = (relax.Var(n, relax.TensorType((hidden,), "float32")) for n in ("bias", "gamma", "beta"))
    params = [x, bias, skip, gamma] + ([] if case.rms else [beta])
    bb = relax.BlockBuilder()
    if case.split:  # the sum in its own function, so FuseOps cannot merge it into the norm
        own = [relax.Var(v.name, v.ty) for v in (x, bias, skip)]  # a Var has one definition site
        with bb.function("residual_sum", own):
            with bb.dataflow():
                out = bb.emit_output(relax.op.add(relax.op.add(own[0], own[1]), own[2]))
            bb.emit_func_output(out)
    with bb.function("main", params):
        with bb.dataflow():
            if case.split:
                summed = bb.emit(relax.Call(bb.get().get_global_var("residual_sum"), [x, bias, skip]))
            else:
                summed = bb.emit(relax.op.add(bb.emit(relax.op.add(x, bias)), skip))
            norm = (relax.op.nn.rms_norm(summed, gamma, axes=[-1]) if case.rms
                    else relax.op.nn.layer_norm(summed, gamma, beta, axes=[-1]))
            out = bb.emit_output(relax.Tuple([norm, summed]) if case.sum_output else norm)
        bb.emit_func_output(out)
    return bb.get()


def kernel_times(module, target, repeat: int) -> list[tuple[str, float, int]]:
    """(kernel, median seconds, bytes of its arguments) for every PrimFunc in ``module``."""
    import tvm

    rng = np.random.default_rng(0)
    results = []
    for gvar, func in module.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        name = gvar.name_hint
        lib = tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=target)
        # A PrimFunc's params carry their buffer's shape and dtype.
        args = [tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.shape]).astype(p.dtype))
                for p in func.params]
        timer = lib.mod.time_evaluator(name, tvm.cpu(), number=50, repeat=repeat)
        seconds = float(np.median(timer(*args).results))
        results.append((name, seconds, sum(a.numpy().nbytes for a in args)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="pipeline config (default: configs/x86_64-host.toml)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    opts = parser.parse_args()

    from tvm_fusion.config import load_config
    from tvm_fusion.report import write_json
    from tvm_fusion.report import table
    from tvm_fusion.runtime import set_threads

    base = load_config(opts.config)
    set_threads(base.threads)
    from tvm_fusion.passes import fusion_pipeline
    from tvm_fusion.patterns import PatternReport

    rows, records = [], []
    for rows_count, hidden in SHAPES:
        for case in CASES:
            config = dataclasses.replace(base, patterns=case.patterns)
            module = fusion_pipeline(config, PatternReport())(build_module(case, rows_count, hidden))
            kernels = kernel_times(module, config.tvm_target(), opts.repeat)
            seconds = sum(t for _, t, _ in kernels)
            moved = sum(b for _, _, b in kernels)
            record = {"shape": [rows_count, hidden], "case": case.name, "kernels": len(kernels),
                      "median_us": seconds * 1e6, "bytes": moved, "gb_per_s": moved / seconds / 1e9,
                      "per_kernel_us": {name: t * 1e6 for name, t, _ in kernels}}
            records.append(record)
            rows.append([f"{rows_count}x{hidden}", case.name, len(kernels), record["median_us"],
                         moved, record["gb_per_s"]])
    print(f"{base.threads} threads, target {base.target}")
    print(table(["shape", "case", "kernels", "median us", "bytes moved", "GB/s"], rows, "llrrrr"))
    if opts.json:
        write_json(opts.json, {"threads": base.threads, "target": base.target, "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
