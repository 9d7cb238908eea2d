"""A TVM RPC tracker and servers for ``tune --rpc-tracker``, bound to loopback unless told otherwise.

These are TVM's own ``tvm.exec.rpc_tracker`` / ``tvm.exec.rpc_server`` processes; this module
only starts them with safe defaults (TVM's listen on every interface) and stops them by PID,
children included: each one forks a ``tvm.exec.popen_worker`` that holds the listening socket.

    python -m tvm_fusion.tuning.farm tracker [--host 127.0.0.1] [--port 9190]
    python -m tvm_fusion.tuning.farm server --tracker 127.0.0.1:9190 --key KEY [--host 127.0.0.1]

A board on the network is started with ``--host`` set to its own address, deliberately.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
from tvm import rpc

LOOPBACK = "127.0.0.1"


def _spawn(args: list[str], threads: int | None) -> subprocess.Popen:
    env = dict(os.environ)
    if threads:
        env["TVM_NUM_THREADS"] = str(threads)  # boards measure at the thread count deployed
    return subprocess.Popen([sys.executable, "-m", *args], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_port(host: str, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            probe.settimeout(0.5)
            if probe.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")


def start_tracker(port: int, host: str = LOOPBACK) -> subprocess.Popen:
    process = _spawn(["tvm.exec.rpc_tracker", "--host", host, "--port", str(port), "--port-end", str(port + 1)],
                     None)
    try:
        wait_for_port(host, port)
    except BaseException:  # not listening, or stopped meanwhile: leave no tracker behind
        stop(process)
        raise
    return process


def start_server(tracker: str, key: str, port: int, host: str = LOOPBACK,
                 threads: int | None = None) -> subprocess.Popen:
    return _spawn(["tvm.exec.rpc_server", "--host", host, "--port", str(port), "--port-end", str(port + 1),
                   "--tracker", tracker, "--key", key], threads)


def wait_for_servers(host: str, port: int, key: str, count: int, timeout_s: float = 60.0) -> None:
    """Until the tracker lists ``count`` free servers under ``key``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queue = rpc.connect_tracker(host, port).summary().get("queue_info", {}).get(key, {})
        if int(queue.get("free", 0)) >= count:
            return
        time.sleep(0.3)
    raise TimeoutError(f"{count} server(s) with key {key!r} did not register in {timeout_s:.0f} s")


def stop(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Terminate ``process`` and every descendant (the popen_worker children), by PID."""
    try:
        family = [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=timeout_s)
    for member in alive:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait(timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_fusion.tuning.farm", description=__doc__.splitlines()[0])
    roles = parser.add_subparsers(dest="role", required=True)
    tracker = roles.add_parser("tracker")
    tracker.add_argument("--host", default=LOOPBACK, help="address to listen on (default: loopback only)")
    tracker.add_argument("--port", type=int, default=9190)
    server = roles.add_parser("server")
    server.add_argument("--tracker", required=True, metavar="HOST:PORT")
    server.add_argument("--key", required=True)
    server.add_argument("--host", default=LOOPBACK, help="address to listen on (default: loopback only)")
    server.add_argument("--port", type=int, default=9090)
    server.add_argument("--threads", type=int, default=None, help="TVM_NUM_THREADS for measurements")
    args = parser.parse_args(argv)
    # SIGTERM (kill, systemd, a CI runner) stops the children like Ctrl-C: they would outlive us.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    process = None
    try:
        if args.role == "tracker":
            process = start_tracker(args.port, args.host)
        else:
            process = start_server(args.tracker, args.key, args.port, args.host, args.threads)
        print(f"{args.role} pid {process.pid} on {args.host}:{args.port}; Ctrl-C or SIGTERM stops it",
              file=sys.stderr)
        process.wait()
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
        if process is not None:
            stop(process)
    return 0


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
