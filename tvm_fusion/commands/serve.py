"""``tvm-fusion serve``: a loaded artifact behind the Open Inference Protocol (KServe v2, REST).

The app is plain FastAPI over any model object with ``inputs``/``outputs`` specs and a
thread-safe ``run`` (``tvm_fusion.load``'s, or a peer's for side-by-side load tests). Inference
endpoints are synchronous, so the server's thread pool calls ``run`` concurrently; each call
takes a VM of its own (runtime.CompiledModel). Bad requests get a 400 that names the culprit;
a run that fails gets a 500 with the message, and the server goes on serving.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping

import anyio.to_thread
import ml_dtypes
import numpy as np
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from ..errors import ArtifactError
from ..runtime import load

# KServe v2 tensor datatypes and their numpy dtypes.
DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
             "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
             "FP32": np.float32, "FP64": np.float64, "BF16": ml_dtypes.bfloat16}
NAMES = {np.dtype(dtype).name: name for name, dtype in DATATYPES.items()}
DEFAULT_MAX_BODY_BYTES = 64 << 20


class BadRequest(Exception):
    """A request the client can fix: answered 400 with the message."""


def create_app(model, name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, workers: int = 8) -> FastAPI:
    """The v2 endpoints for ``model`` served as ``name``, with Prometheus metrics at /metrics;
    at most ``workers`` runs in flight at once (the rest wait for a thread)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = workers
        yield

    app = FastAPI(title=f"tvm_fusion: {name}", docs_url=None, redoc_url=None, lifespan=lifespan)
    registry = CollectorRegistry()
    requests = Counter("tvm_fusion_requests", "Requests by endpoint and status code", ["endpoint", "code"],
                       registry=registry)
    latency = Histogram("tvm_fusion_request_seconds", "Request latency by endpoint", ["endpoint"],
                        registry=registry, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
    errors = Counter("tvm_fusion_errors", "Failed requests by kind (bad_request, run_failed, ...)", ["kind"],
                     registry=registry)

    @app.middleware("http")
    async def measure(request: Request, call_next):
        endpoint = request.url.path if not request.url.path.startswith("/v2/models/") else (
            "/v2/models/{name}/" + request.url.path.rsplit("/", 1)[-1] if request.url.path.count("/") > 3
            else "/v2/models/{name}")
        started = time.perf_counter()
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            response = _error(413, f"request body of {int(size)} bytes is over the limit of {max_body_bytes}")
            errors.labels("too_large").inc()
        else:
            response = await call_next(request)
        latency.labels(endpoint).observe(time.perf_counter() - started)
        requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.get("/v2/health/live")
    def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    def ready():
        return {"ready": True}

    @app.get("/v2/models/{model_name}")
    def metadata(model_name: str):
        _check_name(model_name, name)
        return {"name": name, "versions": ["1"], "platform": "tvm_fusion",
                "inputs": [_tensor_metadata(spec) for spec in model.inputs if "value" not in spec],
                "outputs": [_tensor_metadata(spec) for spec in model.outputs]}

    @app.get("/v2/models/{model_name}/ready")
    def model_ready(model_name: str):
        _check_name(model_name, name)
        return {"name": name, "ready": True}

    @app.post("/v2/models/{model_name}/infer")
    async def infer(model_name: str, http: Request):
        _check_name(model_name, name)
        body = bytearray()
        async for chunk in http.stream():  # also a chunked body, which has no content-length
            body += chunk
            if len(body) > max_body_bytes:
                raise _TooLarge(f"request body over the limit of {max_body_bytes} bytes")
        request = _parse_json(bytes(body))
        inputs = _inputs(request, model.inputs)
        wanted = [o.get("name") for o in request.get("outputs", [])] or [o["name"] for o in model.outputs]
        unknown = sorted(set(wanted) - {o["name"] for o in model.outputs})
        if unknown:
            raise BadRequest(f"unknown output(s) {unknown}; the model has "
                             f"{', '.join(o['name'] for o in model.outputs)}")
        try:  # on the server's thread pool: runs of one model go on side by side
            outputs = await run_in_threadpool(model.run, inputs)
        except ArtifactError as err:  # shapes, dtypes, token ids out of range: the request's fault
            raise BadRequest(str(err)) from err
        except Exception as err:  # noqa: BLE001 - answered 500; the server goes on serving
            raise _RunFailed(f"{type(err).__name__}: {err}") from err
        response = {"model_name": name, "model_version": "1",
                    "outputs": [_tensor_json(n, outputs[n]) for n in wanted]}
        if "id" in request:
            response["id"] = request["id"]
        # orjson writes the arrays as they are: FastAPI's encoder walks every element in Python,
        # and json.dumps of a BERT hidden state (32k floats) took 23 ms against orjson's 2 ms.
        return Response(orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(BadRequest)
    def bad_request(_request, err: BadRequest):
        errors.labels("bad_request").inc()
        return _error(400, str(err))

    @app.exception_handler(_UnknownModel)
    def unknown_model(_request, err: _UnknownModel):
        errors.labels("unknown_model").inc()
        return _error(404, str(err))

    @app.exception_handler(_TooLarge)
    def too_large(_request, err: _TooLarge):
        errors.labels("too_large").inc()
        return _error(413, str(err))

    @app.exception_handler(_RunFailed)
    def run_failed(_request, err: _RunFailed):
        errors.labels("run_failed").inc()
        return _error(500, str(err))

    return app


class _UnknownModel(Exception):
    """A model name this server does not serve: 404."""


class _TooLarge(Exception):
    """A body over the limit: 413."""


class _RunFailed(Exception):
    """The model raised: 500 with its message."""


def _check_name(given: str, name: str) -> None:
    if given != name:
        raise _UnknownModel(f"no model {given!r} here; this server serves {name!r}")


def _error(code: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=code)


def _parse_json(body: bytes) -> dict:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise BadRequest(f"the body is not JSON: {err}") from err
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise BadRequest('the body must be a JSON object with an "inputs" list (KServe v2 inference request)')
    return request


def _tensor_metadata(spec: Mapping) -> dict:
    return {"name": spec["name"], "datatype": NAMES.get(spec.get("dtype", "float32"), "FP32"),
            "shape": [d if isinstance(d, int) else -1 for d in spec.get("shape", [])]}


def _inputs(request: dict, specs: list[dict]) -> dict[str, np.ndarray]:
    """Each request tensor as an array of the model's dtype; names and datatypes checked here,
    shapes and value ranges by the model (its ArtifactError becomes a 400)."""
    by_name = {spec["name"]: spec for spec in specs}
    arrays = {}
    for tensor in request["inputs"]:
        if not isinstance(tensor, dict) or not {"name", "shape", "datatype", "data"} <= set(tensor):
            raise BadRequest("each input needs name, shape, datatype and data")
        name = tensor["name"]
        if name not in by_name:
            raise BadRequest(f"unknown input {name!r}; the model takes {', '.join(by_name)}")
        expected = NAMES.get(by_name[name]["dtype"])
        if tensor["datatype"] != expected:
            raise BadRequest(f"input {name!r} has datatype {tensor['datatype']!r}, the model takes {expected!r}")
        try:
            array = np.asarray(tensor["data"], dtype=DATATYPES[expected]).reshape(tensor["shape"])
        except (ValueError, TypeError) as err:
            raise BadRequest(f"input {name!r}: data does not fit shape {tensor['shape']}: {err}") from err
        arrays[name] = array
    return arrays


def _tensor_json(name: str, value: np.ndarray) -> dict:
    datatype = NAMES.get(value.dtype.name, "FP32")
    data = value.astype(np.float32) if datatype in ("BF16", "FP16") else value  # orjson's numpy types
    return {"name": name, "shape": list(value.shape), "datatype": datatype,
            "data": np.ascontiguousarray(data).ravel()}


def serve(artifact_dir: str, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, workers: int = 8, say=print) -> None:
    """Load the artifact and serve it until SIGINT or SIGTERM, which finish the requests in flight
    (up to 30 s) before the process exits. ``workers``: runs in flight at once."""
    # Each thread that runs the model gets a TVM thread pool of its own, whose workers spin
    # between kernels; with several requests in flight they took the cores that HTTP and JSON
    # need (bert_tiny, 4 clients on 2 cores: 106 -> 128 requests/s without the spinning).
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    model = load(artifact_dir)
    name = name or model.metadata.get("model", "model")
    app = create_app(model, name, max_body_bytes, workers)
    say(f"serving {artifact_dir} as {name!r} on http://{host}:{port}/v2/models/{name} (metrics: /metrics)")
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
