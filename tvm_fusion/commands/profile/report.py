"""What ``profile`` reports: per-kernel times, costs and roofline position, the end-to-end gap,
and the mined chains; ``to_json`` is the ``--json`` file."""

from __future__ import annotations

import dataclasses

from ...runtime.latency import LatencyStats
from ...machine_peak import MachinePeak


FAR_OFF_ROOF_PERCENT = 10.0
FAR_OFF_SHARE = 0.05


@dataclasses.dataclass
class KernelProfile:
    name: str
    pattern: str            # the fusion pattern variant, or "tvm FuseOps" / "single op"
    rule: str               # the schedule rule
    kind: str               # conv, matmul, pool, injective, reduction, ... (for mining)
    calls: int
    us_per_call: float      # on its own, warm caches
    us_in_model: float      # per call, inside the model run
    share: float            # of the sum of kernel times (on their own)
    flops: int
    bytes: int              # parameters read and written once: the compulsory traffic
    gflops: float
    gbytes_per_s: float
    intensity: float        # FLOP per byte
    # "compute" or "memory": which roof is lower at this intensity ("AMX-BF16 compute" or
    # "AMX-INT8 memory" for a bf16 or int8 kernel, against that roof and its ridge)
    bound: str
    roof_percent: float     # achieved / the lower roof at this intensity
    onnx_nodes: list[str]
    # the compute roof it is set against: "FMA" (float32), "AMX-BF16", "AVX512_BF16", "AMX-INT8" or
    # "AVX512-VNNI"
    compute_roof: str = "FMA"
    compute_roof_gflops: float = 0.0
    # what its sum multiplies (machine_peak.ROOF_KINDS): for "int8", flops, gflops and intensity
    # count integer operations (a multiply and an add per uint8 x int8 product), not FLOPs
    roof_kind: str = "float32"

    @property
    def total_us(self) -> float:
        return self.us_per_call * self.calls

    @property
    def far_off_roof(self) -> bool:
        """Under ``FAR_OFF_ROOF_PERCENT`` of its roof while taking more than ``FAR_OFF_SHARE``
        of the kernel time: the kernels worth a rule of their own, marked so none hides."""
        return self.roof_percent < FAR_OFF_ROOF_PERCENT and self.share > FAR_OFF_SHARE


@dataclasses.dataclass
class Gap:
    """End to end against the kernels: where the time between them goes (ms per model run)."""

    end_to_end_ms: float
    kernels_alone_ms: float     # the kernels timed one by one, summed (x calls)
    kernels_in_model_ms: float  # the same kernels as the model runs them
    dispatch_ms: float          # the VM program with empty kernels: interpretation + allocation
    builtin_calls: dict[str, int]

    @property
    def gap_ms(self) -> float:
        return self.end_to_end_ms - self.kernels_alone_ms

    @property
    def in_model_extra_ms(self) -> float:
        """Kernels slower in the model than alone: cold caches, workers woken from sleep."""
        return self.kernels_in_model_ms - self.kernels_alone_ms

    @property
    def unexplained_ms(self) -> float:
        return self.end_to_end_ms - self.dispatch_ms - self.kernels_in_model_ms

    def line(self) -> str:
        return (f"gap: end to end {self.end_to_end_ms:.3f} ms - kernels alone {self.kernels_alone_ms:.3f} ms "
                f"= {self.gap_ms:.3f} ms: kernels slower in the model (cold caches, thread wake-up) "
                f"{self.in_model_extra_ms:.3f} ms, VM dispatch + allocation {self.dispatch_ms:.3f} ms, "
                f"other {self.unexplained_ms:.3f} ms")


@dataclasses.dataclass
class Chain:
    """Adjacent kernels no pattern fused, the intermediates passing through DRAM between them."""

    kernels: list[str]
    kinds: list[str]
    us: float               # their time per model run (calls of this exact chain: 1)
    saved_bytes: int        # intermediates written and read back, which a fusion would not
    gain_us: float          # estimate: saved bytes at the measured bandwidth + the saved launches

    @property
    def label(self) -> str:
        return " -> ".join(self.kinds)


@dataclasses.dataclass
class ProfileReport:
    model: str
    threads: int
    peak: MachinePeak
    kernels: list[KernelProfile]
    gap: Gap
    chains: list[Chain] | None = None
    artifact: str | None = None  # the artifact directory profiled, when it was one
    end_to_end: LatencyStats | None = None

    def far_off_roof_line(self) -> str | None:
        far = [k.name for k in self.kernels if k.far_off_roof]
        if not far:
            return None
        return (f"! far off the roof: {len(far)} kernel(s) under {FAR_OFF_ROOF_PERCENT:.0f} % of their roof take more "
                f"than {100 * FAR_OFF_SHARE:.0f} % of the kernel time: {', '.join(far)}")

    def to_json(self) -> dict:
        return {"model": self.model, "artifact": self.artifact, "threads": self.threads,
                "end_to_end": self.end_to_end.to_json() if self.end_to_end else None,
                "peak": {**dataclasses.asdict(self.peak), "ridge_flop_per_byte": self.peak.ridge},
                "kernels": [{**dataclasses.asdict(k), "total_us": k.total_us, "far_off_roof": k.far_off_roof}
                            for k in self.kernels],
                "far_off_roof": [k.name for k in self.kernels if k.far_off_roof],
                "gap": {**dataclasses.asdict(self.gap), "gap_ms": self.gap.gap_ms,
                        "in_model_extra_ms": self.gap.in_model_extra_ms,
                        "unexplained_ms": self.gap.unexplained_ms},
                "chains": None if self.chains is None else
                [{**dataclasses.asdict(c), "label": c.label} for c in self.chains]}

