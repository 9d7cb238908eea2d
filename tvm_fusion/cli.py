"""``tvm-fusion``: argument parsing only; the work is done by tvm_fusion.api."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .errors import TvmFusionError


def _progress(verbose: bool):
    started = time.perf_counter()

    def say(message: str) -> None:
        if verbose:
            print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    return say


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="pipeline config TOML (default: configs/x86_64-host.toml)")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME:DIMxDIM",
                        help="static shape for an input, e.g. input_ids:1x128 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvm-fusion", description=__doc__)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    commands = parser.add_subparsers(dest="command", required=True)

    compile_cmd = commands.add_parser("compile", help="ONNX -> fused, scheduled, verified library")
    compile_cmd.add_argument("model")
    _shape_args(compile_cmd)
    compile_cmd.add_argument("-o", "--output-dir", default="build", help="default: build/")
    compile_cmd.add_argument("--no-verify", action="store_true",
                             help="skip the comparison with ONNX Runtime")

    run_cmd = commands.add_parser("run", help="run a built artifact directory")
    run_cmd.add_argument("artifact", help="build/<model>.<target>/")
    run_cmd.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    run_cmd.add_argument("--fill", choices=["random", "zeros"],
                         help="generate inputs not given with --input")
    run_cmd.add_argument("--repeat", type=_count(1), default=1, help="run N times, report median latency")
    run_cmd.add_argument("--save", metavar="DIR", help="write each output to DIR/<name>.npy")

    inspect_cmd = commands.add_parser("inspect", help="op counts before/after fusion, fusions fired")
    inspect_cmd.add_argument("model")
    _shape_args(inspect_cmd)
    inspect_cmd.add_argument("--json", action="store_true", help="print JSON instead of tables")

    bench_cmd = commands.add_parser("bench", help="ONNX Runtime vs stock TVM vs tvm_fusion")
    bench_cmd.add_argument("model")
    _shape_args(bench_cmd)
    bench_cmd.add_argument("--repeat", type=_count(1), default=30)
    bench_cmd.add_argument("--warmup", type=_count(0), default=3)
    bench_cmd.add_argument("--no-stock", action="store_true", help="skip stock TVM (it is slow)")
    bench_cmd.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = _progress(not args.quiet)
    try:
        return COMMANDS[args.command](args, say)
    except TvmFusionError as err:
        print(f"tvm-fusion: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("tvm-fusion: interrupted; nothing partial was written", file=sys.stderr)
        return 130


def _compile(args, say) -> int:
    from .api import compile_model
    from .report import table
    from .verify import format_comparisons

    result = compile_model(args.model, args.config, args.input_shape, args.output_dir,
                           verify=not args.no_verify, progress=say)
    meta = result.metadata
    fused = [[name, count] for name, count in meta["fusions"].items() if "." not in name]
    print(f"artifact: {result.artifact}")
    print(table(["pattern", "fired"], fused) if fused else "no fusion pattern fired")
    print(f"kernels per call: {meta['kernels']}")
    if result.comparisons:
        print(format_comparisons(result.comparisons, meta["verification"]["rtol"],
                                 meta["verification"]["atol"]))
    else:
        print("verification: skipped (--no-verify)")
    return 0


def _run(args, say) -> int:
    import numpy as np

    from .errors import ArtifactError
    from .runtime import load

    model = load(args.artifact)
    given = {}
    for item in args.input:
        name, sep, path = item.partition("=")
        if not sep:
            raise ArtifactError(f"--input {item!r} is not NAME=FILE.npy", "e.g. --input x=x.npy")
        try:
            given[name] = np.load(path)
        except (OSError, ValueError) as err:
            raise ArtifactError(f"cannot read --input {name}={path}: {err}", "pass a .npy file") from err
    rng = np.random.default_rng(0)
    for spec in model.inputs:
        if spec["name"] in given or not args.fill:
            continue
        if args.fill == "zeros":
            given[spec["name"]] = np.zeros(spec["shape"], spec["dtype"])
        elif spec["dtype"].startswith("float"):
            given[spec["name"]] = rng.standard_normal(spec["shape"]).astype(spec["dtype"])
        else:
            given[spec["name"]] = rng.integers(0, 2, spec["shape"]).astype(spec["dtype"])
    tensors = model.prepare(given)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        model.run_prepared(tensors)
        times.append(time.perf_counter() - start)
    outputs = model.run(given)
    for name, value in outputs.items():
        print(f"{name}: shape {list(value.shape)} dtype {value.dtype} "
              f"mean {float(np.mean(value)):.6g} std {float(np.std(value)):.6g}")
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            final = Path(args.save) / f"{name}.npy"
            staging = final.with_name(f".{final.name}.tmp-{os.getpid()}.npy")
            np.save(staging, value)
            os.replace(staging, final)
    if args.repeat > 1:
        print(f"median latency over {args.repeat} runs: {np.median(times) * 1e3:.3f} ms")
    return 0


def _inspect(args, say) -> int:
    from .api import inspect_model
    from .report import table

    result = inspect_model(args.model, args.config, args.input_shape)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    print(f"model: {result.model}")
    print(f"ONNX nodes: {sum(result.onnx_ops.values())} as exported, "
          f"{sum(result.onnx_ops_simplified.values())} after shape simplification")
    print(f"kernels per call: tvm_fusion {result.kernels}, stock TVM FuseOps {result.stock_kernels}\n")
    fired = sorted(result.report.fired.items())
    rows = [[name, count] for name, count in fired if "." not in name]
    print(table(["pattern", "fired"], rows) if rows else "no pattern fired")
    variants = [[name, count] for name, count in fired if "." in name]
    if variants:
        print("\n" + table(["fused variant", "count"], variants))
    if result.report.near_misses:
        print("\nnear misses (matched, but the check declined):")
        print(table(["pattern", "where", "reason"],
                    [[m.pattern, m.where, m.reason] for m in result.report.near_misses]))
    ops = sorted(set(result.relax_ops) | set(result.fused_ops),
                 key=lambda op: -result.relax_ops.get(op, 0))
    print("\n" + table(["Relax op / composite", "before", "after"],
                       [[op, result.relax_ops.get(op, 0), result.fused_ops.get(op, 0)] for op in ops]))
    return 0


def _bench(args, say) -> int:
    from .api import bench_model
    from .report import table

    result = bench_model(args.model, args.config, args.input_shape, repeat=args.repeat,
                         warmup=args.warmup, include_stock=not args.no_stock, progress=say)
    ratios = result.ratios()
    shapes = ", ".join(f"{k}:{'x'.join(map(str, v))}" for k, v in result.inputs.items())
    print(f"model {result.model} ({shapes}), {result.threads} threads, median of {result.samples} "
          "interleaved runs")
    rows = [[name, result.medians_ms[name], ratios[name], result.max_abs_error.get(name, 0.0)]
            for name in result.medians_ms]
    print(table(["runtime", "median ms", "x ONNX Runtime", "max abs err vs ORT"], rows, "lrrr"))
    if args.json:
        final = Path(args.json)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        staging.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        os.replace(staging, final)
    return 0


COMMANDS = {"compile": _compile, "run": _run, "inspect": _inspect, "bench": _bench}

if __name__ == "__main__":
    sys.exit(main())
