"""The registry: every pattern module registered once, with a name, a description and tests."""

from pathlib import Path

from tvm_fusion.patterns import PATTERNS, FusionRule, RewriteRule

TESTS = Path(__file__).parent


def test_every_pattern_is_named_described_and_tested():
    for name, rule in PATTERNS.items():
        assert rule.name == name
        assert isinstance(rule, (RewriteRule, FusionRule))
        assert rule.description
        assert rule.variants(), name
        assert (TESTS / f"test_{name}.py").is_file(), f"pattern {name} has no tests/patterns/test_{name}.py"


def test_gemm_epilogue_variants_put_longer_chains_first():
    variants = [name for name, _, _ in PATTERNS["gemm_epilogue"].variants()]
    assert len(variants) == len(set(variants)) == 2 * 10 * 2 - 1  # bias x (9 activations + none) x residual
    assert variants.index("matmul_bias_gelu_residual") < variants.index("matmul_bias_gelu")
    assert variants.index("matmul_bias_gelu") < variants.index("matmul_bias")
    assert variants.index("matmul_bias") < variants.index("matmul_residual")
