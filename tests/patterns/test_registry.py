"""The registry: every pattern module found once, with a name, a description and tests, in an
order that keeps every declared runs_before/runs_after."""

from pathlib import Path

import pytest

from tvm_fusion.errors import PluginError
from tvm_fusion.patterns import FusionRule, RewriteRule, pattern_registry, registry

TESTS = Path(__file__).parent
PACKAGE = Path(registry.__file__).parent
HELPER_MODULES = {"__init__", "base", "registry", "activations"}


def test_every_pattern_is_named_described_and_tested():
    for name, rule in pattern_registry().items():
        assert rule.name == name
        assert isinstance(rule, (RewriteRule, FusionRule))
        assert rule.description
        assert rule.variants(), name
        assert (TESTS / f"test_{name}.py").is_file(), f"pattern {name} has no tests/patterns/test_{name}.py"


def test_every_pattern_module_is_found_without_a_list():
    modules = {path.stem for path in PACKAGE.glob("*.py")} - HELPER_MODULES
    found = {type(rule).__module__.rsplit(".", 1)[1] for rule in pattern_registry().values()}
    assert found == modules


def test_rewrites_run_before_fusions_and_declarations_hold():
    names = list(pattern_registry())
    kinds = [isinstance(pattern_registry()[n], RewriteRule) for n in names]
    assert kinds == sorted(kinds, reverse=True)  # all rewrites, then all fusions
    for index, (name, rule) in enumerate(pattern_registry().items()):
        for later in rule.runs_before:
            assert names.index(later) > index, (name, later)
        for earlier in rule.runs_after:
            assert names.index(earlier) < index, (earlier, name)
    # The orders the fusions' results depend on (see each module's runs_before/runs_after).
    assert names.index("clip") < names.index("hardswish") < names.index("hardsigmoid")
    assert names.index("squeeze_excitation") < names.index("conv_epilogue") < names.index("resize_merge")
    assert names.index("skip_layernorm") < names.index("gemm_epilogue")


class EarlyFusion(FusionRule):
    name = "early_fusion"
    description = "a fusion that claims to run before a rewrite"
    runs_before = ("clip",)


class Clash(RewriteRule):
    name = "gemm_epilogue"
    description = "a rewrite named like a built-in fusion"


@pytest.mark.parametrize("plugin, message", [
    (EarlyFusion, "pattern 'early_fusion' runs_before 'clip', but rewrites always run before fusions"),
    (Clash, "two patterns are named 'gemm_epilogue'"),
])
def test_registry_refuses_a_plugin_that_breaks_the_order(monkeypatch, plugin, message):
    monkeypatch.setattr(registry, "plugin_rules", lambda group, kinds: [plugin()])
    registry.pattern_registry.cache_clear()
    try:
        with pytest.raises(PluginError, match=message):
            pattern_registry()
    finally:
        registry.pattern_registry.cache_clear()


def test_gemm_epilogue_variants_put_longer_chains_first():
    variants = [name for name, _, _ in pattern_registry()["gemm_epilogue"].variants()]
    assert len(variants) == len(set(variants)) == 2 * 10 * 2 - 1  # bias x (9 activations + none) x residual
    assert variants.index("matmul_bias_gelu_residual") < variants.index("matmul_bias_gelu")
    assert variants.index("matmul_bias_gelu") < variants.index("matmul_bias")
    assert variants.index("matmul_bias") < variants.index("matmul_residual")
