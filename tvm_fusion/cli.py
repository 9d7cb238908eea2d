"""``tvm-fusion``: argument parsing only; the work is done by tvm_fusion.api, and what each
command prints is in tvm_fusion.cli_output."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

from . import bundled, cli_output
from .errors import ConfigError, ToolchainError, TvmFusionError
from .peers import PEERS


EPILOG = """examples:
  tvm-fusion demo                                     compile, verify and time the shipped BERT
  tvm-fusion compile model.onnx --input-shape input:1x3x224x224 -o build/
  tvm-fusion run build/model.x86_64-host --repeat 50
  tvm-fusion bench model.onnx --peer openvino --json results.json
  tvm-fusion compile model.onnx --config x86_64-avx2  (tvm-fusion configs lists the configs)

`tvm-fusion COMMAND -h` shows a command's flags."""


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from .metadata import versions

        print("\n".join(f"{name} {version}" for name, version in versions().items()))
        parser.exit()


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


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="pipeline config: a TOML file or a shipped config's name "
                                         "(`tvm-fusion configs` lists them; default: x86_64-host)")


def _shape_args(parser: argparse.ArgumentParser, several_configs: bool = False) -> None:
    if several_configs:
        parser.add_argument("--config", action="append", default=[],
                            help="pipeline config: a TOML file or a shipped config's name (x86_64-avx2; "
                                 "`tvm-fusion configs` lists them), one per target (repeatable; default: "
                                 "x86_64-host)")
    else:
        _config_arg(parser)
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME:DIMxDIM",
                        help="shape for an input, e.g. input_ids:1x128; a dim given as a range "
                             "LOW..HIGH (input_ids:1x1..512) is compiled once for every size in it "
                             "(repeatable)")
    parser.add_argument("--input-value", action="append", dest="input_shape", metavar="NAME=VALUE",
                        help="compile a one-element input for this value only, e.g. sr=16000 (an If on "
                             "it keeps one branch; the artifact refuses another value) (repeatable)")


def _json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="also write the results as JSON to FILE; '-' (or no FILE): print JSON to "
                             "stdout instead of the tables")


def _repeat_arg(parser: argparse.ArgumentParser, default: int, what: str) -> None:
    parser.add_argument("--repeat", "--rounds", dest="repeat", type=_count(1), default=default,
                        help=f"{what} (default: {default}; --rounds is the old name, kept for one release)")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default where it has one and its help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text
                or action.default in (None, [], False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: {action.default})".strip()


class _Parser(argparse.ArgumentParser):
    """Every subcommand takes ``-q`` too, so it may come after the command name."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        if kwargs.get("prog", "").startswith("tvm-fusion "):
            self.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                              help="no progress messages")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tvm-fusion", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Kernel fusion for Apache TVM: ONNX in, a fused, scheduled and verified library out.")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    parser.add_argument("--version", action=_Version, help="print the versions of tvm_fusion, TVM, onnx, "
                                                           "onnxruntime and this machine's target key")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    compile_cmd = commands.add_parser("compile", help="ONNX -> fused, scheduled, verified library")
    compile_cmd.add_argument("model")
    _shape_args(compile_cmd, several_configs=True)
    compile_cmd.add_argument("-o", "--output-dir", default="build", help="default: build/")
    compile_cmd.add_argument("--no-verify", action="store_true",
                             help="skip the comparison with ONNX Runtime")
    compile_cmd.add_argument("--no-fusion-gate", action="store_true",
                             help="do not check each fusion against its unfused nodes")
    compile_cmd.add_argument("--bucket", action="append", default=None, metavar="NAME=SIZE[,NAME=SIZE]",
                             help="with a range, also build static kernels for this exact size, used when "
                                  "an input has it (e.g. sequence=128; repeatable; replaces the config's "
                                  "[buckets] sizes)")
    _tuning_log_args(compile_cmd)

    run_cmd = commands.add_parser("run", help="run a built artifact directory")
    run_cmd.add_argument("artifact", help="build/<model>.<target>/")
    run_cmd.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                         help="an input from a .npy file (or a .npz holding an array NAME) (repeatable)")
    run_cmd.add_argument("--fill", choices=["random", "zeros"],
                         help="generate the inputs not given with --input (with no --input at all: random)")
    run_cmd.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                         help="with --fill, the size of a dim the artifact takes a range of "
                              "(e.g. sequence=64; default: the size the given inputs have)")
    run_cmd.add_argument("--repeat", type=_count(1), default=1, help="run N times, report the latency")
    run_cmd.add_argument("--save", metavar="DIR",
                         help="write the outputs to DIR/outputs.npz (by output name) and one .npy each "
                              "(names made file-safe; DIR/names.json maps them back)")

    inspect_cmd = commands.add_parser("inspect", help="op counts before/after fusion, fusions fired")
    inspect_cmd.add_argument("model")
    _shape_args(inspect_cmd)
    _json_arg(inspect_cmd)
    inspect_cmd.add_argument("--graph", metavar="FILE.svg|FILE.png|FILE.html",
                             help="also draw the fused graph, one box per fusion (.html: zoom and search)")
    inspect_cmd.add_argument("--onnx", metavar="FILE.onnx",
                             help="also write the fused graph as ONNX, each fusion one tvm_fusion-domain node")
    inspect_cmd.add_argument("--check", action="store_true",
                             help="with --onnx: run the fused graph under onnx.reference against ONNX Runtime")

    bench_cmd = commands.add_parser("bench", help="ONNX Runtime vs stock TVM vs tvm_fusion")
    bench_cmd.add_argument("model")
    _shape_args(bench_cmd)
    bench_cmd.add_argument("--repeat", type=_count(1), default=30, help="timed rounds, each runner once a round")
    bench_cmd.add_argument("--warmup", type=_count(0), default=3, help="untimed rounds first")
    bench_cmd.add_argument("--no-stock", action="store_true", help="skip stock TVM (it is slow)")
    bench_cmd.add_argument("--peer", action="append", default=[], choices=PEERS,
                           help="also time this engine in the same rounds (f32; needs the peers extra: "
                                "pip install 'tvm_fusion[peers]'); repeatable")
    _json_arg(bench_cmd)
    _tuning_log_args(bench_cmd)

    profile_cmd = commands.add_parser("profile", help="per-kernel time, FLOPs, bytes, roofline; the gap to "
                                                      "end to end; --mine: unfused chains worth a pattern")
    profile_cmd.add_argument("model", help="MODEL.onnx, or an artifact directory from compile "
                                           "(build/<model>.<target>/): the kernels it runs, built from "
                                           "the model, config, shapes and tuning log it names")
    _shape_args(profile_cmd)
    _repeat_arg(profile_cmd, 30, "timed rounds")
    profile_cmd.add_argument("--top", type=_count(1), default=15, help="kernels in the table (default 15)")
    profile_cmd.add_argument("--mine", action="store_true", help="rank adjacent unfused kernel chains")
    _json_arg(profile_cmd)
    profile_cmd.add_argument("--plot", metavar="FILE.svg|png", help="roofline and top kernels chart")
    _tuning_log_args(profile_cmd)

    ablate_cmd = commands.add_parser("ablate", help="latency with each fired pattern switched off in turn")
    ablate_cmd.add_argument("model")
    _shape_args(ablate_cmd)
    _repeat_arg(ablate_cmd, 30, "timed rounds")
    _json_arg(ablate_cmd)
    _tuning_parsers(commands)

    commands.add_parser("configs", help="list the shipped pipeline configs (--config NAME)")
    runner_cmd = commands.add_parser("export-runner", help="write the sources and CMake file of a runner that "
                                                           "runs an artifact with the TVM runtime alone (no Python)")
    runner_cmd.add_argument("directory", help="where to write vm_runner.cc, CMakeLists.txt and paths.cmake")
    serve_cmd = commands.add_parser("serve", help="serve an artifact over HTTP: the KServe v2 inference "
                                                  "protocol, Prometheus metrics (needs the serve extra)")
    serve_cmd.add_argument("artifact", help="build/<model>.<target>/")
    serve_cmd.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    serve_cmd.add_argument("--port", type=_count(1), default=8000, help="TCP port")
    serve_cmd.add_argument("--name", help="the model's name in the URLs (default: the model's)")
    serve_cmd.add_argument("--max-body-kb", type=_count(1), default=65536, help="largest request body accepted")
    serve_cmd.add_argument("--workers", type=_count(1), default=8, help="inference requests run at once")
    demo_cmd = commands.add_parser("demo", help="compile the shipped BERT example, verify it and time it "
                                                "against ONNX Runtime (no files of yours needed)")
    _config_arg(demo_cmd)
    demo_cmd.add_argument("-o", "--output-dir", default="build", help="default: build/")
    demo_cmd.add_argument("--repeat", type=_count(1), default=20, help="timed rounds against ONNX Runtime")
    return parser


def _tuning_log_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tuning-log", metavar="DIR",
                       help="tuning-log root with <target-key>/ stores (default: the config's [tuning] "
                            "log_dir, else your store ($TVM_FUSION_TUNING_LOGS or "
                            "~/.local/share/tvm_fusion/tuning_logs), then the logs shipped with tvm_fusion)")
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
    tune_cmd.add_argument("--tuning-log", metavar="DIR",
                          help="log root to write into (default: the config's [tuning] log_dir, else "
                               "$TVM_FUSION_TUNING_LOGS or ~/.local/share/tvm_fusion/tuning_logs)")
    tune_cmd.add_argument("--rpc-tracker", type=_tracker, metavar="HOST:PORT",
                          help="measure on the RPC servers registered with this TVM tracker")
    tune_cmd.add_argument("--rpc-key", help="the servers' key at the tracker (with --rpc-tracker)")
    tune_cmd.add_argument("--seed", type=int, default=0, help="MetaSchedule's search seed")

    log_cmd = commands.add_parser("tuning-log", help="show, merge, prune or diff tuning logs")
    actions = log_cmd.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="kernels, trials, best latency per store")
    show.add_argument("path", nargs="?", help="store or log root (default: your store, then the shipped logs)")
    _json_arg(show)
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
    except BrokenPipeError:  # `tvm-fusion ... | head`: the reader left; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _check_json_path(args) -> None:
    """Before the work: a --json FILE that could not be written is refused now."""
    from .files import check_writable

    if args.json not in (None, "-"):
        check_writable(Path(args.json).resolve().parent, f"the JSON file {args.json}", "--json")


def _report(args, print_tables, to_json) -> None:
    """The tables, and the JSON ``to_json()`` to --json FILE; with ``--json -`` the JSON alone, on stdout."""
    import json

    from .report import write_json

    if args.json == "-":
        print(json.dumps(to_json(), indent=2))
        return
    print_tables()
    if args.json:
        write_json(args.json, to_json())


def _compile(args, say) -> int:
    from .api import compile_model

    if len(args.config) > 1:
        return _compile_targets(args, say)
    result = compile_model(args.model, args.config[0] if args.config else None, args.input_shape,
                           args.output_dir, verify=not args.no_verify, progress=say,
                           tuning_log=_tuning_log_choice(args), fusion_gate=not args.no_fusion_gate,
                           buckets=args.bucket)
    cli_output.print_compile(result)
    return 0


def _compile_targets(args, say) -> int:
    """Every target in one go; a failed target is reported and the exit is non-zero at the end."""
    from .api import compile_targets

    results = compile_targets(args.model, args.config, args.input_shape, args.output_dir,
                              verify=not args.no_verify, progress=say, tuning_log=_tuning_log_choice(args),
                              fusion_gate=not args.no_fusion_gate, buckets=args.bucket)
    cli_output.print_compile_targets(results)
    failed = [r.error for r in results if r.error is not None]
    return failed[0].exit_code if failed else 0


def _run(args, say) -> int:
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
    fill = args.fill or (None if given else "random")
    if fill and not args.fill:
        say(f"no --input given: random inputs ({', '.join(s['name'] for s in model.inputs)}); "
            "--fill zeros for zeros, --input NAME=FILE.npy for yours")
    if fill:
        given = model.filled_inputs(given, fill, args.dim)
    tensors = model.prepare(given)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        model.run_prepared(tensors)
        times.append(time.perf_counter() - start)
    outputs = model.run(given)
    if args.save:
        save_outputs(outputs, args.save)
    cli_output.print_run(outputs, times)
    return 0


def _inspect(args, say) -> int:
    from .api import export_fused_onnx, inspect_model

    if args.check and not args.onnx:
        raise ConfigError("--check verifies the fused ONNX file, and no --onnx was given", "add --onnx FILE.onnx")
    _check_json_path(args)
    result = inspect_model(args.model, args.config, args.input_shape, graph=args.graph)
    exported = (export_fused_onnx(args.model, args.config, args.input_shape, args.onnx, check=args.check)
                if args.onnx else None)
    _report(args, lambda: cli_output.print_inspect(result, args.graph, exported),
            lambda: {**result.to_json(), **({"fused_onnx": exported.to_json()} if exported else {})})
    return 0


def _bench(args, say) -> int:
    from .api import bench_model

    _check_json_path(args)
    result = bench_model(args.model, args.config, args.input_shape, repeat=args.repeat,
                         warmup=args.warmup, include_stock=not args.no_stock,
                         tuning_log=_tuning_log_choice(args), progress=say, peers=tuple(args.peer))
    _report(args, lambda: cli_output.print_bench(result), result.to_json)
    return 0


def _tune(args, say) -> int:
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
    cli_output.print_tune(result)
    return 130 if result.stopped_by == "interrupted" else 0


def _tuning_log(args, say) -> int:
    from .tuning import logs

    if args.action == "show":
        roots = [args.path] if args.path else [bundled.user_tuning_logs(), bundled.shipped_tuning_logs()]
        _check_json_path(args)
        rows, notes = logs.show(*roots)
        _report(args, lambda: cli_output.print_log_show(rows, notes),
                lambda: [dataclasses.asdict(row) for row in rows])
    elif args.action == "merge":
        cli_output.print_log_merge(logs.merge(args.sources, args.output, keep=args.keep))
    elif args.action == "prune":
        cli_output.print_log_prune(logs.prune(args.path, keep=args.keep))
    else:
        cli_output.print_log_diff(logs.diff(args.a, args.b))
    return 0


def _profile(args, say) -> int:
    from .api import profile_model
    from .profile_plot import check_plot_path, plot_profile

    if args.plot:
        check_plot_path(args.plot)
    _check_json_path(args)
    result = profile_model(args.model, args.config, args.input_shape, rounds=args.repeat, mine=args.mine,
                           progress=say, tuning_log=_tuning_log_choice(args))
    _report(args, lambda: cli_output.print_profile(result, args.top), result.to_json)
    if args.plot:
        plot_profile(result, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _ablate(args, say) -> int:
    from .api import ablate_model

    _check_json_path(args)
    result = ablate_model(args.model, args.config, args.input_shape, rounds=args.repeat, progress=say)
    _report(args, lambda: cli_output.print_ablate(result), result.to_json)
    return 0


def _demo(args, say) -> int:
    from .api import bench_model, compile_model

    model = bundled.demo_model()
    say(f"demo model: {model}")
    cli_output.print_compile(compile_model(model, args.config, [], args.output_dir, progress=say))
    cli_output.print_bench(bench_model(model, args.config, [], repeat=args.repeat, include_stock=False,
                                       progress=say))
    return 0


def _serve(args, say) -> int:
    try:
        from .serving import serve
    except ImportError as err:
        raise ToolchainError(f"serve needs FastAPI, uvicorn and prometheus-client, which are not installed ({err})",
                             "pip install 'tvm_fusion[serve]'") from err
    serve(args.artifact, args.host, args.port, args.name, args.max_body_kb * 1024, args.workers, say)
    return 0


def _export_runner(args, say) -> int:
    from .targets.native_runner import export_runner

    for path in export_runner(args.directory):
        print(path)
    print(f"build: cmake -S {args.directory} -B {args.directory}/build && cmake --build {args.directory}/build")
    return 0


def _configs(args, say) -> int:
    from .config import shipped_configs

    cli_output.print_configs(shipped_configs())
    return 0


COMMANDS = {"compile": _compile, "run": _run, "inspect": _inspect, "bench": _bench, "tune": _tune,
            "tuning-log": _tuning_log, "profile": _profile, "ablate": _ablate, "configs": _configs,
            "demo": _demo, "serve": _serve, "export-runner": _export_runner}

if __name__ == "__main__":
    sys.exit(main())
