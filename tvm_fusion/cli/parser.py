"""The ``tvm-fusion`` argument parser: every command's flags, shared flag groups, help text."""

from __future__ import annotations

import argparse
import sys
import time

from ..commands.peers import PEERS


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
        from ..metadata import versions  # deferred: metadata imports TVM, which --help should not wait for

        print("\n".join(f"{name} {version}" for name, version in versions().items()))
        parser.exit()


def progress_printer(verbose: bool):
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


def _precision_arg(parser: argparse.ArgumentParser, int8: bool = False) -> None:
    parser.add_argument("--precision", choices=["float32", "bf16", "auto", *(["int8"] if int8 else [])],
                        help="what matmuls and convs compute in: bf16 (CPUs with AMX-BF16 or AVX512_BF16; float32 sums, "
                             "accuracy-gated against ONNX Runtime float32) or auto (bf16 where the CPU has it and "
                             "the gate holds)" + ("; int8: ONNX Runtime's quantize_static makes an int8 QDQ model "
                                                  "first (see --calibration), and that is compiled" if int8 else "")
                             + "; default: the config's [pipeline] precision, float32")


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
    """Every subcommand takes the global ``-q`` and ``--wide`` too, so they may come after the
    command name."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        if kwargs.get("prog", "").startswith("tvm-fusion "):
            _global_flags(self, default=argparse.SUPPRESS)


def _global_flags(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", default=default, help="no progress messages")
    parser.add_argument("--wide", action="store_true", default=default,
                        help="tables keep every character (by default they fit the terminal, long names cut "
                             "in the middle)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tvm-fusion", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Kernel fusion for Apache TVM: ONNX in, a fused, scheduled and verified library out.")
    _global_flags(parser, default=False)
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
    _precision_arg(compile_cmd, int8=True)
    compile_cmd.add_argument("--calibration", metavar="DIR",
                             help="with --precision int8: a folder of calibration samples of real inputs, one "
                                  ".npz per sample (an array per input name; a .npy for a one-input model); "
                                  "without it, seeded random inputs (a loud warning: ranges fitted to noise)")
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
    bench_cmd.add_argument("model", help="MODEL.onnx, or an artifact directory from compile (its own library is "
                           "timed, with the config and shapes it was built with)")
    _shape_args(bench_cmd)
    bench_cmd.add_argument("--repeat", type=_count(1), default=30, help="timed rounds, each runner once a round")
    bench_cmd.add_argument("--warmup", type=_count(0), default=3, help="untimed rounds first")
    bench_cmd.add_argument("--no-stock", action="store_true", help="skip stock TVM (it is slow)")
    bench_cmd.add_argument("--peer", action="append", default=[], choices=PEERS,
                           help="also time this engine in the same rounds (OpenVINO: at f32 and at its default "
                                "precision; needs the peers extra: pip install 'tvm_fusion[peers]'); repeatable")
    _json_arg(bench_cmd)
    _precision_arg(bench_cmd)
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
    _precision_arg(profile_cmd)
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


def tuning_log_choice(args):
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
    _precision_arg(tune_cmd)

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
