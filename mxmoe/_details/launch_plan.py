"""Launch plans: the kernels of one call described as data, run through Triton's JIT on the first call of a kind,
then launched directly from the compiled kernels.

A :class:`KernelLaunch` is one kernel launch as the JIT takes it (kernel, grid, positional arguments, keyword
options). The launch sequence of a call (``launch.describe``) is a list of them; nothing in it depends on a value the
GPU computes, so the list is known on the host before anything runs.

A :class:`LaunchPlan` is that list compiled: per launch, the compiled kernel's launcher, its grid, and its argument
list with every pointer already an int, except the *call tensors* (``x``, ``topk_weights``, ``topk_ids``,
``expert_map``, ``out``), whose addresses are filled in per call. Running a plan is one C launcher call per kernel:
no argument binding, no specialization, no cache lookup, no ``data_ptr`` or ``cuPointerGetAttribute`` per pointer.

Recording runs the sequence through the JIT (that call's work) and keeps the kernels the JIT chose. A plan is
valid for every later call whose arguments the JIT would specialize the same way: ``launch.plan_key`` holds T, the
path, the experts' and the workspace's tensors (addresses), the call tensors' dtypes and 16-byte alignment, and the
rest of what the launch sequence reads; every other argument is a constant of the plan. Recording checks that each
constant pointer lies inside the experts' or the workspace's tensors (a temporary there would dangle) and that no
argument aliases a call tensor except the call tensor itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

CALL_TENSORS = ("x", "topk_weights", "topk_ids", "expert_map", "out")  # what a plan takes per call, in this order


@dataclass(frozen=True)
class KernelLaunch:
    """One launch: ``kernel[grid](*args, **meta)``; ``loaded`` is called with the compiled kernel after its first
    launch (a load-time setting such as the L1 carveout; once per plan)."""
    kernel: Any
    grid: tuple
    args: tuple
    meta: dict = field(default_factory=dict)
    loaded: Optional[Callable] = None

    def run(self):
        """Launch through the JIT; returns the compiled kernel (None under the interpreter)."""
        compiled = self.kernel[self.grid](*self.args, **self.meta)
        if self.loaded is not None and compiled is not None:
            self.loaded(compiled)
        return compiled


def run_launches(launches: Sequence[KernelLaunch]) -> list:
    """Launch ``launches`` in order through the JIT; their compiled kernels."""
    return [launch.run() for launch in launches]


@dataclass(frozen=True)
class _Step:
    run: Callable  # the launcher: called as run(*grid, stream, *fixed, *args)
    fixed: tuple  # the launcher's arguments between the stream and the kernel's
    grid: tuple  # (x, y, z)
    args: tuple  # every parameter in order (constexprs too, as the JIT passes them); pointers as ints
    holes: tuple  # (argument index, index inside a bundle or -1, call-tensor index)


def _launcher(compiled) -> tuple:
    """``(run, fixed)`` of a compiled kernel: its C launch function itself where the kernel needs no scratch memory
    (Triton 3.6's ``CudaLauncher.__call__`` only allocates that, then calls it with these flags), else the wrapper
    as the JIT calls it."""
    wrapper = compiled.run
    launch = getattr(wrapper, "launch", None)
    if launch is not None and getattr(wrapper, "global_scratch_size", 1) == 0 \
            and getattr(wrapper, "profile_scratch_size", 1) == 0:
        return launch, (compiled.function, wrapper.launch_cooperative_grid, wrapper.launch_pdl, None, None,
                        compiled.packed_metadata, None, None, None)
    return wrapper, (compiled.function, compiled.packed_metadata, None, None, None)


class LaunchPlan:
    """A call's launches, compiled (see the module docstring). ``run(ptrs, stream)`` launches them with the call
    tensors' addresses ``ptrs`` (in ``CALL_TENSORS`` order; 0 for an absent expert_map) on ``stream``."""

    def __init__(self, steps: list):
        self.steps = steps

    @classmethod
    def record(cls, launches: Sequence[KernelLaunch], call: Sequence[Optional[torch.Tensor]],
               owned: Sequence[Optional[torch.Tensor]]) -> Optional["LaunchPlan"]:
        """Run ``launches`` through the JIT and keep them as a plan; ``call``: the call tensors, ``owned``: the tensors
        constant pointers may point into (the experts', the workspace's). None where a launch gave no compiled kernel
        (the interpreter)."""
        ranges = [_span(t) for t in owned if t is not None and t.numel()]
        steps, compiled_all = [], run_launches(launches)
        for launch, compiled in zip(launches, compiled_all):
            if compiled is None:
                return None
            params = launch.kernel.params
            values = list(launch.args) + [launch.meta.get(p.name, p.default) for p in params[len(launch.args):]]
            args, holes = [], []
            for i, value in enumerate(values):
                if isinstance(value, tuple):
                    inner = []
                    for j, item in enumerate(value):
                        inner.append(_constant(item, call, ranges, holes, i, j))
                    args.append(tuple(inner))
                else:
                    args.append(_constant(value, call, ranges, holes, i, -1))
            grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
            steps.append(_Step(*_launcher(compiled), grid, tuple(args), tuple(holes)))
        return cls(steps)

    def run(self, ptrs: Sequence[int], stream: int) -> None:
        for step in self.steps:
            args = step.args
            if step.holes:
                args = list(args)
                for i, j, h in step.holes:
                    if j < 0:
                        args[i] = ptrs[h]
                    else:
                        bundle = list(args[i])
                        bundle[j] = ptrs[h]
                        args[i] = tuple(bundle)
            gx, gy, gz = step.grid
            step.run(gx, gy, gz, stream, *step.fixed, *args)

    def __len__(self) -> int:
        return len(self.steps)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()


def _constant(value, call, ranges, holes: list, i: int, j: int):
    """``value`` as the plan keeps it: a call tensor becomes a hole, any other tensor its address (checked to lie in
    an owned tensor and to alias no call tensor)."""
    if not isinstance(value, torch.Tensor):
        return value
    for h, t in enumerate(call):
        if value is t:
            holes.append((i, j, h))
            return 0
    ptr = value.data_ptr()
    for t in call:
        if t is not None and t.numel() and _overlap(_span(t), (ptr, ptr + max(value.numel(), 1) * value.element_size())):
            raise AssertionError("a launch argument is a view of a call tensor: pass the call tensor itself")
    if not any(lo <= ptr < hi for lo, hi in ranges):
        raise AssertionError("a launch argument points outside the experts and the workspace: a plan cannot keep it")
    return ptr


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]
