"""What ships with tvm_fusion besides code: the target configs, the tuning logs, the demo model.

In a checkout they are the repository's own ``configs/``, ``tuning_logs/`` and ``examples/``;
an installed wheel carries copies of them under ``tvm_fusion/_bundled/`` (setup.py puts them
there), so a config is found by name and compile works from any directory.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
DEFAULT_CONFIG_NAME = "x86_64-host"
DEMO_MODEL = "bert_tiny.onnx"


def root() -> Path:
    """``tvm_fusion/_bundled`` in a wheel, the repository root in a checkout."""
    installed = _PACKAGE / "_bundled"
    return installed if installed.is_dir() else _PACKAGE.parent


def config_dir() -> Path:
    return root() / "configs"


def config_names() -> list[str]:
    return sorted(path.stem for path in config_dir().glob("*.toml"))


def config_path(name: str) -> Path | None:
    """The shipped config called ``name`` (with or without ``.toml``), None if there is none."""
    stem = name[:-5] if name.endswith(".toml") else name
    if not stem or "/" in stem or os.sep in stem:
        return None
    path = config_dir() / f"{stem}.toml"
    return path if path.is_file() else None


def shipped_tuning_logs() -> Path:
    """Tuning records shipped with the package: read after the user's store, never written."""
    return root() / "tuning_logs"


def user_tuning_logs() -> Path:
    """Where ``tune`` writes by default: ``$TVM_FUSION_TUNING_LOGS``, else
    ``$XDG_DATA_HOME/tvm_fusion/tuning_logs`` (``~/.local/share`` when XDG_DATA_HOME is unset),
    so that nothing is written into the package or the current directory unasked."""
    explicit = os.environ.get("TVM_FUSION_TUNING_LOGS")
    if explicit:
        return Path(explicit).expanduser().resolve()
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home).expanduser().resolve() / "tvm_fusion" / "tuning_logs"


def demo_model() -> Path:
    return root() / "examples" / "models" / DEMO_MODEL
