"""Tuned tile configs: per GPU, layer shape, path and token bucket, config fields that change speed and never bits.

A table is JSON (``mxmoe tune`` writes one; the package ships ``mxmoe/configs/*.json``)::

    {"format": 2, "device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "measured": "...",
     "entries": [{"shape": [E, H, I, top_k], "precision": "w4a16", "tokens": 64,
                  "gemm1": {"num_stages": 5}, "gemm2": {},
                  "default": {"gemm1": {"kernel": "gluon_small", "block_rows": 16, "sub_tiles": 1, "k_split": 1,
                                        "k_parts": 1}, "gemm2": {...}},
                  "ms": 0.061, "default_ms": 0.066}, ...]}

An entry holds for calls of its device (``torch.cuda.get_device_name``), shape and path whose token count falls in its
bucket: the smallest of :data:`TOKEN_BUCKETS` at or above ``T`` (past the last, the last). It was measured at one T
(the bucket's top), on the configs the heuristics picked there (``default``: kernel family, route tiles and K split
per GEMM); a call of the same bucket whose heuristics pick another kind of config does not take it (the fields were not
measured there and may not fit). Its ``gemm1`` / ``gemm2`` fields go on top of what ``config.gemm_config`` picks,
under any ``config.overrides`` (those win). Only :data:`SPEED_FIELDS` may appear: fields that change how a GEMM is
scheduled, never its arithmetic (the K split, the FP8 chain length and the kernel family stay the library's choice),
and the tuner keeps a candidate only when the call's output is bitwise the default's. Tables are read once, at the
first lookup: the shipped ones, then the file named by ``MXMOE_TUNED_CONFIGS`` (its entries win).
"""
from __future__ import annotations

import bisect
import functools
import json
import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from . import env_get
from .config import DIRECT_MAX_TOKENS  # (W4A16 calls up to here run without a route pack)

FORMAT = 2  # (1: entries without ``default``, read by no release)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SPEED_FIELDS = frozenset({"block_rows", "num_stages", "split_loop", "pair", "maxnreg", "loader_regs",
                          "converter_regs"})
PRECISIONS = ("w4a16", "w4a8")
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
ENV = "MXMOE_TUNED_CONFIGS"


@dataclass(frozen=True)
class Entry:
    """One bucket's fields per GEMM, and the kind of untuned config per GEMM they were measured on."""
    gemm1: dict
    gemm2: dict
    default: tuple  # (kind of GEMM1's untuned config, kind of GEMM2's): see :func:`kind`

    def fits(self, untuned1, untuned2) -> bool:
        """Whether a call whose heuristics pick ``untuned1`` / ``untuned2`` (GemmConfigs) may take this entry."""
        return (kind(untuned1), kind(untuned2)) == self.default


KIND_FIELDS = ("kernel", "block_rows", "sub_tiles", "k_split", "k_parts")


def kind(cfg) -> tuple:
    """What of a GEMM's config an entry's fields depend on: the kernel family, the route tiles and the K split (which
    of the heuristics' forms of the kernel runs)."""
    return tuple(getattr(cfg, f) for f in KIND_FIELDS)


def bucket(tokens: int) -> int:
    """The token bucket of a call of ``tokens`` tokens: the smallest bucket >= it, past the last the last."""
    i = bisect.bisect_left(TOKEN_BUCKETS, tokens)
    return TOKEN_BUCKETS[min(i, len(TOKEN_BUCKETS) - 1)]


def _fields(entry: Mapping, gemm: str, where: str) -> dict:
    fields = dict(entry.get(gemm) or {})
    unknown = sorted(set(fields) - SPEED_FIELDS)
    if unknown:
        raise ValueError(f"{where}: {gemm} sets {', '.join(unknown)}; a tuned table may set only "
                         f"{', '.join(sorted(SPEED_FIELDS))} (fields that change speed, not results)")
    return fields


def check_table(table: Mapping, where: str = "table") -> dict:
    """``{(device, (E, H, I, top_k), precision, bucket): Entry}`` of a table; ``ValueError`` naming what is wrong
    (format, a field outside :data:`SPEED_FIELDS`, a token count that is not a bucket, no ``default``)."""
    if table.get("format") != FORMAT:
        raise ValueError(f"{where}: format {table.get('format')!r}, expected {FORMAT}: an older release's table; delete "
                         "it (or name another) and tune again")
    device = table.get("device")
    if not isinstance(device, str) or not device:
        raise ValueError(f"{where}: no device name")
    out = {}
    for i, entry in enumerate(table.get("entries", [])):
        at = f"{where} entry {i}"
        shape = tuple(int(v) for v in entry["shape"])
        if len(shape) != 4:
            raise ValueError(f"{at}: shape must be [E, H, I, top_k]")
        if entry["precision"] not in PRECISIONS:
            raise ValueError(f"{at}: precision must be one of {PRECISIONS}")
        if entry["tokens"] not in TOKEN_BUCKETS:
            raise ValueError(f"{at}: tokens {entry['tokens']} is not a bucket ({TOKEN_BUCKETS})")
        g1, g2 = _fields(entry, "gemm1", at), _fields(entry, "gemm2", at)
        if g1.get("block_rows") != g2.get("block_rows"):
            raise ValueError(f"{at}: block_rows must be the same for both GEMMs (they read one route pack)")
        if "block_rows" in g1 and entry["precision"] == "w4a16" and entry["tokens"] <= DIRECT_MAX_TOKENS:
            raise ValueError(f"{at}: block_rows at {entry['tokens']} tokens: W4A16 runs these without a route pack")
        try:
            default = tuple(tuple(entry["default"][g][f] for f in KIND_FIELDS) for g in ("gemm1", "gemm2"))
        except (KeyError, TypeError):
            raise ValueError(f"{at}: default must give each GEMM's untuned {', '.join(KIND_FIELDS)}") from None
        out[(device, shape, entry["precision"], entry["tokens"])] = Entry(g1, g2, default)
    return out


def _table_files() -> list:
    shipped = sorted(os.path.join(SHIPPED_DIR, f) for f in os.listdir(SHIPPED_DIR) if f.endswith(".json")) \
        if os.path.isdir(SHIPPED_DIR) else []
    extra = env_get(ENV, "").strip()
    return shipped + ([extra] if extra else [])


def load_tables(paths: Iterable[str]) -> dict:
    """The entries of the tables at ``paths`` (later files win); ``ValueError`` naming a file that cannot be read."""
    entries = {}
    for path in paths:
        try:
            with open(path) as f:
                table = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"tuned table {path} (shipped, or {ENV}) cannot be read: {exc}") from None
        entries.update(check_table(table, where=path))
    return entries


@functools.cache
def _entries() -> dict:
    return load_tables(_table_files())


def reload() -> None:
    """Read the tables again at the next lookup (after ``MXMOE_TUNED_CONFIGS`` changed). Launch plans recorded before
    keep the configs they were recorded with: set the variable before the first call."""
    _entries.cache_clear()
    device_name.cache_clear()


@functools.cache
def device_name(device) -> str:
    """The name that keys a GPU's tables."""
    import torch

    return torch.cuda.get_device_name(device)


def lookup(device, shape: tuple, precision: str, tokens: int, entries: Optional[Mapping] = None) -> Optional[Entry]:
    """The :class:`Entry` of a call's bucket (None where no table has one); ``device`` a CUDA device (its name keys
    the tables) or a device name."""
    entries = _entries() if entries is None else entries
    if not entries:
        return None
    name = device if isinstance(device, str) else device_name(device)
    return entries.get((name, tuple(shape), precision, bucket(tokens)))
