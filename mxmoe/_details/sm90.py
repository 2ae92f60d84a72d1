"""Compile the GEMM kernels for sm_90a without a GPU and read back registers, spills and MMA ops.

Used by the CPU test that guards the kernels (wgmma/QGMMA present, no spills) and for
tuning by inspection. Pointer and integer arguments get the divisibility-by-16
specialization the JIT gives them at run time (all shapes here are multiples of 32), so
the pipeliner sees what it sees on the device.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..prepare import row_block_unit
from .gemm import moe_gemm_kernel
from .config import GemmConfig

_INT_ARGS_DIVISIBLE = ("stride_a", "stride_out", "N", "K")


@dataclass
class KernelReport:
    registers: int
    spill_bytes: int
    shared_bytes: int
    mma_ops: list
    async_copies: int
    ttgir: str
    wgmma_serialized: bool = False  # ptxas C7515: it serialized the asynchronous wgmma pipeline
    operand_overwrites: list = field(default_factory=list)  # SASS instructions writing an in-flight wgmma's register
    # operand (``operand_races``)
    k_loop_local: int = 0  # local-memory loads and stores (spills) in the K loop (``k_loop``)
    k_loop_length: int = 0  # its SASS instructions


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _ptxas() -> str:
    """The ptxas Triton itself uses for sm_90 (its bundled tools differ between releases)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def compile_gemm(gemm1: bool, fp8: bool, cfg: GemmConfig, *, bias: bool = True, swigluoai: bool = False,
                 direct: bool = False, out_i64: bool = False, pdl: bool = True, fold: bool = True, k: int = 4096,
                 n: int = 4096):
    """``triton.compile`` the GEMM template (``cfg.kernel``: plain Triton or Gluon) for sm_90a; ``direct``: the
    small-tile kernel without a route pack (``launch.direct_routes``), with an expert map; ``out_i64``: the Gluon
    kernels' 64-bit output offsets (outputs of 2**31 elements or more); ``pdl``: the small-tile kernel as launched
    with programmatic dependent launch (the launch's default on sm90); ``k`` / ``n``: the GEMM's K and N, where the
    kernel specializes on them (the W4A8 prefill kernel's K tail; GEMM2's last pair at N % 128 == 64)."""
    a_ty = "*fp8e4nv" if fp8 else "*bf16"
    out_ty = ("*fp32" if fp8 else "*bf16") if gemm1 else "*bf16"
    sig = dict(a_ptr=a_ty, a_scale_ptr="*fp32", stride_a="i32", w_ptr="*u8", s_ptr="*u8", ref_ptr="*i32",
               gscale_ptr="*fp32", bias_ptr="*fp32", sorted_routes_ptr="*i32", tile_expert_ptr="*i32",
               num_tiles_ptr="*i32", out_ptr=out_ty, stride_out="i32", topk_weights_ptr="*fp32",
               N="i32", K="i32", top_k="i32", limit="fp32", alpha="fp32")
    const = dict(GEMM1=gemm1, SWIGLUOAI=swigluoai, FP8=fp8, HAS_BIAS=bias, HAS_GSCALE=False, BM=cfg.block_m,
                 BT=cfg.block_rows, BK=cfg.block_k, NUM_STAGES=cfg.num_stages,
                 W_UNIT=row_block_unit(1024))  # the prepared unit of the reference shape's K (4096 and 1024)
    if cfg.kernel == "triton":
        kernel, source = moe_gemm_kernel, ASTSource
        const.update(PURE=False)
    elif cfg.kernel == "gluon_ws8":  # W4A8 prefill: K_TAIL from the shape's K (``k``), as the launch gives them
        from triton.experimental.gluon._runtime import GluonASTSource

        from .config import gluon_kernel, ws8_m_tiles
        kernel, source = gluon_kernel(cfg.kernel), GluonASTSource
        del const["FP8"], const["BM"]
        const.update(OUT_I64=out_i64, K_TAIL=k % cfg.block_k, PROMOTE=cfg.promote, W_UNIT=row_block_unit(k),
                     PRODUCER_REGS=cfg.loader_regs, CONSUMER_REGS=cfg.converter_regs, M_TILES=ws8_m_tiles(cfg),
                     PINGPONG=cfg.pingpong)
        sig.update(fold_ptr="*i32")
    else:
        from triton.experimental.gluon._runtime import GluonASTSource

        from .config import gluon_kernel, small_kernel_constexprs
        kernel, source = gluon_kernel(cfg.kernel, cfg.wide), GluonASTSource
        const.update(OUT_I64=out_i64)
        if cfg.wide:  # as launched on sm90 (programmatic dependent launch)
            const.update(small_kernel_constexprs(cfg, gemm1, pdl=pdl, n=n))
        elif cfg.kernel == "gluon_small":
            const.update(small_kernel_constexprs(cfg, gemm1, pdl=pdl, n=n))
            sig.update(ids_ptr="*i32", expert_map_ptr="*i32", num_global="i32", num_experts="i32",
                       sum_out_ptr="*bf16", stride_sum_out="i32", counters_ptr="*i32", parts_ptr="*fp32",
                       fold_ptr="*i32")
            const.update(FOLD=fp8 and fold)  # W4A8: the fast (folded) kernel, else the exact unfolded one
            # every constexpr given (Triton 3.8 takes no defaults here); direct: with an expert map and, GEMM2, the
            # top-k sum (``Overrides.direct_sum``) of 8 routes per token
            const.update(DIRECT=direct, HAS_MAP=direct, SUM_ROUTES=direct and not gemm1, TOP_K=8 if direct else 0)
    if cfg.kernel != "triton":  # the arguments in bundles (``config.ARG_BUNDLES``, as the launch passes them)
        from .config import ARG_BUNDLES, SMALL_ARG_BUNDLES

        bundles = dict(ARG_BUNDLES, **(SMALL_ARG_BUNDLES if "ids_ptr" in sig else
                                       {"fold_ptr": ("fold_ptr", )} if "fold_ptr" in sig else {}))
        flat = sig
        sig = {b: flat[names[0]] if b == "fold_ptr" else tuple(flat[n] for n in names) for b, names in bundles.items()}
        attrs = {((i, j) if b != "fold_ptr" else (i, )): [["tt.divisibility", 16]]
                 for i, (b, names) in enumerate(bundles.items())
                 for j, n in enumerate(names) if flat[n].startswith("*") or n in _INT_ARGS_DIVISIBLE}
    else:
        names = list(kernel.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
                 if t.startswith("*") or n in _INT_ARGS_DIVISIBLE}
    sig.update({c: "constexpr" for c in const})
    options = dict(num_warps=cfg.num_warps, enable_fp_fusion=True)  # (as the launches: KernelLaunch.run)
    if cfg.maxnreg:
        options["maxnreg"] = cfg.maxnreg
    return triton.compile(source(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def sass_and_log(kernel) -> tuple:
    """(``nvdisasm`` SASS, ``ptxas -v`` log) of a compiled kernel's PTX for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True,
                             check=True).stderr
        sass = subprocess.run([_tool("nvdisasm"), cubin], capture_output=True, text=True, check=True).stdout
    return sass, log


def report(kernel) -> KernelReport:
    """Registers and spills from ``ptxas -v``, MMA instructions from ``nvdisasm``."""
    sass, log = sass_and_log(kernel)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    mma = sorted(set(re.findall(r"\b[HQ]GMMA\.\S+|\bHMMA\.\S+", sass)))
    ttgir = kernel.asm["ttgir"]
    return KernelReport(regs, spills, kernel.metadata.shared, mma, ttgir.count("async_copy_global_to_local"), ttgir,
                        "wgmma.mma_async instructions are serialized" in log, operand_races(sass),
                        sum(1 for t in k_loop(sass) if re.match(r"(@!?U?P\w+\s+)?(LDL|STL)\b", t)), len(k_loop(sass)))


def k_loop(sass: str) -> list:
    """The SASS instructions of the innermost loop holding a wgmma (from a backward branch's target to the branch):
    the K loop."""
    instrs, labels = [], {}
    for m in re.finditer(r"^\s*(\.L_x_\d+):|/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M):
        if m.group(1):
            labels[m.group(1)] = len(instrs)
        else:
            instrs.append(m.group(3).strip())
    best: list = []
    for i, t in enumerate(instrs):
        target = re.search(r"BRA.*\((\.L_x_\d+)\)", t)
        if target and labels.get(target.group(1), i + 1) <= i:
            body = instrs[labels[target.group(1)]:i + 1]
            if any(re.search(r"\b[HQ]GMMA\.", b) for b in body) and (not best or len(body) < len(best)):
                best = body
    return best


# SASS ops that write no general register (or only uniform ones: every U* op)
_NO_REGISTER_DEST = {"ST", "STG", "STS", "STL", "RED", "BAR", "BRA", "EXIT", "LDGSTS", "ARRIVES", "SYNCS", "WARPGROUP",
                     "NOP", "MEMBAR", "FENCE", "CCTL", "ERRBAR", "DEPBAR", "RET", "CALL", "YIELD", "WARPSYNC", "BSSY",
                     "BSYNC", "NANOSLEEP", "BPT", "ELECT", "LDGDEPBAR", "PREEXIT"}


def _dest_width(op: str) -> int:
    """Registers an op's destination spans (LDSM.x2/.x4, 64/128-bit loads, wide multiplies, CS2R)."""
    if op.startswith("LDSM"):
        m = re.search(r"M88\.(\d)", op)
        return int(m.group(1)) if m else 1
    if op.startswith("CS2R") or ".WIDE" in op:
        return 2
    m = re.search(r"\.(64|128)\b", op)
    return {"64": 2, "128": 4}[m.group(1)] if m else 1


def operand_races(sass: str) -> list:
    """Instructions that write a register an issued wgmma still reads as its A operand (``[HQ]GMMA Rd, Ra, ...``:
    Ra .. Ra+3) before the ``WARPGROUP.DEPBAR`` that retires its group, in address order. ptxas does not keep a
    register operand alive until the wait: it reuses it once the HGMMA issued (docs/perf-notes.md step 19), so the
    kernels are correct only while the schedule writes other registers there; this checks the schedule. A group
    still in flight at a backward branch (a loop whose wait lets the last step's wgmmas run on) is followed into the
    loop's next iteration, from the branch target up to the branch (ptxas reuses those registers there too:
    ``scripts/mma_probe.py``'s CONV+PIPE form, docs/perf-notes.md step 29)."""
    instrs, labels = [], {}
    for m in re.finditer(r"^\s*(\.L_x_\d+):|/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M):
        if m.group(1):
            labels[m.group(1)] = len(instrs)
        else:
            instrs.append((m.group(2), m.group(3).strip()))
    found = []

    def scan(first, last, pending, current, follow):
        for idx in range(first, last):
            addr, raw = instrs[idx]
            text = re.sub(r"^@!?U?P\w+\s+", "", raw)
            op, _, args = text.partition(" ")
            if re.match(r"[HQ]GMMA\.", op):
                a = re.match(r"\s*R\d+,\s*R(\d+)\s*,", args)
                if a:
                    current |= set(range(int(a.group(1)), int(a.group(1)) + 4))
                if "gsb0" in args:  # the group's last wgmma
                    pending, current = pending + [current], set()
            elif op.startswith("WARPGROUP.DEPBAR"):  # at most n groups still in flight
                n = int(re.search(r"0x([0-9a-f]+)", args).group(1), 16)
                pending = pending[len(pending) - n:] if n else []
                if not follow and not pending and not current:
                    return
            elif op == "EXIT" and not raw.startswith("@"):  # (a predicated exit: the other threads go on)
                pending, current = [], set()
            elif op.split(".")[0] == "BRA" and follow and (pending or current):
                target = re.search(r"\((\.L_x_\d+)\)", args)
                if target and labels.get(target.group(1), idx + 1) <= idx:  # a loop's back edge: its next iteration
                    scan(labels[target.group(1)], idx, list(pending), set(current), False)
            elif not (op.startswith("U") or op.split(".")[0] in _NO_REGISTER_DEST):
                d = re.match(r"\s*R(\d+)\b", args)
                if d and set(range(int(d.group(1)), int(d.group(1)) + _dest_width(op))) & set().union(current, *pending):
                    entry = f"/*{addr}*/ {text}"
                    if entry not in found:
                        found.append(entry)

    scan(0, len(instrs), [], set(), True)
    return sorted(found, key=lambda entry: int(entry[2:entry.index("*/")], 16))


def default_cases(E: int = 288, H: int = 4096, I: int = 1024, rows=(8, 65536),
                  small_rows=(8, 16384, 32768, 65536), unfolded: bool = False) -> list:
    """``(name, gemm1, fp8, cfg, compile_kw)`` for the configs ``gemm_config`` picks on a shape (both GEMMs): the plain
    template at every ``rows`` (both precisions), the small-tile Gluon kernel at ``small_rows`` (both precisions; W4A16
    on the wide tiles at the last, there also GEMM2 on their 128-row halves, the wide GEMM2 at I = 256 and with 64-bit
    output offsets without PDL, both wide GEMMs at H = I = 2880, GEMM2 there also in pairs on 128-row tiles, the wide
    tiles with extra rows and the 128 + 32-slot wide tiles there and at this shape), and at its first rows also with
    16-bit scale loads (the form for K % 128 != 0), W4A16 with one K32 block per step, with the decode K split
    (two warpgroups) and, W4A16, without a route pack (one token, ``launch.direct_routes``), also GEMM1 with its K
    steps over two programs (``k_parts``).
    ``unfolded``: also W4A8's exact unfolded kernel at every small rows. ``name`` says the case, not the config, so
    that a restructure can be compared case by case."""
    from .config import gemm_config, unfolded_config

    cases = [(kernel, r, fp8, {}, False) for kernel, rs, fp8s in (("triton", rows, (False, True)),
                                                          ("gluon_small", small_rows, (False, True)))
             for r in rs for fp8 in fp8s]
    cases += [("gluon_small", small_rows[0], fp8, dict(scale_words=False, block_k=64), False) for fp8 in (False, True)]
    # W4A16 on one K32 block per step (an override): the per-block factors of a scale word, not the paired ones
    cases += [("gluon_small", small_rows[0], False, dict(block_k=32), False)]
    cases += [("gluon_small", small_rows[0], fp8, dict(k_split=2, maxnreg=128), False) for fp8 in (False, True)]
    cases += [("gluon_small", small_rows[0], False, {}, True)]
    cases += [("gluon_small", small_rows[0], False, dict(k_split=1, maxnreg=0, k_parts=2), True)]  # GEMM1 only
    # GEMM2 on the wide tiles' 128-row halves (the form where I % 128 != 0, here at this I), GEMM2 only
    cases += [("gluon_small", small_rows[-1], False, dict(block_rows=128, sub_tiles=2, gemm2_only=True), False)]
    # the wide GEMM2 on 4 K steps per tile (I = 256: the next tile's copies start at its second step), and with 64-bit
    # output offsets without programmatic dependent launch; GEMM2 only
    cases += [("gluon_small", small_rows[-1], False, dict(intermediate=256, gemm2_only=True), False)]
    cases += [("gluon_small", small_rows[-1], False, dict(out_i64=True, pdl=False, gemm2_only=True), False)]
    # both wide GEMMs at gpt-oss's K tail (H = I = 2880: 16-bit scale loads; GEMM2's last program repeats a half)
    cases += [("gluon_small", small_rows[-1], False, dict(hidden=2880, intermediate=2880), False)]
    # ... and GEMM2 in pairs on 128-row tiles there (the last pair's second block a repeat)
    cases += [("gluon_small", small_rows[-2], False, dict(hidden=2880, intermediate=2880, gemm2_only=True), False)]
    # the wide W4A16 tiles with 32 extra rows (a second MMA where a tile holds them), there and on this shape
    cases += [("gluon_small", small_rows[-1], False, dict(hidden=2880, intermediate=2880, extra_rows=32), False)]
    cases += [("gluon_small", small_rows[-1], False, dict(extra_rows=32), False)]
    # the 128 + 32-slot wide tiles (130 rows per expert), there and on this shape
    cases += [("gluon_small", 130 * E, False, dict(hidden=2880, intermediate=2880), False)]
    cases += [("gluon_small", 130 * E, False, {}, False)]
    if unfolded:
        cases += [("gluon_small", r, True, dict(fold=False), False) for r in small_rows[:-1]]
    # the W4A8 prefill kernel: 64- and 128-row route tiles, the tests' 1024-K chains, gpt-oss's K tail (H = I = 2880);
    # one m-tile per warpgroup (block_m=128) on 256- and 128-row tiles, the latter with 1024-K chains, both K forms
    cases += [("gluon_ws8", r, True, {}, False) for r in small_rows[-2:]]
    cases += [("gluon_ws8", small_rows[-1], True, dict(block_rows=64, promote=8), False)]
    cases += [("gluon_ws8", small_rows[-1], True, dict(hidden=2880, intermediate=2880), False)]
    cases += [("gluon_ws8", small_rows[-1], True, dict(block_m=128, block_rows=256, **shape), False)
              for shape in ({}, dict(hidden=2880, intermediate=2880))]
    cases += [("gluon_ws8", small_rows[-1], True, dict(block_m=128, block_rows=128, promote=8), False)]
    # MMAs issued in turns by the two consumer warpgroups, both m-tile forms, gpt-oss's K tail
    cases += [("gluon_ws8", small_rows[-1], True, dict(pingpong=True, **kw), False)
              for kw in ({}, dict(block_m=128, block_rows=256), dict(block_m=128, block_rows=256, hidden=2880,
                                                                     intermediate=2880))]
    out = []
    for kernel, r, fp8, override, direct in cases:
        override = dict(override)
        inter = override.pop("intermediate", I)
        hidden = override.pop("hidden", H)
        compile_kw = {key: override.pop(key) for key in ("out_i64", "pdl", "fold") if key in override}
        gemm2_only = override.pop("gemm2_only", False)
        for gemm1 in ((True, ) if "k_parts" in override else (False, ) if gemm2_only else (True, False)):
            n, k = (inter, hidden) if gemm1 else (hidden, inter)
            # the direct decode case as launched: GEMM1 with the K split of a one-token grid
            cfg = gemm_config(r, E, n, k, fp8, override, kernel=kernel, gemm1=gemm1, sm_count=132 if direct else 0)
            if compile_kw.get("fold") is False:  # as the launch gives it to the exact kernel
                cfg = unfolded_config(cfg, gemm1, k)
            knobs = ",".join(f"{key}={v}" for key, v in sorted({**override, **compile_kw}.items()))
            name = (f"{kernel}-{r}-{'g1' if gemm1 else 'g2'}-{'fp8' if fp8 else 'bf16'}" + ("-direct" if direct else "")
                    + (f"-I{inter}" if inter != I else "") + (f"-H{hidden}" if hidden != H else "")
                    + (f"-{knobs}" if knobs else ""))
            out.append((name, gemm1, fp8, cfg, dict(compile_kw, direct=direct, k=k, n=n)))
    return out


def default_reports(**shape) -> list:
    """Reports for :func:`default_cases`."""
    out = []
    for name, gemm1, fp8, cfg, compile_kw in default_cases(**shape):
        rep = report(compile_gemm(gemm1, fp8, cfg, **compile_kw))
        out.append(dict(case=name, kernel=cfg.kernel, fp8=fp8, gemm1=gemm1, direct=compile_kw["direct"], k=compile_kw["k"],
                        n=compile_kw["n"],
                        config=cfg.__dict__, registers=rep.registers,
                        spill_bytes=rep.spill_bytes, shared_bytes=rep.shared_bytes, mma_ops=rep.mma_ops,
                        async_copies=rep.async_copies, wgmma_serialized=rep.wgmma_serialized,
                        operand_overwrites=rep.operand_overwrites[:5], k_loop_local=rep.k_loop_local,
                        k_loop_length=rep.k_loop_length))
    return out


if __name__ == "__main__":  # python -m mxmoe._details.sm90: JSON reports (needs TRITON_INTERPRET unset)
    import json

    print(json.dumps(default_reports()))
