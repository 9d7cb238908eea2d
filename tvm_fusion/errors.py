"""Errors a user can act on: each names the culprit and says how to fix it.

The CLI prints ``str(error)`` and exits with ``error.exit_code``; anything else is a bug.
"""


class TvmFusionError(Exception):
    """Base class: a message naming the culprit, plus a hint saying how to fix it."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  fix: {hint}")


class ConfigError(TvmFusionError):
    """A pipeline config file is missing, unreadable, or has a bad key or value."""

    exit_code = 2


class ModelError(TvmFusionError):
    """The model file is missing, not ONNX, invalid, or uses ops TVM cannot import."""

    exit_code = 3


class ShapeError(TvmFusionError):
    """An input shape is unbound, malformed, or does not fit the model."""

    exit_code = 4


class VerificationError(TvmFusionError):
    """The compiled module disagrees with ONNX Runtime beyond the configured tolerance."""

    exit_code = 5


class ArtifactError(TvmFusionError):
    """A build artifact is missing, damaged, or was given inputs that do not match it."""

    exit_code = 6


class ToolchainError(TvmFusionError):
    """A compiler or emulator the target needs is not installed; the message names the package."""

    exit_code = 7


class TuningLogError(TvmFusionError):
    """A tuning log cannot be read or written, or was asked something it cannot answer."""

    exit_code = 8
