"""A blocked 3x3 conv + bias + SiLU kernel alone: the direct conv against Winograd F(2x2, 3x3)
and F(4x4, 3x3), on the maps ``winograd_tile`` chooses between (odd ones included).

Per case the three kernels are scheduled by their rules (Conv2dNCHWc, WinogradConv2dNCHWc with
the weight transformed at build time, as compile does), checked against each other, then timed
in interleaved rounds in one process at the host's vector width and 2 threads; medians.
Writes benchmarks/results/winograd.json (atomically).

    .venv/bin/python benchmarks/bench_winograd.py [--rounds 9] [--case 64,64,7,7 ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import tvm
from tvm import te, topi
from tvm.target import Target

from tvm_fusion.config import host_cpu_name
from tvm_fusion.passes.blocked_layout_legalize import _conv2d_nchwc
from tvm_fusion.passes.precompute_winograd_weights import _weight_as_parameter, _weight_block
from tvm_fusion.kernels.winograd_conv2d import weight_transform, winograd_conv2d_nchwc, winograd_tile
from tvm_fusion.report import table, write_json
from tvm_fusion.runtime import set_threads
from tvm_fusion.schedules.cpu import Conv2dNCHWc, WinogradConv2dNCHWc
from tvm_fusion.targets.target_info import vector_lanes

ROOT = Path(__file__).resolve().parent.parent
# (input channels, output channels, rows, columns), stride 1, pad 1: ResNet's 7x7 and 14x14
# stages, YOLO's 26x26 at 416, rows no tile divides, maps a few rows high, one row.
CASES = [(64, 64, 7, 7), (256, 256, 14, 14), (96, 96, 26, 26), (64, 64, 10, 14), (128, 128, 3, 40),
         (256, 256, 3, 3), (64, 64, 2, 40), (64, 64, 1, 40), (256, 256, 1, 64)]
THREADS = 2


def build_variants(case, block: int, target: Target) -> dict:
    """{"direct" | "F(2x2)" | "F(4x4)": (compiled kernel, its weight transform tile or None)}."""
    in_channels, out_channels, rows, columns = case
    data = te.placeholder((1, in_channels // block, rows, columns, block), name="data")
    kernel = te.placeholder((out_channels // block, in_channels // block, 3, 3, block, block), name="kernel")
    bias = te.placeholder((1, out_channels // block, 1, 1, block), name="bias")

    def silu_of(conv):
        value = topi.add(conv, bias)
        return topi.multiply(value, topi.sigmoid(value))

    direct = te.create_prim_func([data, kernel, bias, silu_of(
        _conv2d_nchwc(data, kernel, (1, 1), (1, 1, 1, 1), (1, 1), None))])
    variants = {"direct": (Conv2dNCHWc().apply(direct, target, False), None)}
    for tile in (2, 4):
        func = te.create_prim_func([data, kernel, bias, silu_of(winograd_conv2d_nchwc(data, kernel, (1, 1, 1, 1), tile))])
        precomputed = _weight_as_parameter(func, _weight_block(func))
        variants[f"F({tile}x{tile})"] = (WinogradConv2dNCHWc().apply(precomputed, target, False), tile)
    return {name: (tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target), tile)
            for name, (sch, tile) in variants.items()}


def measure(case, block: int, target: Target, rounds: int) -> dict:
    in_channels, out_channels, rows, columns = case
    rng = np.random.default_rng(0)
    data = rng.standard_normal((1, in_channels // block, rows, columns, block)).astype("float32")
    weight = (rng.standard_normal((out_channels // block, in_channels // block, 3, 3, block, block))
              / np.sqrt(9 * in_channels)).astype("float32")
    bias = rng.standard_normal((1, out_channels // block, 1, 1, block)).astype("float32")
    runs, outputs, times = {}, {}, {}
    for name, (lib, tile) in build_variants(case, block, target).items():
        args = [tvm.runtime.tensor(value) for value in
                (data, weight if tile is None else weight_transform(weight, tile), bias,
                 np.zeros((1, out_channels // block, rows, columns, block), "float32"))]
        lib["main"](*args)
        outputs[name], runs[name], times[name] = args[-1].numpy(), (lib, args), []
    for _ in range(rounds):
        for name, (lib, args) in runs.items():
            times[name] += lib.mod.time_evaluator("main", tvm.cpu(), number=5, repeat=3)(*args).results
    medians = {name: float(np.median(values)) * 1e6 for name, values in times.items()}
    picked = winograd_tile((3, 3), (1, 1), (1, 1), 1, (1, in_channels // block, rows, columns, block),
                           (1, out_channels // block, rows, columns, block), "float32")
    return {"case": f"{in_channels}->{out_channels} over {rows}x{columns}", "direct_us": medians["direct"],
            "f2_us": medians["F(2x2)"], "f4_us": medians["F(4x4)"],
            "picked": f"F({picked}x{picked})" if picked else "direct",
            "max_abs_vs_direct": float(max(np.abs(out - outputs["direct"]).max() for out in outputs.values()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--case", action="append", metavar="IC,OC,ROWS,COLUMNS",
                        help="a conv to time instead of the default cases (repeatable)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "winograd.json"))
    args = parser.parse_args()
    cases = [tuple(int(v) for v in case.split(",")) for case in args.case] if args.case else CASES
    target = Target({"kind": "llvm", "mcpu": host_cpu_name(), "num-cores": THREADS})
    block = vector_lanes(target, "float32")
    set_threads(THREADS)
    results = []
    for case in cases:
        if case[0] % block or case[1] % block:
            parser.error(f"--case {case}: channels must be multiples of the vector width {block}")
        results.append(measure(case, block, target, args.rounds))
        print(f"[winograd] {results[-1]['case']} done", flush=True)
    print(table(["conv", "direct us", "F(2x2) us", "F(4x4) us", "picked", "max abs vs direct"],
                [[r["case"], round(r["direct_us"], 1), round(r["f2_us"], 1), round(r["f4_us"], 1), r["picked"],
                  f"{r['max_abs_vs_direct']:.1e}"] for r in results]))
    write_json(args.out, {"target": str(target), "threads": THREADS, "results": results})


if __name__ == "__main__":
    main()
