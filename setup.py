"""Copies the shipped data (configs, tuning logs, the demo model) into the wheel's
``tvm_fusion/_bundled/``: package data must live inside the package, and these live at the
repository's top level, where users and the docs expect them. ``tvm_fusion.bundled`` finds
either place. Everything else is declared in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = {"configs": "*.toml", "tuning_logs": "**/*", "examples/models": "bert_tiny.onnx"}


class BuildWithShippedData(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "tvm_fusion" / "_bundled"
        for folder, pattern in SHIPPED.items():
            for source in sorted((ROOT / folder).glob(pattern)):
                if source.is_file() and not source.name.startswith("."):
                    destination = target / source.relative_to(ROOT)
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    self.copy_file(str(source), str(destination))


setup(cmdclass={"build_py": BuildWithShippedData})
