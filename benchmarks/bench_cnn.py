"""tvm_fusion vs ONNX Runtime (and OpenVINO) vs stock TVM on the bundled CNN examples, plus kernels.

Each (model, input shape) is timed in one process with the runtimes interleaved round by round
(tvm_fusion.api.bench_model), untuned (hand schedules only, no tuning log), at the config's
thread count (2 on the reference machine); OpenVINO joins the rounds when the peers extra is
installed, at f32 and at its default precision (bf16 on CPUs with AVX512_BF16 or AMX), each
with its errors against ONNX Runtime float32 in the JSON (the table shows the default's max abs
error). Then every tvm_fusion kernel of the model is timed on its own (random inputs, median of
samples of back-to-back calls), in a worker process of its own: the peers' thread pools
outlive their sessions, and on 2 cores their spinning threads slowed kernels timed after
them by up to 13x (resnet_tiny's 96-channel 7x7 conv on Zen 1: 2.40 ms beside them, 0.18 ms
alone). Each conv kernel is reported with its achieved GFLOP/s and its share of this
machine's measured FMA peak (tvm_fusion.machine_peak, recorded with every result), and so are
the three slowest kernels; each depthwise kernel also with its GB/s against the measured L2
bandwidth and its share of the L2 roofline (the lower of the FMA peak and its FLOP per byte x
the L2 bandwidth). Prints the tables and writes the raw numbers to
benchmarks/results/cnn.json (atomically).

    .venv/bin/python benchmarks/bench_cnn.py [--repeat 30] [--config configs/x86_64-host.toml] [--only resnet_tiny]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from tvm_fusion import api
from tvm_fusion.commands.peers import installed_peers
from tvm_fusion.kernels.costs import kernel_costs
from tvm_fusion.report import table, write_json
from tvm_fusion.kernels.winograd_conv2d import WINOGRAD_INPUT, WINOGRAD_OUTPUT, is_winograd_block

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from isolated import run_in_worker  # noqa: E402  (scripts/isolated.py)

CASES = [
    ("resnet_tiny", "input:1x3x224x224"),
    ("resnet_tiny", "input:1x3x48x320"),
    ("mobilenetv3_tiny", "input:1x3x224x224"),
    ("mobilenetv3_tiny", "input:1x3x48x320"),
    ("dbnet_tiny", "input:1x3x224x224"),
    ("dbnet_tiny", "input:1x3x320x320"),  # a common OCR text-detection input
]
SLOWEST = 3
KERNEL_CALLS_PER_SAMPLE = 10
KERNEL_TIMEOUT_S = 900


def kernel_flops(func) -> int:
    """2 x the multiply-adds of the kernel's reduction blocks (conv, matmul): the product of
    the block's iteration extents; 0 for kernels without a multiply-add reduction. A Winograd
    conv counts those of the direct conv it computes (2 x outputs x input channels x 9): its
    effective rate, as oneDNN and cuDNN report Winograd, comparable with the direct convs' (and
    above the FMA peak when the saving is larger than the loss)."""
    import tvm_ffi
    from tvm import s_tir, tirx

    blocks = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, blocks.append))
    tiles = [block for block in blocks if is_winograd_block(block.name_hint, WINOGRAD_INPUT)]
    flops = 0
    for block in blocks:
        size = 1
        for iv in block.iter_vars:
            size *= int(iv.dom.extent)
        if tiles and is_winograd_block(block.name_hint, WINOGRAD_OUTPUT):
            shape = tiles[0].writes[0].source.shape  # [e1, e2, n, ty, tx, IC/i, i]
            flops += 2 * 9 * size * int(shape[5]) * int(shape[6])
            continue
        reduces = any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)
        value = getattr(block.body, "value", None)
        if reduces and isinstance(value, tirx.Add) and isinstance(value.b, tirx.Mul) and not tiles:
            flops += 2 * size
    return flops


def time_kernels(prepared, runs: int) -> list[dict]:
    """Every PrimFunc of the optimized module, built alone and timed on random buffers."""
    import tvm

    optimized = api.optimize(prepared, tuning_log=False)
    target = prepared.config.tvm_target()
    rng = np.random.default_rng(0)
    device = tvm.cpu()
    calls = _call_counts(optimized.module)
    rows = []
    for gvar, func in optimized.module.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        library = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
        args = [tvm.runtime.tensor(rng.standard_normal([int(d) for d in param.shape]).astype(str(param.dtype)),
                                   device) for param in func.params]
        # Timed in TVM's C++ loop, calls back to back as the VM makes them: a Python loop around
        # one call added 10-20 us of call overhead and thread-pool wake-up per call, a third of
        # a small conv's time.
        evaluator = library.mod.time_evaluator("main", device, number=KERNEL_CALLS_PER_SAMPLE, repeat=runs)
        ms = float(np.median(evaluator(*args).results)) * 1e3
        flops = kernel_flops(func)
        _, moved = kernel_costs(func)  # each parameter read or written once
        rows.append({"kernel": gvar.name_hint, "rule": optimized.schedule_rules.get(gvar.name_hint, "-"),
                     "calls": calls.get(gvar.name_hint, 0), "ms": ms,
                     "gflops": flops / ms / 1e6 if flops else None, "flops": flops, "bytes": moved,
                     "gbytes_per_s": moved / ms / 1e6})
    return sorted(rows, key=lambda r: -r["ms"] * max(r["calls"], 1))


def _time_kernels_in_worker(model: str, config, shape: str, threads: int, runs: int, queue) -> None:
    """``time_kernels`` in a spawned worker, at the benchmark's thread count; puts {"kernels": rows}."""
    from tvm_fusion.runtime import set_threads

    set_threads(threads)
    queue.put({"kernels": time_kernels(api.prepare(model, config, [shape]), runs)})


def _call_counts(module) -> dict[str, int]:
    from tvm import relax

    counts: dict[str, int] = {}

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir":
            name = expr.args[0].name_hint
            counts[name] = counts.get(name, 0) + 1

    relax.analysis.post_order_visit(module["main"], visit)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--kernel-runs", type=int, default=20,
                        help=f"samples per kernel, each the mean of {KERNEL_CALLS_PER_SAMPLE} calls")
    parser.add_argument("--config", default=None)
    parser.add_argument("--only", help="benchmark only this model (e.g. resnet_tiny)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cnn.json"))
    args = parser.parse_args()

    peers = installed_peers()
    openvino = "openvino" in peers
    if not openvino:
        print("note: OpenVINO is not installed, so it is left out (pip install 'tvm_fusion[peers]')")
    rows, kernel_rows, conv_rows, depthwise_rows, results = [], [], [], [], {}
    for name, shape in CASES:
        if args.only and name != args.only:
            continue
        model = ROOT / "examples" / "models" / f"{name}.onnx"
        key = f"{name} {shape.split(':')[1]}"
        report = api.bench_model(model, args.config, [shape], repeat=args.repeat, tuning_log=False,
                                 progress=lambda m, k=key: print(f"[{k}] {m}", flush=True), peers=peers)
        timed, failure = run_in_worker(_time_kernels_in_worker,
                                       (str(model), args.config, shape, report.threads, args.kernel_runs), KERNEL_TIMEOUT_S)
        if failure:
            raise SystemExit(f"{key}: timing its kernels failed: {failure}")
        kernels = timed["kernels"]
        for kernel in kernels:
            kernel["percent_of_fma_peak"] = (None if kernel["gflops"] is None
                                             else 100 * kernel["gflops"] / report.peak.gflops)
            if kernel["rule"].startswith("Depthwise"):
                kernel.update(_against_l2(kernel, report.peak))
        convs = [k for k in kernels if "conv" in k["kernel"] and k["gflops"] is not None]
        results[key] = {**report.to_json(), "slowest_kernels": kernels[:SLOWEST], "conv_kernels": convs}
        ratios = report.ratios()
        medians = report.medians_ms
        rows.append([key, report.threads, medians["onnxruntime"],
                     *([medians["openvino"], f"{medians['openvino_default']:.3f} "
                        f"({report.peer_precision['openvino_default']})"] if openvino else []),
                     medians["stock_tvm"], medians["tvm_fusion"], ratios["tvm_fusion"],
                     *([medians["tvm_fusion"] / medians["openvino"]] if openvino else []),
                     medians["stock_tvm"] / medians["tvm_fusion"], report.max_abs_error["tvm_fusion"],
                     *([report.max_abs_error["openvino_default"]] if openvino else [])])
        for kernel in kernels[:SLOWEST]:
            kernel_rows.append([key, kernel["kernel"][:60], kernel["rule"], kernel["calls"], kernel["ms"],
                                *_rate(kernel)])
        for kernel in convs:
            conv_rows.append([key, kernel["kernel"][:60], kernel["rule"], kernel["calls"], kernel["ms"],
                              *_rate(kernel)])
            if "percent_of_l2_bandwidth" in kernel:
                depthwise_rows.append([key, kernel["kernel"][:60], kernel["ms"], round(kernel["gbytes_per_s"], 1),
                                       round(kernel["percent_of_l2_bandwidth"], 1), round(kernel["gflops"], 1),
                                       round(kernel["percent_of_l2_roof"], 1)])
    print(table(["model input", "threads", "ORT ms", *(["OpenVINO f32 ms", "OpenVINO default ms"] if openvino else []),
                 "stock TVM ms", "tvm_fusion ms", "tvm_fusion/ORT", *(["tvm_fusion/OpenVINO f32"] if openvino else []),
                 "speed-up vs stock", "max abs err", *(["OpenVINO default max abs err"] if openvino else [])], rows))
    if results:
        peak = report.peak
        print(f"\nthis machine ({peak.target_key}, {peak.threads} threads): {peak.gflops:.0f} GFLOP/s FMA peak, "
              f"{peak.gbytes_per_s:.1f} GB/s triad, {peak.l2_gbytes_per_s:.1f} GB/s L2")
    print()
    print(table(["model input", "conv kernels", "rule", "calls", "ms per call", "GFLOP/s (Winograd: direct-conv equivalent)",
                 "% of FMA peak"],
                conv_rows))
    print()
    print(table(["model input", "depthwise kernels", "ms per call", "GB/s", "% of L2 bandwidth", "GFLOP/s",
                 "% of L2 roof"], depthwise_rows))
    print()
    print(table(["model input", "slowest kernels (time x calls)", "rule", "calls", "ms per call", "GFLOP/s",
                 "% of FMA peak"], kernel_rows))
    write_json(args.out, results)


def _against_l2(kernel: dict, peak) -> dict:
    """A depthwise kernel against the L2 roofline: its tasks read rows just brought into cache,
    so L2, not DRAM, bounds its memory side; with 9-25 multiply-adds per value read, the FMA
    peak is often the lower roof (3x3: 2.25 FLOP per byte moved, above Zen 1's L2 ridge)."""
    intensity = kernel["flops"] / kernel["bytes"]
    roof = min(peak.gflops, intensity * peak.l2_gbytes_per_s)
    return {"percent_of_l2_bandwidth": 100 * kernel["gbytes_per_s"] / peak.l2_gbytes_per_s,
            "percent_of_l2_roof": 100 * kernel["gflops"] / roof}


def _rate(kernel: dict) -> list:
    if kernel["gflops"] is None:
        return ["-", "-"]
    return [round(kernel["gflops"], 1), round(kernel["percent_of_fma_peak"], 1)]


if __name__ == "__main__":
    main()
