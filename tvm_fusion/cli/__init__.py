"""``tvm-fusion``: each command's handler turns parsed arguments (``parser``) into one call of
the Python API (tvm_fusion.api) and prints its result (``output``).

The API is imported inside each handler: it imports TVM, which takes seconds, and ``--help``
or a bad flag should not wait for that. So is every other module that imports TVM (config,
tuning.logs, the commands, targets); what is imported at the top stays clear of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .. import bundled
from ..errors import ArtifactError, ConfigError, ToolchainError, TvmFusionError, cli_context
from ..files import check_writable
from ..report import set_wide, write_json
from ..runtime import load
from ..runtime.run_files import check_save_dir, read_input, save_outputs
from . import output as cli_output
from .parser import build_parser, progress_printer, tuning_log_choice


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
    with cli_context():
        set_wide(args.wide)
        try:
            return _dispatch(args)
        finally:
            set_wide(False)


def _dispatch(args) -> int:
    say = progress_printer(not args.quiet)
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
    if args.json not in (None, "-"):
        check_writable(Path(args.json).resolve().parent, f"the JSON file {args.json}", "--json")


def _report(args, print_tables, to_json) -> None:
    """The tables, and the JSON ``to_json()`` to --json FILE; with ``--json -`` the JSON alone, on stdout."""
    if args.json == "-":
        print(json.dumps(to_json(), indent=2))
        return
    print_tables()
    if args.json:
        write_json(args.json, to_json())


def _compile(args, say) -> int:
    from ..api import compile_model  # deferred: imports TVM (module docstring)

    if len(args.config) > 1:
        return _compile_targets(args, say)
    result = compile_model(args.model, args.config[0] if args.config else None, args.input_shape,
                           args.output_dir, verify=not args.no_verify, progress=say,
                           tuning_log=tuning_log_choice(args), fusion_gate=not args.no_fusion_gate,
                           buckets=args.bucket, precision=args.precision, calibration=args.calibration)
    cli_output.print_compile(result)
    return 0


def _compile_targets(args, say) -> int:
    """Every target in one go; a failed target is reported and the exit is non-zero at the end."""
    from ..api import compile_targets  # deferred: imports TVM (module docstring)

    results = compile_targets(args.model, args.config, args.input_shape, args.output_dir,
                              verify=not args.no_verify, progress=say, tuning_log=tuning_log_choice(args),
                              fusion_gate=not args.no_fusion_gate, buckets=args.bucket, precision=args.precision,
                              calibration=args.calibration)
    cli_output.print_compile_targets(results)
    failed = [r.error for r in results if r.error is not None]
    return failed[0].exit_code if failed else 0


def _run(args, say) -> int:
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
    from ..api import export_fused_onnx, inspect_model  # deferred: imports TVM (module docstring)

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
    from ..api import bench_model  # deferred: imports TVM (module docstring)

    _check_json_path(args)
    result = bench_model(args.model, args.config, args.input_shape, repeat=args.repeat,
                         warmup=args.warmup, include_stock=not args.no_stock,
                         tuning_log=tuning_log_choice(args), progress=say, peers=tuple(args.peer),
                         precision=args.precision)
    _report(args, lambda: cli_output.print_bench(result), result.to_json)
    return 0


def _tune(args, say) -> int:
    from ..commands.tune import RpcSettings, tune_model  # deferred: imports TVM (module docstring)

    rpc = None
    if args.rpc_tracker or args.rpc_key:
        if not (args.rpc_tracker and args.rpc_key):
            raise TvmFusionError("--rpc-tracker and --rpc-key go together",
                                 "pass both, e.g. --rpc-tracker 127.0.0.1:9190 --rpc-key myboard")
        rpc = RpcSettings(args.rpc_tracker[0], args.rpc_tracker[1], args.rpc_key)
    result = tune_model(args.model, args.config, args.input_shape, trials=args.trials,
                        per_task_trials=args.per_task_trials, time_limit_s=args.time_limit,
                        trials_per_iter=args.trials_per_iter, log_dir=args.tuning_log, rpc=rpc,
                        seed=args.seed, show_progress=not args.quiet, say=say, precision=args.precision)
    cli_output.print_tune(result)
    return 130 if result.stopped_by == "interrupted" else 0


def _tuning_log(args, say) -> int:
    from ..tuning import logs  # deferred: imports TVM (module docstring)

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
    from ..api import profile_model  # deferred: imports TVM (module docstring)
    from ..commands.profile.plot import check_plot_path, plot_profile  # deferred: imports TVM (module docstring)

    if args.plot:
        check_plot_path(args.plot)
    _check_json_path(args)
    result = profile_model(args.model, args.config, args.input_shape, rounds=args.repeat, mine=args.mine,
                           progress=say, tuning_log=tuning_log_choice(args), precision=args.precision)
    _report(args, lambda: cli_output.print_profile(result, args.top), result.to_json)
    if args.plot:
        plot_profile(result, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _ablate(args, say) -> int:
    from ..api import ablate_model  # deferred: imports TVM (module docstring)

    _check_json_path(args)
    result = ablate_model(args.model, args.config, args.input_shape, rounds=args.repeat, progress=say)
    _report(args, lambda: cli_output.print_ablate(result), result.to_json)
    return 0


def _demo(args, say) -> int:
    from ..api import bench_model, compile_model  # deferred: imports TVM (module docstring)

    model = bundled.demo_model()
    say(f"demo model: {model}")
    cli_output.print_compile(compile_model(model, args.config, [], args.output_dir, progress=say))
    cli_output.print_bench(bench_model(model, args.config, [], repeat=args.repeat, include_stock=False,
                                       progress=say))
    return 0


def _serve(args, say) -> int:
    try:
        from ..commands.serve import serve  # deferred: optional (the serve extra), ~0.5 s to import
    except ImportError as err:
        raise ToolchainError(f"serve needs FastAPI, uvicorn and prometheus-client, which are not installed ({err})",
                             "pip install 'tvm_fusion[serve]'") from err
    serve(args.artifact, args.host, args.port, args.name, args.max_body_kb * 1024, args.workers, say)
    return 0


def _export_runner(args, say) -> int:
    from ..targets.native_runner import export_runner  # deferred: imports TVM (module docstring)

    for path in export_runner(args.directory):
        print(path)
    print(f"build: cmake -S {args.directory} -B {args.directory}/build && cmake --build {args.directory}/build")
    return 0


def _configs(args, say) -> int:
    from ..config import shipped_configs  # deferred: imports TVM (module docstring)

    cli_output.print_configs(shipped_configs())
    return 0


COMMANDS = {"compile": _compile, "run": _run, "inspect": _inspect, "bench": _bench, "tune": _tune,
            "tuning-log": _tuning_log, "profile": _profile, "ablate": _ablate, "configs": _configs,
            "demo": _demo, "serve": _serve, "export-runner": _export_runner}
