"""Kernels that only a generic schedule rule took, though they deserve a rule of their own.

Reduction, Injective and Fallback schedule anything, and a contraction under them runs at a few
percent of the machine's roof. Each new exporter brings a spelling or an op family that no
pattern or rule claims (an Einsum, a GroupNorm written its own way); this guard names every
kernel a generic rule scheduled that holds a contraction (a matmul, conv or einsum in any
spelling) or more than 1 % of the model's FLOPs, with its ONNX nodes and FLOPs, so that such a
kernel cannot hide: ``compile`` and ``inspect`` print it and record it, and the zoo report
fails a model that has one. An element-wise kernel (an LSTM's gates) has its proper rule in
Injective whatever its share of the FLOPs: it is reported only if it holds a contraction; so has
a whole tensor reduced to one value (quantization's min and max) in WholeTensorReduction, and in
Reduction where that one declines (a tensor shorter than two vectors, a strided read).
"""

from __future__ import annotations

import dataclasses

import tvm

from ..frontend.dims import evaluate_dim
from ..fusion_gate import typical_sizes
from ..kernels.costs import has_contraction, kernel_costs
from ..preparation import PreparedModel
from ..provenance import kernel_onnx_nodes
from ..session import Scheduled

GENERIC_RULES = frozenset({"Reduction", "Injective", "Fallback"})
FLOP_SHARE = 0.01  # a generic kernel above this share of the model's FLOPs is reported


@dataclasses.dataclass
class GenericKernel:
    kernel: str
    rule: str
    onnx_nodes: list[str]
    flops: int          # at each range's typical size
    flop_share: float   # of the model's FLOPs
    contraction: bool

    def line(self) -> str:
        what = "holds a contraction" if self.contraction else f"does {100 * self.flop_share:.1f} % of the FLOPs"
        nodes = ", ".join(self.onnx_nodes[:4]) + (" ..." if len(self.onnx_nodes) > 4 else "") or "-"
        return (f"kernel {self.kernel} ({self.flops:,} FLOPs; ONNX {nodes}) {what} but only the generic "
                f"{self.rule} rule scheduled it")


def generic_kernels(scheduled: Scheduled, prepared: PreparedModel) -> list[GenericKernel]:
    """The kernels of ``scheduled`` that a generic rule took and that hold a contraction or
    more than ``FLOP_SHARE`` of the FLOPs, heaviest first."""
    lowered = scheduled.lowered.module
    sizes = typical_sizes(lowered)

    def extent(dim) -> int:
        try:
            return evaluate_dim(dim, sizes)
        except (KeyError, TypeError, ValueError):  # a data-dependent size: counted once
            return 1

    funcs = {gvar.name_hint: func for gvar, func in lowered.functions_items() if isinstance(func, tvm.tirx.PrimFunc)}
    # Shares of all arithmetic, integer included: an int8 model's products are most of its work.
    flops = {name: kernel_costs(func, extent, integers=True)[0] for name, func in funcs.items()}
    total = sum(flops.values()) or 1
    found = []
    for name, func in funcs.items():
        rule = scheduled.schedule_rules.get(name)
        if rule not in GENERIC_RULES:
            continue
        contraction = has_contraction(func)
        heavy = rule != "Injective" and not _to_one_value(func) and flops[name] > FLOP_SHARE * total
        if contraction or heavy:
            found.append(GenericKernel(name, rule, [], flops[name], flops[name] / total, contraction))
    if found:  # the node map walks the whole graph: only for a model that has such a kernel
        nodes = kernel_onnx_nodes(scheduled.lowered.kernel_bindings, scheduled.report, prepared.simplified)
        for kernel in found:
            kernel.onnx_nodes = nodes.get(kernel.kernel, [])
    return sorted(found, key=lambda kernel: -kernel.flops)


def _to_one_value(func: tvm.tirx.PrimFunc) -> bool:
    """A whole tensor reduced to one value (a DynamicQuantizeLinear's min and max): Reduction is
    its rule where WholeTensorReduction declines it, as Injective is an element-wise kernel's."""
    shape = func.params[-1].shape  # the output buffer (params are buffers in TVM 0.27)
    return all(isinstance(dim, tvm.tirx.IntImm) and int(dim) == 1 for dim in shape)
