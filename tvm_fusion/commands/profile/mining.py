"""``profile --mine``: chains of adjacent kernels that no pattern fused, whose intermediates pass
through DRAM between them, ranked by what fusing them could save: candidates for the next pattern."""

from __future__ import annotations

import collections
import dataclasses

import tvm
from tvm import relax

from .report import Chain, KernelProfile


@dataclasses.dataclass
class KernelCall:
    kernel: str
    output_bytes: int
    inputs: list[int]       # indices of the calls whose outputs it reads
    model_output: bool = False  # its output leaves main: it must reach memory anyway


def kernel_graph(lowered) -> list[KernelCall]:
    """The call_tir sites of ``main`` in order, each with the earlier calls it reads."""
    func = lowered["main"]
    producer: dict = {}
    calls: list[KernelCall] = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Var) and value in producer:
                producer[binding.var] = producer[value]
            elif isinstance(value, relax.TupleGetItem) and value.tuple_value in producer:
                producer[binding.var] = producer[value.tuple_value]
            elif isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir":
                args = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else [value.args[1]]
                reads = sorted({producer[a] for a in args if a in producer})
                producer[binding.var] = len(calls)
                calls.append(KernelCall(value.args[0].name_hint, _type_bytes(binding.var.ty), reads))
    returned: set[int] = set()
    relax.analysis.post_order_visit(func.body.body, lambda e: returned.add(producer[e])
                                    if isinstance(e, relax.Var) and e in producer else None)
    for index in returned:
        calls[index].model_output = True
    return calls


def _type_bytes(ty) -> int:
    if isinstance(ty, relax.TupleType):
        return sum(_type_bytes(field) for field in ty.fields)
    count = 1
    for dim in ty.shape.values:
        count *= int(dim)
    return count * ((tvm.runtime.DataType(str(ty.dtype)).bits + 7) // 8)


def mine_chains(calls: list[KernelCall], kernels: dict[str, KernelProfile], gbytes_per_s: float,
                per_launch_us: float, longest: int = 3, top: int = 10) -> list[Chain]:
    """Chains of 2..``longest`` adjacent kernel calls where each intermediate is read by the
    next call only (so a fusion could keep it out of DRAM), ranked by estimated gain.

    Gain: the intermediates written and read back, at the measured bandwidth, plus one saved
    launch per fused edge, at most the chain's own time.
    """
    consumers: dict[int, list[int]] = collections.defaultdict(list)
    for index, call in enumerate(calls):
        for source in call.inputs:
            consumers[source].append(index)

    def next_of(index: int) -> int | None:
        readers = consumers.get(index, [])
        return readers[0] if len(readers) == 1 and not calls[index].model_output else None

    chains = []
    for start in range(len(calls)):
        path = [start]
        while len(path) < longest and (following := next_of(path[-1])) is not None:
            path.append(following)
            saved = sum(2 * calls[i].output_bytes for i in path[:-1])
            us = sum(kernels[calls[i].kernel].us_per_call for i in path if calls[i].kernel in kernels)
            gain = min(us, saved / (gbytes_per_s * 1e3) + per_launch_us * (len(path) - 1))
            chains.append(Chain([calls[i].kernel for i in path],
                                [kernels[calls[i].kernel].kind if calls[i].kernel in kernels else "?"
                                 for i in path], us, saved, gain))
    chains.sort(key=lambda c: -c.gain_us)
    return chains[:top]
