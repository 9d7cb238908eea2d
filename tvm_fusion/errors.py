"""Errors a user can act on: each names the culprit and says how to fix it.

The CLI prints ``str(error)`` and exits with ``error.exit_code``; anything else is a bug.
Each kind of error declares its exit code on its class line (``exit_code=N``), so the codes
read as one table; README's exit-code table has a row for each.

Hints name the CLI's flags. Shown to a Python caller (outside ``cli_context``), the text also
names the API parameter behind each flag it mentions.
"""

import contextlib
import contextvars
import re

# The Python API's parameter behind each CLI flag a hint may name.
PARAMETERS = {
    "--input-shape": "input_shapes", "--input-value": "input_shapes", "--config": "config",
    "-o/--output-dir": "output_dir", "--output-dir": "output_dir", "--tuning-log": "tuning_log",
    "--no-tuning-log": "tuning_log=False", "--bucket": "buckets", "--no-fusion-gate": "fusion_gate=False",
    "--no-verify": "verify=False", "--repeat": "repeat", "--peer": "peers", "--onnx": "path",
    "--graph": "graph", "--trials": "trials", "--log-dir": "log_dir", "--precision": "precision",
}
_FLAG = re.compile(r"(?<![\w-])(-o/--output-dir|--[a-z][a-z-]*)")
_in_cli = contextvars.ContextVar("tvm_fusion_in_cli", default=False)


@contextlib.contextmanager
def cli_context():
    """Inside the CLI's ``main``: its users know the flags, so errors name only those."""
    token = _in_cli.set(True)
    try:
        yield
    finally:
        _in_cli.reset(token)


def python_parameters(text: str) -> str:
    """``--input-shape -> input_shapes, ...`` for the flags ``text`` names, or ''."""
    named = dict.fromkeys(PARAMETERS[flag] and f"{flag} -> {PARAMETERS[flag]}"
                          for flag in _FLAG.findall(text) if flag in PARAMETERS)
    return ", ".join(named)


class TvmFusionError(Exception):
    """Base class: a message naming the culprit, plus a hint saying how to fix it."""

    exit_code = 1

    def __init_subclass__(cls, exit_code: int | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if exit_code is not None:  # a refinement of a kind (verify's ReferenceUnavailable) keeps its code
            cls.exit_code = exit_code

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  fix: {hint}")

    def __str__(self) -> str:
        text = super().__str__()
        parameters = "" if _in_cli.get() else python_parameters(text)
        return f"{text}\n  from Python: {parameters}" if parameters else text


class ConfigError(TvmFusionError, exit_code=2):
    """A pipeline config file is missing, unreadable, or has a bad key or value."""


class ModelError(TvmFusionError, exit_code=3):
    """The model file is missing, not ONNX, invalid, or uses ops TVM cannot import."""


class ShapeError(TvmFusionError, exit_code=4):
    """An input shape is unbound, malformed, or does not fit the model."""


class VerificationError(TvmFusionError, exit_code=5):
    """The compiled module disagrees with ONNX Runtime beyond the configured tolerance."""


class ArtifactError(TvmFusionError, exit_code=6):
    """A build artifact is missing, damaged, or was given inputs that do not match it."""


class ToolchainError(TvmFusionError, exit_code=7):
    """A compiler or emulator the target needs is not installed; the message names the package."""


class TuningLogError(TvmFusionError, exit_code=8):
    """A tuning log cannot be read or written, or was asked something it cannot answer."""


class PluginError(TvmFusionError, exit_code=9):
    """A pattern or schedule rule (built in or from a plugin) cannot be loaded or ordered."""
