"""Safetensors checkpoints read on demand: only the tensors asked for, from whichever shard holds each.

A checkpoint is a ``.safetensors`` file, a directory (its ``*.safetensors.index.json``, else its ``.safetensors``
files), or an index file. The index (or each shard's header, where there is none) gives the shard of every tensor
name; a shard is opened (memory-mapped, its header parsed) the first time one of its tensors is asked for, and a
tensor is read when it is asked for. So loading one MoE layer of a 60 GB checkpoint reads that layer's bytes, not the
file, and a layer whose tensors sit in two shards loads like any other. ``safetensors`` is an optional dependency,
imported when a checkpoint is opened.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Mapping, Optional

import torch

INDEX_SUFFIX = ".safetensors.index.json"


def _safe_open(path: str):
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError("reading safetensors checkpoints needs the safetensors package: pip install safetensors") from e
    return safe_open(path, framework="pt")


class SafetensorsCheckpoint(Mapping):
    """The tensors of a safetensors checkpoint by name, read when asked for (a read-only ``Mapping``: ``ckpt[name]``,
    ``name in ckpt``, ``ckpt.get(name)``, ``len``, iteration over the names). Tensors come back on the CPU."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path!r}")
        self.path = path
        self._open: dict[str, object] = {}  # shard file -> its safe_open handle
        if os.path.isdir(path):
            indexes = sorted(glob.glob(os.path.join(path, "*" + INDEX_SUFFIX)))
            if len(indexes) > 1:
                raise ValueError(f"{path!r} holds several index files ({[os.path.basename(i) for i in indexes]}): "
                                 "open the one you mean")
            if indexes:
                self._shard_of = self._read_index(indexes[0])
            else:
                files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
                if not files:
                    raise FileNotFoundError(f"no .safetensors file in {path!r}")
                self._shard_of = self._read_headers(files)
        elif path.endswith(INDEX_SUFFIX) or path.endswith(".json"):
            self._shard_of = self._read_index(path)
        else:
            self._shard_of = self._read_headers([path])

    @staticmethod
    def _read_index(index: str) -> dict:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index!r} has no weight_map")
        base = os.path.dirname(index)
        return {name: os.path.join(base, shard) for name, shard in weight_map.items()}

    def _read_headers(self, files: list) -> dict:
        shard_of = {}
        for file in files:
            handle = self._open[file] = _safe_open(file)
            shard_of.update((name, file) for name in handle.keys())
        return shard_of

    def shard(self, name: str) -> Optional[str]:
        """The file holding tensor ``name`` (None: not in the checkpoint)."""
        return self._shard_of.get(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._shard_of.get(name)
        if file is None:
            raise KeyError(f"the checkpoint {self.path!r} has no tensor {name!r}")
        handle = self._open.get(file)
        if handle is None:
            if not os.path.exists(file):
                raise FileNotFoundError(f"{name!r} is in shard {file!r} by the index, which does not exist")
            handle = self._open[file] = _safe_open(file)
        return handle.get_tensor(name)

    def __contains__(self, name) -> bool:
        return name in self._shard_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._shard_of)

    def __len__(self) -> int:
        return len(self._shard_of)

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({self.path!r}, {len(self)} tensors in {len(set(self._shard_of.values()))} files)"


def open_checkpoint(source) -> Mapping:
    """``source`` as a mapping of tensor names: a mapping (a state dict, a :class:`SafetensorsCheckpoint`) as it is,
    a path as a :class:`SafetensorsCheckpoint`."""
    if isinstance(source, (str, os.PathLike)):
        return SafetensorsCheckpoint(source)
    if isinstance(source, Mapping):
        return source
    raise TypeError(f"a checkpoint is a path or a mapping of tensors (a state dict), got {type(source).__name__}")
