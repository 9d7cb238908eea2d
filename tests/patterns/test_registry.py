"""The registry: every pattern module found once, with a name, a description and tests, in an
order that keeps every declared runs_before/runs_after; and the fused ONNX of each pattern
(``onnx_export/fusions/<pattern>.py``, or a plugin's entry point), read from it."""

import importlib
import pkgutil
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from tvm_fusion import plugins
from tvm_fusion.errors import PluginError
from tvm_fusion.onnx_export import DOMAIN, OnnxSpec, fusions
from tvm_fusion.onnx_export import registry as onnx_registry
from tvm_fusion.onnx_export.reference_ops import FusedOp
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
    assert len(variants) == len(set(variants)) == 2 * 11 * 2 - 1  # bias x (10 activations + none) x residual
    assert variants.index("matmul_bias_gelu_residual") < variants.index("matmul_bias_gelu")
    assert variants.index("matmul_bias_gelu") < variants.index("matmul_bias")
    assert variants.index("matmul_bias") < variants.index("matmul_residual")


# The fused ONNX of each pattern (onnx_export/fusions/<pattern>.py), found from this registry -------

def test_every_fused_onnx_spec_lives_in_a_module_named_after_its_pattern():
    specs = onnx_registry.onnx_specs()
    assert list(specs) == [name for name in pattern_registry() if name in specs]  # the registry's order
    modules = {info.name for info in pkgutil.iter_modules(fusions.__path__)}
    for name, spec in specs.items():
        assert importlib.import_module(f"{fusions.__name__}.{name}").SPEC is spec, name
        for op in spec.ops:
            assert op.op_domain == DOMAIN
    assert modules - set(specs) == {"activation"}  # the one op shared alike by six rewrites
    # Patterns whose matches keep their ONNX nodes: a Clip-only or Dropout-only rewrite, a PRelu or
    # a Max/Min of two (standard ops already), and the rewrites that only fusions read (their nodes
    # go with the fusion that absorbs them), the jax2tf norm and softmax (standard ops as exported),
    # and an STFT's power spectrum (its matmul exists only after two passes: docs/onnx-ops.md).
    assert set(pattern_registry()) - set(specs) == {"conv_affine_fold", "dropout", "gather_constant_index",
                                                    "layernorm_one_pass", "power_spectrum", "prelu",
                                                    "single_head_attention", "softmax_decomposed",
                                                    "softmax_flattened", "stacked_max_min"}


def test_builders_and_fused_ops_are_read_from_the_specs():
    specs = onnx_registry.onnx_specs()
    assert onnx_registry.builders() == {name: spec.build for name, spec in specs.items()}
    ops = onnx_registry.fused_ops()
    assert len({op.__name__ for op in ops}) == len(ops)
    assert {op.__name__ for op in ops} == {op.__name__ for spec in specs.values() for op in spec.ops}
    assert "GroupNorm" in {op.__name__ for op in ops}


class Mish(FusedOp):
    def _run(self, x):
        return (x * np.tanh(np.log1p(np.exp(x))),)


class MishRule(RewriteRule):
    name = "mish"
    description = "a plugin's pattern"


def _spec_entry_points(monkeypatch, *specs: OnnxSpec) -> None:
    """``specs`` as a plugin's ``tvm_fusion.onnx_export`` entry points."""

    class SpecEntryPoint(metadata.EntryPoint):
        def load(self):
            return specs[int(self.name)]

    entries = [SpecEntryPoint(str(n), f"plugin:spec{n}", onnx_registry.ENTRY_POINT_GROUP) for n in range(len(specs))]
    monkeypatch.setattr(plugins.metadata, "entry_points",
                        lambda group: entries if group == onnx_registry.ENTRY_POINT_GROUP else [])


def test_a_plugin_brings_the_fused_onnx_of_its_pattern(monkeypatch):
    build = onnx_registry.builders()["silu"]  # any builder: only the spec's place is tested
    mish = OnnxSpec("mish", build, (Mish,))
    monkeypatch.setitem(pattern_registry(), "mish", MishRule())  # a registered plugin pattern
    _spec_entry_points(monkeypatch, mish)
    assert onnx_registry.onnx_specs()["mish"] is mish
    assert Mish in onnx_registry.fused_ops()


@pytest.mark.parametrize("spec, message", [
    (OnnxSpec("nonesuch", lambda region, variant: [], ()), "is for 'nonesuch', which is no registered pattern"),
    (OnnxSpec("silu", lambda region, variant: [], ()), "is a second spec for pattern 'silu'"),
])
def test_a_spec_for_no_pattern_or_a_second_one_is_refused(monkeypatch, spec, message):
    _spec_entry_points(monkeypatch, spec)
    with pytest.raises(PluginError, match=message):
        onnx_registry.onnx_specs()


def test_two_ops_of_one_name_are_refused(monkeypatch):
    class GroupNorm(FusedOp):  # the op type of group_norm's op, defined again
        def _run(self, x):
            return (x,)

    monkeypatch.setitem(pattern_registry(), "mish", MishRule())
    _spec_entry_points(monkeypatch, OnnxSpec("mish", lambda region, variant: [], (GroupNorm,)))
    with pytest.raises(PluginError, match="defines the fused ONNX op 'GroupNorm'"):
        onnx_registry.fused_ops()
