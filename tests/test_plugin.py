"""Plugins by entry point: examples/plugin installed as a user would, its own tests run, and a
plugin that does not load refused with its package named."""

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tvm_fusion import plugins
from tvm_fusion.errors import PluginError
from tvm_fusion.patterns import registered_patterns, registry

PLUGIN = Path(__file__).parents[1] / "examples" / "plugin"


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> tuple[Path, Path]:
    """(site folder, source copy): examples/plugin copied (pip's build files stay out of the
    tree) and installed by pip into a folder of its own, not into the suite's environment,
    where its pattern would join every other test's compile."""
    root = tmp_path_factory.mktemp("plugin")
    source, target = root / "source", root / "site"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True)
    return target, source


def test_the_example_plugin_passes_its_own_tests_once_installed(installed_plugin):
    # Its tests check that both entry points are found and ordered, that the pattern fuses both
    # Mish spellings and declines a shared softplus, and that its rule schedules the kernel.
    target, source = installed_plugin
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=source, env={**os.environ, "PYTHONPATH": str(target)},
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout


def test_without_the_plugin_its_pattern_is_not_registered():
    assert "mish" not in registered_patterns()


class BrokenEntryPoint(metadata.EntryPoint):
    def load(self):
        raise ImportError("No module named 'tvm_fusion_gone'")


def test_a_plugin_that_does_not_load_is_refused_naming_it(monkeypatch):
    broken = BrokenEntryPoint("gone", "tvm_fusion_gone.pattern:Gone", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins.metadata, "entry_points", lambda group: [broken] if group == broken.group else [])
    registry.pattern_registry.cache_clear()
    try:
        with pytest.raises(PluginError, match=r"entry point 'gone' \(tvm_fusion_gone.pattern:Gone\).* does not "
                                              r"load: ImportError") as error:
            registered_patterns()
        assert error.value.exit_code == 9
    finally:
        registry.pattern_registry.cache_clear()


def test_an_entry_point_that_is_not_a_rule_is_refused(monkeypatch):
    not_a_rule = metadata.EntryPoint("odd", "json:dumps", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins.metadata, "entry_points", lambda group: [not_a_rule] if group == not_a_rule.group else [])
    registry.pattern_registry.cache_clear()
    try:
        with pytest.raises(PluginError, match="entry point 'odd' .* is not a named RewriteRule or FusionRule"):
            registered_patterns()
    finally:
        registry.pattern_registry.cache_clear()
