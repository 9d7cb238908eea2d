"""Default CPU schedule rules, in the order they are tried."""

from .fallback import Fallback
from .injective import Injective
from .matmul_epilogue import MatmulEpilogue
from .reduction import Reduction

__all__ = ["Fallback", "Injective", "MatmulEpilogue", "Reduction"]
