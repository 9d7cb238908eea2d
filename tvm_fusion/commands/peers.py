"""Other inference engines that ``bench`` times beside tvm_fusion: OpenVINO (the ``peers`` extra).

ONNX Runtime is always there (the reference every runner is checked against); a peer is opt-in,
named by ``bench --peer NAME``, and comes from ``pip install 'tvm_fusion[peers]'``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from ..errors import ModelError, ToolchainError, TvmFusionError

PEERS = ("openvino",)  # the CLI imports this module for its --peer choices: keep its imports light
INSTALL_HINT = "pip install 'tvm_fusion[peers]' (or drop --peer {name})"


def check_peers(peers) -> tuple[str, ...]:
    """The peers asked for, each known and importable: checked before anything is compiled."""
    peers = tuple(dict.fromkeys((peers,) if isinstance(peers, str) else peers or ()))
    for name in peers:
        if name not in PEERS:
            raise TvmFusionError(f"unknown benchmark peer {name!r}", f"choose from: {', '.join(PEERS)}")
        _import_openvino()
    return peers


def installed_peers() -> tuple[str, ...]:
    """The peers whose package is installed (what the benchmark scripts time when they can)."""
    return tuple(name for name in PEERS if importlib.util.find_spec(name) is not None)


def _import_openvino():
    try:
        import openvino  # deferred: optional (the peers extra), and ~0.3 s to import
    except ImportError as err:
        raise ToolchainError(f"--peer openvino needs the openvino package, which is not installed ({err})",
                             INSTALL_HINT.format(name="openvino")) from err
    return openvino


# bench's rows for OpenVINO: (row, the inference precision pinned, None for OpenVINO's own choice).
# f32 is like-for-like with the other runners; the default (bf16 on CPUs with AVX512_BF16 or AMX)
# is what a user who installs OpenVINO and sets nothing gets, at the error it brings.
OPENVINO_ROWS = (("openvino", "f32"), ("openvino_default", None))
# OpenVINO's CPU plugin quantizes a fully connected layer's activations to int8 at run time, in
# groups of this many, even under an f32 precision hint (its default): a transformer's outputs
# then differ from float32 by 1e-1, not 1e-6. The f32 row turns it off, as like-for-like needs.
DYNAMIC_QUANTIZATION = "DYNAMIC_QUANTIZATION_GROUP_SIZE"


class OpenVinoRunner:
    """The ONNX file compiled by OpenVINO's CPU plugin at the run shapes: at ``precision`` (an
    OpenVINO type name, ``"f32"``; None leaves its default), latency mode, the config's threads,
    no CPU pinning (as ORT's spinning is off: so that it leaves the other runners' cores alone).
    ``self.precision`` is the inference precision the compiled model reports it chose, and its
    run-time int8 quantization of fully connected layers where that is on (f32 turns it off).

    ``run()`` is what is timed: one synchronous inference on inputs set once, as the TVM runners'
    tensors are prepared once.
    """

    def __init__(self, model_path: str | Path, inputs: dict, threads: int, precision: str | None = "f32"):
        ov = _import_openvino()
        import openvino.properties as props  # deferred: optional (the peers extra), checked just above
        import openvino.properties.hint as hints  # deferred: the same

        config = {hints.performance_mode: hints.PerformanceMode.LATENCY,
                  props.inference_num_threads: threads,
                  # Pinned, its threads made the tvm_fusion runs interleaved with them 1.7-2x
                  # slower (resnet_tiny, alternating A/B runs on a shared 2-core machine).
                  hints.enable_cpu_pinning: False}
        if precision is not None:
            config[hints.inference_precision] = getattr(ov.Type, precision)
            config[DYNAMIC_QUANTIZATION] = 0
        try:
            core = ov.Core()
            model = core.read_model(str(model_path))
            # At the shapes the other runners run at (a dynamic dim would leave OpenVINO guessing).
            model.reshape({name: list(value.shape) for name, value in inputs.items()})
            self.compiled = core.compile_model(model, "CPU", config)
            self.precision = self.compiled.get_property(hints.inference_precision).to_string()
            group = int(self.compiled.get_property(DYNAMIC_QUANTIZATION))
            if group:
                self.precision += f" with int8 fully connected inputs (groups of {group})"
        except RuntimeError as err:  # OpenVINO raises RuntimeError (or a subclass) for all of these
            # Its messages open with a source location; the reason comes after it, on later lines.
            raise ModelError(f"OpenVINO cannot compile {model_path}: {' '.join(str(err).split())[:400]}",
                             "drop --peer openvino for this model") from err
        self._request = self.compiled.create_infer_request()
        # Kept alive here: the tensors share these arrays' memory.
        self._inputs = {name: np.require(value, requirements="C") for name, value in inputs.items()}
        for name, value in self._inputs.items():
            self._request.set_tensor(name, ov.Tensor(value, shared_memory=True))

    def run(self) -> None:
        self._request.infer()

    def outputs(self, names) -> dict:
        """The last run's outputs (numpy arrays) by ONNX output name, copied: the request reuses
        its buffers."""
        return {name: self._request.get_tensor(name).data.copy() for name in names}
