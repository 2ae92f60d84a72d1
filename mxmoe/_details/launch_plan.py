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
from types import BuiltinFunctionType
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
    args: Callable  # pointer table -> every parameter in order (constexprs too, as the JIT passes them), or that
    # tuple as the one element of a tuple where the launcher takes the kernel's arguments as one tuple


# Triton releases whose C launch function a plan calls itself, and how ``CudaLauncher.__call__`` calls it there after
# allocating scratch memory (none for our kernels):
# - ``"3.6"``: ``launch(*grid, stream, function, coop, pdl, global_scratch, profile_scratch, metadata,
#   launch_metadata, enter_hook, exit_hook, *args)``;
# - ``"3.9"``: ``launch(*grid, stream, function, coop, pdl, metadata, launch_metadata, enter_hook, exit_hook,
#   global_scratch, profile_scratch, arg_annotations, kernel_signature, args)``, the arguments as one tuple.
# Other releases take the wrapper, as the JIT does. A form that does not match raises at the first replay (a TypeError
# from 3.9 called in 3.6's form, measured on an H100); tests/test_launch_plan.py checks both against the installed
# Triton's source.
DIRECT_LAUNCH_FORMS = {"3.6": "spread", "3.9": "tuple"}


def _launcher(compiled) -> tuple:
    """``(run, fixed, tupled)`` of a compiled kernel: its C launch function itself where the kernel needs no scratch
    memory on a release of :data:`DIRECT_LAUNCH_FORMS`, else the wrapper as the JIT calls it (the same form in every
    release since 3.6); ``tupled``: the kernel's arguments go as one tuple."""
    wrapper = compiled.run
    launch = getattr(wrapper, "launch", None)
    form = DIRECT_LAUNCH_FORMS.get(triton_release(triton.__version__))
    no_scratch = getattr(wrapper, "global_scratch_size", 1) == 0 and getattr(wrapper, "profile_scratch_size", 1) == 0
    if launch is not None and no_scratch and form == "spread":
        return launch, (compiled.function, wrapper.launch_cooperative_grid, wrapper.launch_pdl, None, None,
                        compiled.packed_metadata, None, None, None), False
    # (3.9: the C function itself only, not a Python wrapper for tensor descriptors, and no sanitizer state to add)
    if isinstance(launch, BuiltinFunctionType) and no_scratch and form == "tuple" \
            and not getattr(wrapper, "gsan_enabled", True):
        return launch, (compiled.function, wrapper.launch_cooperative_grid, wrapper.launch_pdl,
                        compiled.packed_metadata, None, None, None, None, None, wrapper.arg_annotations,
                        wrapper.kernel_signature), True
    return wrapper, (compiled.function, compiled.packed_metadata, None, None, None), False


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
            run, fixed, tupled = _launcher(compiled)
            source = "(" + "".join(_expression(v, table, spans, constants) + ", " for v in values) + ")"
            source = "lambda p, c=c: " + (f"({source},)" if tupled else source)
            # (our own expression of indices into p and c; c bound as a default: a partial's keyword costs a dict)
            build = eval(source, {"c": tuple(constants)})  # noqa: S307
            grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
            steps.append(_Step(run, fixed, grid, build))
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
