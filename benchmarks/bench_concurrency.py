"""Throughput of one loaded model called from 1, 2, 4 and 8 client threads, against ONNX Runtime.

Each call of ``CompiledModel.run`` takes an idle VM from the model's pool (or makes one). The
alternative, a VM per client thread kept in a ``threading.local``, is timed beside it so the
choice stays measured. ONNX Runtime runs one ``InferenceSession`` shared by all clients, as its
docs recommend. Every runner uses the config's thread count inside a call (TVM's pool is per
calling thread, ORT's intra-op pool per session), so more clients than cores only queue.

Per round, every (runner, clients) pair runs for ``--seconds``; rounds interleave the pairs in a
new random order; the table gives the median calls per second over rounds. Every output is
checked against the single-threaded one. Writes benchmarks/results/concurrency.json atomically.

    .venv/bin/python benchmarks/bench_concurrency.py [--model examples/models/bert_tiny.onnx]
        [--clients 1 2 4 8] [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import tvm
from tvm import relax

import tvm_fusion
from tvm_fusion import api
from tvm_fusion.config import host_cpu_name, load_config
from tvm_fusion.report import table, write_json
from tvm_fusion.verify import onnxruntime_session

ROOT = Path(__file__).resolve().parent.parent


def vm_per_thread(artifact: Path, library: str):
    """The alternative to the pool: each client thread keeps a VM of its own."""
    local = threading.local()
    module = tvm.runtime.load_module(str(artifact / library))

    def call(tensors):
        if not hasattr(local, "main"):
            local.main = relax.VirtualMachine(module, tvm.cpu())["main"]
        return local.main(*tensors)

    return call


def throughput(call, clients: int, seconds: float, check) -> float:
    """Calls per second of ``clients`` threads calling ``call()`` for ``seconds``; ``check`` is
    applied to every result (a mismatch stops the benchmark)."""
    counts = [0] * clients
    errors: list[BaseException] = []
    start_line = threading.Barrier(clients + 1)
    deadline = [0.0]

    def work(k):
        start_line.wait()
        try:
            while time.perf_counter() < deadline[0]:
                check(call())
                counts[k] += 1
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            errors.append(err)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(clients)]
    for worker in workers:
        worker.start()
    began = time.perf_counter()
    deadline[0] = began + seconds
    start_line.wait()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return sum(counts) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples/models/bert_tiny.onnx"))
    parser.add_argument("--input-shape", action="append", default=[], help="as for compile")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/concurrency.json"))
    args = parser.parse_args()

    config = load_config()
    with tempfile.TemporaryDirectory() as folder:
        built = api.compile_model(args.model, config, args.input_shape, Path(folder), verify=False)
        model = tvm_fusion.load(built.artifact)
        onnx_model = onnx.load(args.model)
        inputs = model.filled_inputs({}, "random", seed=config.seed)
        tensors = model.prepare(inputs)
        expected = model.run(inputs)
        first = model.outputs[0]["name"]
        session = onnxruntime_session(onnx_model, config.threads)
        ort_expected = session.run([first], inputs)[0]
        per_thread = vm_per_thread(built.artifact, model.metadata["library"])
        runners = {
            "tvm_fusion (VM pool)": (lambda: model.run_prepared(tensors), expected[first]),
            "tvm_fusion (VM per thread)": (lambda: per_thread(tensors), expected[first]),
            "onnxruntime (one session)": (lambda: session.run([first], inputs)[0], ort_expected),
        }

        def checker(want):
            def check(result):
                value = result if isinstance(result, np.ndarray) else (
                    result.numpy() if hasattr(result, "numpy") else result[0].numpy())
                if not np.array_equal(value, want, equal_nan=True):
                    raise AssertionError("a concurrent call's output differs from the single-threaded one")
            return check

        samples: dict[tuple[str, int], list[float]] = {}
        pairs = [(name, clients) for name in runners for clients in args.clients]
        for round_index in range(args.rounds):
            random.Random(round_index).shuffle(pairs)
            for name, clients in pairs:
                call, want = runners[name]
                samples.setdefault((name, clients), []).append(
                    throughput(call, clients, args.seconds, checker(want)))
                print(f"round {round_index + 1}/{args.rounds}: {name} x{clients} "
                      f"{samples[(name, clients)][-1]:.0f} calls/s", flush=True)

    medians = {key: float(np.median(values)) for key, values in samples.items()}
    ort_name = "onnxruntime (one session)"
    rows = [[name, clients, f"{medians[(name, clients)]:.0f}",
             f"{medians[(name, clients)] / medians[(ort_name, clients)]:.2f}"]
            for name in runners for clients in args.clients]
    print(table(["runner", "clients", "calls/s (median)", "x onnxruntime"], rows))
    write_json(args.out, {
        "benchmark": "concurrency", "model": Path(args.model).name, "inputs": {name: list(value.shape) for name, value in inputs.items()},
        "machine": {"cpu": host_cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "threads_per_call": config.threads, "seconds": args.seconds, "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "results": [{"runner": name, "clients": clients, "calls_per_s": samples[(name, clients)],
                     "median_calls_per_s": medians[(name, clients)]} for name, clients in samples],
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
