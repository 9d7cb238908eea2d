"""How ``profile`` times a model, all in one process, in interleaved rounds, medians reported:

* end to end: ``main`` as a user calls it;
* each kernel on its own: inside a VM instrument hook, the kernel is run again on the very
  tensors the model just gave it (warm caches, the way a per-kernel benchmark times it);
* each kernel in the model: the hook's before/after time, minus the same hook around an empty
  kernel (the hook's own cost);
* dispatch: ``main`` of the same VM program with every kernel body emptied: VM interpretation,
  allocation and the calls themselves, with no kernel work.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import tvm
from tvm import relax, tirx

from ...runtime.latency import LatencyStats


def empty_kernels(module):
    """The same module with every kernel's body emptied: what is left is the VM's own work."""
    emptied = module.clone()
    for gvar, func in module.functions_items():
        if isinstance(func, tirx.PrimFunc):
            emptied[gvar] = func.with_body(tirx.Evaluate(0))
    return emptied


@dataclasses.dataclass
class Timings:
    end_to_end_ms: float
    dispatch_ms: float
    alone_us: dict[str, float]      # kernel -> per call, warm
    in_model_us: dict[str, float]   # kernel -> per call, in the model
    calls: dict[str, int]           # kernel -> calls per model run
    builtin_calls: dict[str, int]
    end_to_end: LatencyStats | None = None  # the whole model's runs, as bench and run report them


def time_model(executable, empty_executable, kernels: set[str], args: list, rounds: int = 30,
               kernel_rounds: int = 5, repeats: int = 10) -> Timings:
    """Medians of interleaved rounds; see the module docstring for what each number is."""
    def vm_main(executable, instrument=None):
        vm = relax.VirtualMachine(executable, tvm.cpu())
        if instrument is not None:
            vm.set_instrument(instrument)
        return vm["main"]

    plain, empty = vm_main(executable), vm_main(empty_executable)
    ends: dict[str, list[float]] = {"plain": [], "empty": []}
    for _ in range(3):
        plain(*args), empty(*args)
    for _ in range(rounds):
        for name, run in (("plain", plain), ("empty", empty)):
            start = time.perf_counter()
            run(*args)
            ends[name].append(time.perf_counter() - start)

    started: dict[str, float] = {}
    hooked: dict[str, list[float]] = collections.defaultdict(list)

    def stopwatch(_func, name, before_run, _ret, *_args):
        if before_run:
            started[name] = time.perf_counter()
        else:
            hooked[name].append(time.perf_counter() - started.pop(name))
        return relax.VMInstrumentReturnKind.NO_OP

    alone: dict[str, list[float]] = collections.defaultdict(list)

    def rerun(func, name, before_run, _ret, *call_args):
        if before_run and name in kernels:
            func(*call_args)  # the real call follows and rewrites the outputs
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                func(*call_args)
                samples.append(time.perf_counter() - start)
            alone[name].append(float(np.median(samples)))
        return relax.VMInstrumentReturnKind.NO_OP

    timed_plain, timed_empty = vm_main(executable, stopwatch), vm_main(empty_executable, stopwatch)
    timed_alone = vm_main(executable, rerun)
    in_model: dict[str, list[float]] = collections.defaultdict(list)
    hook_cost: dict[str, list[float]] = collections.defaultdict(list)
    timed_plain(*args)
    for _ in range(kernel_rounds):
        for run, into in ((timed_plain, in_model), (timed_empty, hook_cost)):
            hooked.clear()
            run(*args)
            for name, values in hooked.items():
                into[name] += values
        timed_alone(*args)
    # Calls per run of the model itself: the empty twin may call other functions (a kernel the
    # real build turned into vm.builtin.reshape is still a call there).
    calls = {name: len(values) // kernel_rounds for name, values in in_model.items() if name in kernels}
    builtins = {name: len(values) // kernel_rounds for name, values in in_model.items() if name not in kernels}
    return Timings(
        end_to_end_ms=float(np.median(ends["plain"])) * 1e3,
        dispatch_ms=float(np.median(ends["empty"])) * 1e3,
        alone_us={k: float(np.median(v)) * 1e6 for k, v in alone.items()},
        in_model_us={k: max(0.0, float(np.median(v) - np.median(hook_cost.get(k, [0.0])))) * 1e6
                     for k, v in in_model.items() if k in kernels},
        calls=calls, builtin_calls=builtins, end_to_end=LatencyStats.of(ends["plain"]))
