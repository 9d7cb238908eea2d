"""``tvm-fusion``: argument parsing only; the work is done by tvm_fusion.api."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from pathlib import Path

from .errors import ConfigError, TvmFusionError
from .peers import PEERS


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


def _shape_args(parser: argparse.ArgumentParser, several_configs: bool = False) -> None:
    if several_configs:
        parser.add_argument("--config", action="append", default=[],
                            help="pipeline config TOML, one per target (repeatable; default: "
                                 "configs/x86_64-host.toml)")
    else:
        parser.add_argument("--config", help="pipeline config TOML (default: configs/x86_64-host.toml)")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME:DIMxDIM",
                        help="shape for an input, e.g. input_ids:1x128; a dim given as a range "
                             "LOW..HIGH (input_ids:1x1..512) is compiled once for every size in it "
                             "(repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvm-fusion", description=__doc__)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    commands = parser.add_subparsers(dest="command", required=True)

    compile_cmd = commands.add_parser("compile", help="ONNX -> fused, scheduled, verified library")
    compile_cmd.add_argument("model")
    _shape_args(compile_cmd, several_configs=True)
    compile_cmd.add_argument("-o", "--output-dir", default="build", help="default: build/")
    compile_cmd.add_argument("--no-verify", action="store_true",
                             help="skip the comparison with ONNX Runtime")
    compile_cmd.add_argument("--no-fusion-gate", action="store_true",
                             help="do not check each fusion against its unfused nodes")
    _tuning_log_args(compile_cmd)

    run_cmd = commands.add_parser("run", help="run a built artifact directory")
    run_cmd.add_argument("artifact", help="build/<model>.<target>/")
    run_cmd.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    run_cmd.add_argument("--fill", choices=["random", "zeros"],
                         help="generate inputs not given with --input")
    run_cmd.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                         help="with --fill, the size of a dim the artifact takes a range of "
                              "(e.g. sequence=64; default: the size the given inputs have)")
    run_cmd.add_argument("--repeat", type=_count(1), default=1, help="run N times, report median latency")
    run_cmd.add_argument("--save", metavar="DIR", help="write each output to DIR/<name>.npy")

    inspect_cmd = commands.add_parser("inspect", help="op counts before/after fusion, fusions fired")
    inspect_cmd.add_argument("model")
    _shape_args(inspect_cmd)
    inspect_cmd.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect_cmd.add_argument("--graph", metavar="FILE.svg|FILE.png|FILE.html",
                             help="also draw the fused graph, one box per fusion (.html: zoom and search)")
    inspect_cmd.add_argument("--onnx", metavar="FILE.onnx",
                             help="also write the fused graph as ONNX, each fusion one tvm_fusion-domain node")
    inspect_cmd.add_argument("--check", action="store_true",
                             help="with --onnx: run the fused graph under onnx.reference against ONNX Runtime")

    bench_cmd = commands.add_parser("bench", help="ONNX Runtime vs stock TVM vs tvm_fusion")
    bench_cmd.add_argument("model")
    _shape_args(bench_cmd)
    bench_cmd.add_argument("--repeat", type=_count(1), default=30)
    bench_cmd.add_argument("--warmup", type=_count(0), default=3)
    bench_cmd.add_argument("--no-stock", action="store_true", help="skip stock TVM (it is slow)")
    bench_cmd.add_argument("--peer", action="append", default=[], choices=PEERS,
                           help="also time this engine in the same rounds (f32; needs the peers extra: "
                                "pip install 'tvm_fusion[peers]'); repeatable")
    bench_cmd.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    _tuning_log_args(bench_cmd)

    profile_cmd = commands.add_parser("profile", help="per-kernel time, FLOPs, bytes, roofline; the gap to "
                                                      "end to end; --mine: unfused chains worth a pattern")
    profile_cmd.add_argument("model")
    _shape_args(profile_cmd)
    profile_cmd.add_argument("--rounds", type=_count(1), default=30)
    profile_cmd.add_argument("--top", type=_count(1), default=15, help="kernels in the table (default 15)")
    profile_cmd.add_argument("--mine", action="store_true", help="rank adjacent unfused kernel chains")
    profile_cmd.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    profile_cmd.add_argument("--plot", metavar="FILE.svg|png", help="roofline and top kernels chart")
    _tuning_log_args(profile_cmd)

    ablate_cmd = commands.add_parser("ablate", help="latency with each fired pattern switched off in turn")
    ablate_cmd.add_argument("model")
    _shape_args(ablate_cmd)
    ablate_cmd.add_argument("--rounds", type=_count(1), default=30)
    ablate_cmd.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    _tuning_parsers(commands)
    return parser


def _tuning_log_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tuning-log", metavar="DIR",
                       help="tuning-log root with <target-key>/ stores (default: the config's [tuning] "
                            "log_dir, tuning_logs/ for the bundled config)")
    group.add_argument("--no-tuning-log", action="store_true", help="hand schedules only")


def _tuning_log_choice(args):
    return False if args.no_tuning_log else args.tuning_log


def _tracker(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT, e.g. 127.0.0.1:9190")
    return host, int(port)


def _tuning_parsers(commands) -> None:
    tune_cmd = commands.add_parser("tune", help="MetaSchedule-tune the fused kernels into the tuning log")
    tune_cmd.add_argument("model")
    _shape_args(tune_cmd)
    tune_cmd.add_argument("--trials", type=_count(1), help="total trials, counting those already in the log "
                                                            "(default: config [tuning] trials)")
    tune_cmd.add_argument("--per-task-trials", type=_count(1), help="cap per kernel (default: config)")
    tune_cmd.add_argument("--trials-per-iter", type=_count(1), help="candidates per batch (default: config)")
    tune_cmd.add_argument("--time-limit", type=float, metavar="SECONDS",
                          help="start no new batch after this long (default: config; 0 = none)")
    tune_cmd.add_argument("--tuning-log", metavar="DIR", help="log root (default: the config's [tuning] log_dir)")
    tune_cmd.add_argument("--rpc-tracker", type=_tracker, metavar="HOST:PORT",
                          help="measure on the RPC servers registered with this TVM tracker")
    tune_cmd.add_argument("--rpc-key", help="the servers' key at the tracker (with --rpc-tracker)")
    tune_cmd.add_argument("--seed", type=int, default=0)

    log_cmd = commands.add_parser("tuning-log", help="show, merge, prune or diff tuning logs")
    actions = log_cmd.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="kernels, trials, best latency per store")
    show.add_argument("path", nargs="?", default="tuning_logs", help="store or log root (default: tuning_logs/)")
    show.add_argument("--json", action="store_true")
    merge = actions.add_parser("merge", help="combine logs, keeping the best records per kernel")
    merge.add_argument("sources", nargs="+", help="stores or log roots")
    merge.add_argument("-o", "--output", required=True, help="log root to write <target-key>/ stores into")
    merge.add_argument("--keep", type=_count(1), default=1, help="records kept per kernel (default 1)")
    prune = actions.add_parser("prune", help="drop records compile would never use")
    prune.add_argument("path", help="store or log root")
    prune.add_argument("--keep", type=_count(1), default=1, help="records kept per kernel (default 1)")
    diff = actions.add_parser("diff", help="best latency per kernel in two stores")
    diff.add_argument("a")
    diff.add_argument("b")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so that the same cleanup runs (staging removed)."""


def _raise_terminated(_signum, _frame):
    raise Terminated


@contextlib.contextmanager
def _sigterm_as_interrupt():
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = _progress(not args.quiet)
    try:
        with _sigterm_as_interrupt():
            return COMMANDS[args.command](args, say)
    except TvmFusionError as err:
        print(f"tvm-fusion: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as interrupt:
        how, code = ("terminated", 143) if isinstance(interrupt, Terminated) else ("interrupted", 130)
        print(f"tvm-fusion: {how}; nothing partial was written", file=sys.stderr)
        return code


def _compile(args, say) -> int:
    from .api import compile_model
    from .report import table
    from .verify import format_comparisons

    if len(args.config) > 1:
        return _compile_targets(args, say)
    result = compile_model(args.model, args.config[0] if args.config else None, args.input_shape,
                           args.output_dir, verify=not args.no_verify, progress=say,
                           tuning_log=_tuning_log_choice(args), fusion_gate=not args.no_fusion_gate)
    meta = result.metadata
    fused = [[name, count] for name, count in meta["fusions"].items() if "." not in name]
    print(f"artifact: {result.artifact}")
    print(table(["pattern", "fired"], fused) if fused else "no fusion pattern fired")
    print(f"kernels per call: {meta['kernels']}")
    if meta.get("fusion_gate"):
        gate = meta["fusion_gate"]
        print(f"fusion gate: {gate['checked']} fused instance(s) checked against their unfused nodes, "
              f"{len(gate['undone'])} undone")
        if gate["undone"]:
            print(table(["undone", "ONNX nodes", "max abs error", "allowed"],
                        [[u["variant"], ", ".join(u["onnx_nodes"] or u["bindings"]), u["max_abs_error"],
                          u["allowed"]] for u in gate["undone"]]))
    if meta.get("tuning"):
        tuning = meta["tuning"]
        tuned, hand = tuning["tuned_kernels"], tuning["hand_schedule_measured_fastest"]
        print(f"tuning log {tuning['log']}: {len(tuned)} kernel(s) tuned{': ' + ', '.join(tuned) if tuned else ''}"
              f"; {len(hand)} kept the hand schedule (measured fastest)")
    if result.comparisons:
        print(format_comparisons(result.comparisons, meta["verification"]["rtol"],
                                 meta["verification"]["atol"]))
    elif meta["verification"] is None:
        print("verification: skipped (--no-verify)")
    else:
        print(f"verification: NOT RUN: {meta['verification']['reason']}")
    return 0


def _compile_targets(args, say) -> int:
    """Every target in one go; a failed target is reported and the exit is non-zero at the end."""
    from .api import compile_targets
    from .report import table

    results = compile_targets(args.model, args.config, args.input_shape, args.output_dir,
                              verify=not args.no_verify, progress=say, tuning_log=_tuning_log_choice(args),
                              fusion_gate=not args.no_fusion_gate)
    built = [r for r in results if r.error is None]
    if built:
        fused = [[name, count] for name, count in built[0].metadata["fusions"].items() if "." not in name]
        print(table(["pattern", "fired"], fused) if fused else "no fusion pattern fired")
    rows = [[r.target, str(r.artifact) if r.artifact else "-",
             r.metadata.get("platform", {}).get("arch", "-") if r.metadata else "-",
             r.verification if r.error is None else "FAILED"] for r in results]
    print(table(["target", "artifact", "arch", "verification"], rows))
    for result in results:
        if result.error is not None:
            print(f"tvm-fusion: error: target {result.target}: {result.error}", file=sys.stderr)
    failed = [r.error for r in results if r.error is not None]
    return failed[0].exit_code if failed else 0


def _run(args, say) -> int:
    import numpy as np

    from .errors import ArtifactError
    from .runtime import check_save_dir, load, read_input, save_outputs

    if args.save:
        check_save_dir(args.save)
    model = load(args.artifact)
    given = {}
    for item in args.input:
        name, sep, path = item.partition("=")
        if not sep:
            raise ArtifactError(f"--input {item!r} is not NAME=FILE.npy", "e.g. --input x=x.npy")
        given[name] = read_input(name, path)
    rng = np.random.default_rng(0)
    sizes = model.dim_sizes(given, args.dim) if args.fill else {}
    for spec in model.inputs:
        if spec["name"] in given or not args.fill:
            continue
        shape = [sizes[d] if isinstance(d, str) else d for d in spec["shape"]]
        if args.fill == "zeros":
            given[spec["name"]] = np.zeros(shape, spec["dtype"])
        elif spec["dtype"].startswith(("float", "bfloat")):
            given[spec["name"]] = rng.standard_normal(shape).astype(spec["dtype"])
        else:
            given[spec["name"]] = rng.integers(0, 2, shape).astype(spec["dtype"])
    tensors = model.prepare(given)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        model.run_prepared(tensors)
        times.append(time.perf_counter() - start)
    outputs = model.run(given)
    if args.save:
        save_outputs(outputs, args.save)
    for name, value in outputs.items():
        print(f"{name}: shape {list(value.shape)} dtype {value.dtype} "
              f"mean {float(np.mean(value)):.6g} std {float(np.std(value)):.6g}")
    if args.repeat > 1:
        print(f"median latency over {args.repeat} runs: {np.median(times) * 1e3:.3f} ms")
    return 0


def _inspect(args, say) -> int:
    from .api import export_fused_onnx, inspect_model
    from .report import table

    if args.check and not args.onnx:
        raise ConfigError("--check verifies the fused ONNX file, and no --onnx was given", "add --onnx FILE.onnx")
    result = inspect_model(args.model, args.config, args.input_shape, graph=args.graph)
    exported = (export_fused_onnx(args.model, args.config, args.input_shape, args.onnx, check=args.check)
                if args.onnx else None)
    if args.json:
        print(json.dumps({**result.to_json(), **({"fused_onnx": exported.to_json()} if exported else {})},
                         indent=2))
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
    if result.instances:
        print("\n" + table(["fused", "ONNX nodes absorbed"],
                           [[i.variant, ", ".join(i.nodes) or "-"] for i in result.instances]))
    coverage = result.coverage
    targets = sorted(coverage.targeted)
    print(f"\ncoverage: {coverage.fused_compute_nodes} of {coverage.compute_nodes} ONNX compute nodes "
          f"({coverage.compute_share:.0%}) run in kernels our fusions built; "
          f"{sum(coverage.fused.values())} of {sum(coverage.targeted.values())} targeted chains fused "
          f"({coverage.targeted_share:.0%})")
    if targets:
        print(table(["targeted chain", "found", "fused"],
                    [[t, coverage.targeted[t], coverage.fused.get(t, 0)] for t in targets]))
    if coverage.unfused:
        print("\nchains left unfused:")
        print(table(["chain", "ONNX nodes", "why"],
                    [[u.target, ", ".join(u.nodes), u.reason] for u in coverage.unfused]))
    if result.report.near_misses:
        print("\nnear misses (matched, but the check declined):")
        print(table(["pattern", "where", "reason"],
                    [[m.pattern, m.where, m.reason] for m in result.report.near_misses]))
    ops = sorted(set(result.relax_ops) | set(result.fused_ops),
                 key=lambda op: -result.relax_ops.get(op, 0))
    print("\n" + table(["Relax op / composite", "before", "after"],
                       [[op, result.relax_ops.get(op, 0), result.fused_ops.get(op, 0)] for op in ops]))
    if args.graph:
        print(f"\nfused graph drawn: {args.graph}")
    if exported:
        _print_fused_onnx(exported)
    return 0


def _print_fused_onnx(exported) -> None:
    from .report import table
    from .verify import format_comparisons

    ops = ", ".join(f"{count} {op}" for op, count in exported.fused_ops.items()) or "no fused node"
    print(f"\nfused ONNX graph: {exported.path} ({ops})")
    if exported.kept:
        print(table(["kept as ONNX nodes", "ONNX nodes", "why"],
                    [[k.variant, ", ".join(k.nodes), k.reason] for k in exported.kept]))
    if exported.comparisons is not None:
        print("onnx.reference (tvm_fusion ops) vs ONNX Runtime:")
        print(format_comparisons(exported.comparisons, exported.rtol, exported.atol))


def _bench(args, say) -> int:
    from .api import bench_model
    from .files import check_writable
    from .report import table, write_json

    if args.json:
        check_writable(Path(args.json).parent, "--json results", "--json")
    result = bench_model(args.model, args.config, args.input_shape, repeat=args.repeat,
                         warmup=args.warmup, include_stock=not args.no_stock,
                         tuning_log=_tuning_log_choice(args), progress=say, peers=tuple(args.peer))
    ratios = result.ratios()
    shapes = ", ".join(f"{k}:{'x'.join(map(str, v))}" for k, v in result.inputs.items())
    print(f"model {result.model} ({shapes}), {result.threads} threads, median of {result.samples} "
          "interleaved runs")
    rows = [[name, result.medians_ms[name], ratios[name], result.max_abs_error.get(name, 0.0)]
            for name in result.medians_ms]
    print(table(["runtime", "median ms", "x ONNX Runtime", "max abs err vs ORT"], rows, "lrrr"))
    peak = result.peak
    print(f"this machine ({peak.target_key}): {peak.gflops:.0f} GFLOP/s FMA peak, "
          f"{peak.gbytes_per_s:.1f} GB/s triad (probed {peak.probed_at})")
    if args.json:
        write_json(args.json, result.to_json())
    return 0


def _tune(args, say) -> int:
    from .report import table
    from .tuning.tune import RpcSettings, tune_model

    rpc = None
    if args.rpc_tracker or args.rpc_key:
        if not (args.rpc_tracker and args.rpc_key):
            raise TvmFusionError("--rpc-tracker and --rpc-key go together",
                                 "pass both, e.g. --rpc-tracker 127.0.0.1:9190 --rpc-key myboard")
        rpc = RpcSettings(args.rpc_tracker[0], args.rpc_tracker[1], args.rpc_key)
    result = tune_model(args.model, args.config, args.input_shape, trials=args.trials,
                        per_task_trials=args.per_task_trials, time_limit_s=args.time_limit,
                        trials_per_iter=args.trials_per_iter, log_dir=args.tuning_log, rpc=rpc,
                        seed=args.seed, show_progress=not args.quiet, say=say)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    rows = [[t.name, t.weight, t.trials_before, t.trials_run, t.hand_us if t.hand_us is not None else "-",
             t.best_us if t.best_us is not None else "-",
             t.hand_us / t.best_us if t.hand_us and t.best_us else "-"] for t in result.tasks]
    print(table(["kernel", "calls", "trials before", "trials now", "hand us", "best us", "speed-up"], rows,
                "lrrrrrr"))
    if result.excluded:
        print("excluded (hand schedules): " + ", ".join(f"{k} ({p})" for k, p in sorted(result.excluded.items())))
    print(f"{result.trials_run} trials in {result.wall_s:.0f} s ({result.trials_before + result.trials_run}"
          f" of {result.budget} in the log); stopped: {result.stopped_by}")
    print(f"tuning log: {result.store}")
    return 130 if result.stopped_by == "interrupted" else 0


def _tuning_log(args, say) -> int:
    from .report import table
    from .tuning import logs

    if args.action == "show":
        rows, notes = logs.show(args.path)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        if args.json:
            import dataclasses

            print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
            return 0
        print(table(["store", "kernel", "models", "trials", "failed", "best us", "hand us", "status"],
                    [[Path(r.store).name, r.kernel, ",".join(r.models), r.trials, r.failed,
                      r.best_us if r.best_us is not None else "-", r.hand_us if r.hand_us is not None else "-",
                      r.status] for r in rows], "lllrrrrl"))
    elif args.action == "merge":
        report = logs.merge(args.sources, args.output, keep=args.keep)
        for problem in report.problems:
            print(f"note: {problem}", file=sys.stderr)
        print(table(["store", "records kept"], [[k, v] for k, v in report.written.items()]))
        print(f"{report.read} good records read")
    elif args.action == "prune":
        for report in logs.prune(args.path, keep=args.keep):
            dropped = ", ".join(f"{n} {why}" for why, n in report.dropped.items()) or "nothing"
            print(f"{report.directory}: kept {report.kept}, dropped {dropped}")
    else:
        rows = logs.diff(args.a, args.b)
        print(table(["kernel", "A best us", "B best us", "A/B", "A trials", "B trials"],
                    [[r.kernel, r.best_a_us if r.best_a_us is not None else "-",
                      r.best_b_us if r.best_b_us is not None else "-",
                      r.speedup if r.speedup is not None else "-", r.trials_a, r.trials_b] for r in rows],
                    "lrrrrr"))
    return 0


def _profile(args, say) -> int:
    from .api import profile_model
    from .files import check_writable
    from .profile_plot import check_plot_path, plot_profile
    from .report import table, write_json

    if args.plot:
        check_plot_path(args.plot)
    if args.json:
        check_writable(Path(args.json).resolve().parent, f"the JSON file {args.json}", "--json")
    result = profile_model(args.model, args.config, args.input_shape, rounds=args.rounds, mine=args.mine,
                           progress=say, tuning_log=_tuning_log_choice(args))
    peak = result.peak
    print(f"model: {result.model}, {result.threads} threads; this machine ({peak.target_key}): "
          f"{peak.gflops:.0f} GFLOP/s FMA peak, {peak.gbytes_per_s:.1f} GB/s triad, ridge {peak.ridge:.1f} FLOP/B")
    rows = [[k.name[:48], k.pattern, k.rule, k.calls, k.us_per_call, k.us_in_model, f"{100 * k.share:.1f}",
             k.flops / 1e6, k.bytes / 1e6, k.gflops, k.gbytes_per_s, f"{k.bound} {k.roof_percent:.0f}%",
             ", ".join(k.onnx_nodes[-2:]) + (f" (+{len(k.onnx_nodes) - 2})" if len(k.onnx_nodes) > 2 else "")]
            for k in result.kernels[:args.top]]
    print(table(["kernel", "pattern", "rule", "calls", "us/call", "us in model", "%", "MFLOP", "MB",
                 "GFLOP/s", "GB/s", "bound, % of roof", "ONNX nodes (last 2)"], rows, align="lllrrrrrrrrll"))
    if len(result.kernels) > args.top:
        print(f"... {len(result.kernels) - args.top} more kernels (--top, --json)")
    print(result.gap.line())
    if result.chains is not None:
        print("\nunfused chains of adjacent kernels (candidates for the next pattern):")
        print(table(["chain", "us", "DRAM bytes saved", "est. gain us", "kernels"],
                    [[c.label, c.us, c.saved_bytes, c.gain_us, " -> ".join(n[:40] for n in c.kernels)]
                     for c in result.chains], align="lrrrl") if result.chains else "none")
    if args.json:
        write_json(args.json, result.to_json())
    if args.plot:
        plot_profile(result, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _ablate(args, say) -> int:
    from .api import ablate_model
    from .files import check_writable
    from .report import table, write_json

    if args.json:
        check_writable(Path(args.json).resolve().parent, f"the JSON file {args.json}", "--json")
    result = ablate_model(args.model, args.config, args.input_shape, rounds=args.rounds, progress=say)
    full = result.full.median_ms
    print(table(["variant", "kernels", "median ms", "vs all patterns"],
                [[v.name, v.kernels, v.median_ms, "-" if v is result.full else f"{v.worth(full):+.0f} %"]
                 for v in result.variants], align="lrrr"))
    print("\n".join(result.lines()))
    if result.not_fired:
        print(f"did not fire on this model: {', '.join(result.not_fired)}")
    if args.json:
        write_json(args.json, result.to_json())
    return 0


COMMANDS = {"compile": _compile, "run": _run, "inspect": _inspect, "bench": _bench, "tune": _tune,
            "tuning-log": _tuning_log, "profile": _profile, "ablate": _ablate}

if __name__ == "__main__":
    sys.exit(main())
