"""Load test of ``tvm-fusion serve`` against ONNX Runtime behind the same server.

Each server runs in a process of its own on loopback: ``tvm-fusion serve ARTIFACT`` for
tvm_fusion, and the same FastAPI app (tvm_fusion.commands.serve.create_app) over one shared ONNX
Runtime session for the peer. ``--clients`` threads post KServe v2 inference requests for
``--seconds`` each; the report gives requests per second, p50/p99 latency, errors (any non-200
or a wrong answer), and the server's RSS before and after. Writes
benchmarks/results/serve.json atomically.

    .venv/bin/python benchmarks/bench_serve.py [--model examples/models/bert_tiny.onnx]
        [--clients 8] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import psutil

import tvm_fusion
from tvm_fusion import api
from tvm_fusion.config import host_cpu_name, load_config
from tvm_fusion.runtime.latency import LatencyStats
from tvm_fusion.report import table, write_json
from tvm_fusion.commands.serve import NAMES

ROOT = Path(__file__).resolve().parent.parent

# The peer's server: the same app over an ONNX Runtime session (argv: model, port, threads, name).
PEER_SERVER = """
import sys
import onnx
import uvicorn
from tvm_fusion.commands.serve import create_app
from tvm_fusion.verify import onnxruntime_session

class OnnxRuntimeModel:
    def __init__(self, path, threads):
        model = onnx.load(path)
        self.session = onnxruntime_session(model, threads)
        self.inputs = [{"name": i.name, "dtype": {"tensor(float)": "float32", "tensor(int64)": "int64"}[i.type],
                        "shape": i.shape} for i in self.session.get_inputs()]
        self.outputs = [{"name": o.name} for o in self.session.get_outputs()]

    def run(self, inputs):
        names = [o["name"] for o in self.outputs]
        return dict(zip(names, self.session.run(names, inputs)))

app = create_app(OnnxRuntimeModel(sys.argv[1], int(sys.argv[3])), sys.argv[4])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.communicate()[1]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the server did not become ready")


def load_test(port: int, name: str, body: bytes, expected: dict, clients: int, seconds: float) -> dict:
    """``clients`` threads posting ``body`` for ``seconds``; every answer checked against ``expected``."""
    url = f"http://127.0.0.1:{port}/v2/models/{name}/infer"
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    deadline = time.monotonic() + seconds

    def client(k: int) -> None:
        while time.monotonic() < deadline:
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    answer = orjson.loads(response.read())
                ok = all(np.allclose(np.asarray(o["data"]), expected[o["name"]].ravel(), rtol=1e-3, atol=1e-3)
                         for o in answer["outputs"])
            except (OSError, ValueError, KeyError):
                ok = False
            latencies[k].append(time.perf_counter() - started)
            errors[k] += not ok

    workers = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    began = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - began
    stats = LatencyStats.of([t for per in latencies for t in per])
    return {"requests": stats.count, "requests_per_s": stats.count / wall, "p50_ms": stats.median_ms,
            "p99_ms": stats.p99_ms, "errors": sum(errors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples/models/bert_tiny.onnx"))
    parser.add_argument("--input-shape", action="append", default=[], help="as for compile")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/serve.json"))
    args = parser.parse_args()

    config = load_config()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        built = api.compile_model(args.model, config, args.input_shape, Path(folder), verify=False)
        model = tvm_fusion.load(built.artifact)
        inputs = model.filled_inputs({}, "random", seed=config.seed)
        expected = model.run(inputs)
        name = model.metadata["model"]
        body = json.dumps({"inputs": [{"name": k, "shape": list(v.shape), "datatype": NAMES[v.dtype.name],
                                       "data": v.ravel().tolist()} for k, v in inputs.items()]}).encode()
        commands = {
            "tvm_fusion": [sys.executable, "-m", "tvm_fusion.cli", "-q", "serve", str(built.artifact)],
            "onnxruntime": [sys.executable, "-c", PEER_SERVER, args.model],
        }
        for runner, command in commands.items():
            port = free_port()
            argv = ([*command, "--port", str(port), "--name", name] if runner == "tvm_fusion"
                    else [*command, str(port), str(config.threads), name])
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "TVM_NUM_THREADS": str(config.threads)})
            try:
                wait_ready(port, proc)
                server = psutil.Process(proc.pid)
                load_test(port, name, body, expected, args.clients, 2.0)  # warm-up
                rss_start = server.memory_info().rss
                result = load_test(port, name, body, expected, args.clients, args.seconds)
                result.update(rss_start_mb=rss_start / 2**20, rss_end_mb=server.memory_info().rss / 2**20)
                results[runner] = result
                print(f"{runner}: {result}", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)

    print(table(["server", "requests", "req/s", "p50 ms", "p99 ms", "errors", "RSS start MB", "RSS end MB"],
                [[k, r["requests"], r["requests_per_s"], r["p50_ms"], r["p99_ms"], r["errors"], r["rss_start_mb"],
                  r["rss_end_mb"]] for k, r in results.items()]))
    write_json(args.out, {
        "benchmark": "serve", "model": Path(args.model).name, "clients": args.clients, "seconds": args.seconds,
        "threads_per_call": config.threads, "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": host_cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
