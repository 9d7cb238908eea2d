"""``tvm-fusion serve``: a real uvicorn server in a child process, driven over HTTP on loopback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import tvm_fusion
from tvm_fusion import api


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Client:
    """JSON over HTTP to a server on loopback, with urllib (no client library needed)."""

    def __init__(self, port: int):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict | str]:
        request = urllib.request.Request(self.base + path, data=body, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            status, text = err.code, err.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get(self, path: str):
        return self.request("GET", path)

    def infer(self, name: str, payload) -> tuple[int, dict | str]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.request("POST", f"/v2/models/{name}/infer", body)


class Server(Client):
    """``tvm-fusion serve ARTIFACT`` in a child process, ready when constructed."""

    def __init__(self, artifact, *flags: str):
        super().__init__(free_port())
        self.proc = subprocess.Popen([sys.executable, "-m", "tvm_fusion.cli", "serve", str(artifact),
                                      "--port", str(self.port), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.proc.communicate()[1]}")
            try:
                if self.get("/v2/health/ready")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("serve did not become ready in 60 s")

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def mlp_server(mlp_artifact):
    server = Server(mlp_artifact)
    yield server
    if server.proc.poll() is None:
        server.stop()


def tensor(name: str, value: np.ndarray, datatype: str = "FP32") -> dict:
    return {"name": name, "shape": list(value.shape), "datatype": datatype, "data": value.ravel().tolist()}


X = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)


def test_health_and_metadata(mlp_server):
    assert mlp_server.get("/v2/health/live") == (200, {"live": True})
    status, meta = mlp_server.get("/v2/models/mlp")
    assert status == 200
    assert meta["name"] == "mlp" and meta["platform"] == "tvm_fusion"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [4, 16]}]
    assert meta["outputs"][0]["name"] == "y"
    assert mlp_server.get("/v2/models/mlp/ready") == (200, {"name": "mlp", "ready": True})


def test_infer_matches_the_loaded_artifact(mlp_server, mlp_artifact):
    status, answer = mlp_server.infer("mlp", {"id": "a1", "inputs": [tensor("x", X)]})
    assert status == 200, answer
    (output,) = answer["outputs"]
    assert answer["id"] == "a1" and output["name"] == "y" and output["datatype"] == "FP32"
    got = np.asarray(output["data"], np.float32).reshape(output["shape"])
    np.testing.assert_array_equal(got, tvm_fusion.load(mlp_artifact).run({"x": X})["y"])


@pytest.mark.parametrize("payload, code, culprit", [
    ({"inputs": [tensor("x", X[:2])]}, 400, "input 'x' has shape [2, 16]"),
    ({"inputs": [tensor("x", X.astype(np.int64), "INT64")]}, 400, "datatype 'INT64', the model takes 'FP32'"),
    ({"inputs": [tensor("z", X)]}, 400, "unknown input 'z'"),
    ({"inputs": []}, 400, "missing ['x']"),
    ({"inputs": [{"name": "x", "shape": [4, 16], "datatype": "FP32", "data": [1.0, 2.0]}]}, 400,
     "data does not fit shape [4, 16]"),
    ({"inputs": [tensor("x", X)], "outputs": [{"name": "nope"}]}, 400, "unknown output(s) ['nope']"),
    ({"input": []}, 400, '"inputs" list'),
    (b"{not json", 400, "not JSON"),
])
def test_bad_requests_name_the_culprit(mlp_server, payload, code, culprit):
    status, answer = mlp_server.infer("mlp", payload)
    assert status == code and culprit in answer["error"], answer


def test_unknown_model_is_404(mlp_server):
    status, answer = mlp_server.infer("resnet", {"inputs": [tensor("x", X)]})
    assert status == 404 and "serves 'mlp'" in answer["error"]


@pytest.fixture(scope="module")
def embedding_artifact(tmp_path_factory, embedding_path, config_factory):
    out = tmp_path_factory.mktemp("embedding_build")
    return api.compile_model(embedding_path, config_factory(), ["ids:1x8", "flags:1x8"], output_dir=out).artifact


def test_token_id_out_of_range_is_400(embedding_artifact):
    server = Server(embedding_artifact)
    try:
        ids = np.full((1, 8), 99, np.int64)
        status, answer = server.infer("embedding", {"inputs": [tensor("ids", ids, "INT64"),
                                                                tensor("flags", np.ones((1, 8), np.int64), "INT64")]})
        assert status == 400 and "outside its valid range" in answer["error"], answer
        assert server.get("/v2/health/ready")[0] == 200  # still serving
    finally:
        server.stop()


def test_concurrent_requests_all_answered_correctly(mlp_server, mlp_artifact):
    model = tvm_fusion.load(mlp_artifact)
    rng = np.random.default_rng(8)
    inputs = [rng.standard_normal((4, 16)).astype(np.float32) for _ in range(8)]
    expected = [model.run({"x": x})["y"] for x in inputs]
    failures: list[str] = []

    def client(k: int) -> None:
        for _ in range(25):
            status, answer = mlp_server.infer("mlp", {"inputs": [tensor("x", inputs[k])]})
            got = np.asarray(answer["outputs"][0]["data"], np.float32).reshape(4, 8) if status == 200 else None
            if got is None or not np.array_equal(got, expected[k]):
                failures.append(f"client {k}: {status}")

    workers = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []


def test_metrics_count_requests_and_errors(mlp_server):
    mlp_server.infer("mlp", {"inputs": [tensor("x", X)]})
    mlp_server.infer("mlp", {"inputs": []})
    status, text = mlp_server.get("/metrics")
    assert status == 200
    assert 'tvm_fusion_requests_total{code="200",endpoint="/v2/models/{name}/infer"}' in text
    assert 'tvm_fusion_errors_total{kind="bad_request"}' in text
    assert 'tvm_fusion_request_seconds_bucket{endpoint="/v2/models/{name}/infer"' in text


def test_body_over_the_limit_is_413(mlp_artifact):
    server = Server(mlp_artifact, "--max-body-kb", "1")
    try:
        status, answer = server.infer("mlp", {"inputs": [tensor("x", X)]})  # ~1.5 KiB of JSON
        assert status == 413 and "over the limit" in answer["error"]
    finally:
        server.stop()


def test_sigterm_shuts_down_cleanly(mlp_artifact):
    server = Server(mlp_artifact)
    code, err = server.stop()
    assert code == 0, err
    assert "Traceback" not in err


def test_serve_binds_loopback_by_default():
    from tvm_fusion import cli

    args = cli.build_parser().parse_args(["serve", "build/x"])
    assert args.host == "127.0.0.1" and args.port == 8000


class FailingModel:
    """A model whose run raises for x[0, 0] < 0: the server answers 500 and goes on."""

    inputs = [{"name": "x", "shape": [1, 2], "dtype": "float32"}]
    outputs = [{"name": "y"}]

    def run(self, inputs):
        if inputs["x"][0, 0] < 0:
            raise RuntimeError("kernel failed")
        return {"y": inputs["x"] * 2}


def test_a_run_that_raises_is_500_and_the_server_goes_on():
    import uvicorn

    from tvm_fusion.commands.serve import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(FailingModel(), "failing"), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = Client(port)
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        bad = {"inputs": [tensor("x", np.array([[-1.0, 1.0]], np.float32))]}
        good = {"inputs": [tensor("x", np.array([[1.0, 1.0]], np.float32))]}
        assert client.infer("failing", bad) == (500, {"error": "RuntimeError: kernel failed"})
        status, answer = client.infer("failing", good)
        assert status == 200 and answer["outputs"][0]["data"] == [2.0, 2.0]
        assert 'tvm_fusion_errors_total{kind="run_failed"} 1.0' in client.get("/metrics")[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_serve_without_the_extra_says_how_to_install(monkeypatch, capsys, mlp_artifact):
    from tvm_fusion import cli

    monkeypatch.setitem(sys.modules, "tvm_fusion.commands.serve", None)  # as if FastAPI were missing
    assert cli.main(["serve", str(mlp_artifact)]) == 7
    err = capsys.readouterr().err
    assert err.count("tvm-fusion: error:") == 1 and "pip install 'tvm_fusion[serve]'" in err
