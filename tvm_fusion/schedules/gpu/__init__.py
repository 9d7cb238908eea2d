"""Default GPU (CUDA) schedule rules, one per module, re-exported here by name (alphabetical).

As for ``cpu/``, this list sets no order and registers nothing: the registry finds every rule by
its module, asks them in the order their ``runs_before``/``runs_after`` declare, and after them
TVM's dlight GPU rules (``schedules/registry.py``).
"""

from .warp_norm import WarpNorm
from .warp_softmax import WarpSoftmax

__all__ = ["WarpNorm", "WarpSoftmax"]
