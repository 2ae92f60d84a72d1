"""Launch plans: the kernels of one call described as data, run through Triton's JIT on the first call of a kind,
then launched directly from the compiled kernels.

A :class:`KernelLaunch` is one kernel launch as the JIT takes it (kernel, grid, positional arguments, keyword
options). The launch sequence of a call (``launch.describe``) is a list of them; nothing in it depends on a value the
GPU computes, so the list is known on the host before anything runs.

A :class:`LaunchPlan` is that list compiled: per launch, the compiled kernel's launcher, its grid, and a function
that builds its argument list from the call's *pointer table*: the addresses of the call tensors, the experts'
tensors and the workspace's buffers (``launch.run_layer`` gives them in that order). Every tensor argument is one of
those plus a byte offset fixed by the plan (a view of a workspace buffer, say); every other argument is a constant.
So one plan serves every layer's experts and every workspace of the same kind, and running it is one C launcher
call per kernel: no argument binding, no specialization, no cache lookup, no ``data_ptr`` or
``cuPointerGetAttribute`` per pointer.

Recording runs the sequence through the JIT (that call's work) and keeps the kernels the JIT chose. A plan is valid
for every later call whose arguments the JIT would specialize the same way: ``launch.plan_key`` holds T, the path,
the dtypes and 16-byte alignment of every pointer, the experts' shapes and the rest of what the launch sequence
reads. Recording checks that every tensor argument lies inside one of the table's tensors (a temporary would
dangle).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import triton

from .config import triton_release


@dataclass(frozen=True)
class KernelLaunch:
    """One launch: ``kernel[grid](*args, **meta)``; ``loaded`` is called with the compiled kernel after each launch
    through the JIT (a load-time setting such as the L1 carveout, which acts once per loaded kernel)."""
    kernel: Any
    grid: tuple
    args: tuple
    meta: dict = field(default_factory=dict)
    loaded: Optional[Callable] = None

    def run(self):
        """Launch through the JIT; returns the compiled kernel (None under the interpreter). FP fusion (FMA contraction)
        is asked for explicitly: it is what every kernel was validated with, Triton 3.9 warns once when it is left to
        the default, and Triton 3.10 turns the default off."""
        compiled = self.kernel[self.grid](*self.args, enable_fp_fusion=True, **self.meta)
        if self.loaded is not None and compiled is not None:
            self.loaded(compiled)
        return compiled


def run_launches(launches: Sequence[KernelLaunch]) -> list:
    """Launch ``launches`` in order through the JIT; their compiled kernels."""
    return [launch.run() for launch in launches]


@dataclass(frozen=True)
class _Step:
    run: Callable  # the launcher: called as run(*grid, stream, *fixed, *args(pointers))
    fixed: tuple  # the launcher's arguments between the stream and the kernel's
    grid: tuple  # (x, y, z)
    args: Callable  # pointer table -> every parameter in order (constexprs too, as the JIT passes them)


# Triton releases whose C launch function a plan calls itself (``CudaLauncher.__call__`` calls it as
# ``launch(*grid, stream, function, coop, pdl, global_scratch, profile_scratch, metadata, launch_metadata, hooks x 2,
# *args)`` after allocating scratch memory); other releases take the wrapper. Triton 3.9 changed the C function (the
# kernel's arguments in one tuple after its signature): calling it in 3.6's form raised, measured on an H100.
DIRECT_LAUNCH_RELEASES = ("3.6",)


def _launcher(compiled) -> tuple:
    """``(run, fixed)`` of a compiled kernel: its C launch function itself where the kernel needs no scratch memory on
    a release of :data:`DIRECT_LAUNCH_RELEASES`, else the wrapper as the JIT calls it (the same form in every release
    since 3.6)."""
    wrapper = compiled.run
    launch = getattr(wrapper, "launch", None)
    release = triton_release(triton.__version__)
    if launch is not None and release in DIRECT_LAUNCH_RELEASES and getattr(wrapper, "global_scratch_size", 1) == 0 \
            and getattr(wrapper, "profile_scratch_size", 1) == 0:
        return launch, (compiled.function, wrapper.launch_cooperative_grid, wrapper.launch_pdl, None, None,
                        compiled.packed_metadata, None, None, None)
    return wrapper, (compiled.function, compiled.packed_metadata, None, None, None)


class LaunchPlan:
    """A call's launches, compiled (see the module docstring). ``run(pointers, stream)`` launches them with the call's
    pointer table on ``stream``."""

    def __init__(self, steps: list):
        self.steps = steps

    @classmethod
    def record(cls, launches: Sequence[KernelLaunch], table: Sequence[Optional[torch.Tensor]],
               views_from: int) -> Optional["LaunchPlan"]:
        """Run ``launches`` through the JIT and keep them as a plan whose tensor arguments are entries of ``table``
        (the tensors behind the pointer table, None where absent): themselves or, from entry ``views_from`` on (the
        workspace's), views at a fixed offset. None where a launch gave no compiled kernel (the interpreter)."""
        spans = [None if t is None or i < views_from else _span(t) for i, t in enumerate(table)]
        steps = []
        for launch, compiled in zip(launches, run_launches(launches)):
            if compiled is None:
                return None
            params = launch.kernel.params
            values = list(launch.args) + [launch.meta.get(p.name, p.default) for p in params[len(launch.args):]]
            constants: list = []
            source = "lambda p, c=c: (" + "".join(_expression(v, table, spans, constants) + ", " for v in values) + ")"
            # (our own expression of indices into p and c; c bound as a default: a partial's keyword costs a dict)
            build = eval(source, {"c": tuple(constants)})  # noqa: S307
            grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
            steps.append(_Step(*_launcher(compiled), grid, build))
        return cls(steps)

    def run(self, pointers: Sequence[int], stream: int) -> None:
        for step in self.steps:
            gx, gy, gz = step.grid
            step.run(gx, gy, gz, stream, *step.fixed, *step.args(pointers))

    def __len__(self) -> int:
        return len(self.steps)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()


def _expression(value, table, spans, constants: list) -> str:
    """``value`` in the argument builder's source: a tensor as ``p[i]`` (``table[i]`` itself) or ``p[i] + offset`` (a
    view of a workspace buffer), a bundle as a tuple, anything else as a constant ``c[k]``."""
    if isinstance(value, tuple):
        return "(" + "".join(_expression(v, table, spans, constants) + ", " for v in value) + ")"
    if not isinstance(value, torch.Tensor):
        constants.append(value)
        return f"c[{len(constants) - 1}]"
    for i, t in enumerate(table):
        if value is t:
            return f"p[{i}]"
    ptr = value.data_ptr()
    for i, span in enumerate(spans):
        if span is not None and span[0] <= ptr < span[1]:
            return f"(p[{i}] + {ptr - span[0]})" if ptr != span[0] else f"p[{i}]"
    raise AssertionError("a launch argument is neither a call tensor, an expert tensor nor in a workspace buffer: a "
                         "plan cannot keep it")
