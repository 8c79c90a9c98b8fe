"""What a model declares to map its parameters to a Hugging Face checkpoint (`Source`, one per parameter)
and the helpers its `hf_model_keys` uses (`required`, `unsupported`). The mechanism that reads the mapping
in both directions (sharded loading, export) is `parallax/hf.py`; this module sits below the models so that
a model file needs nothing above the model contract.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from parallax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one parameter (one layer of it, for a stacked one) lives in the HF checkpoint.

    ours = transpose(reshape(hf[name][block], view), perm), where `block = (axis, start, stop)` cuts a part
    of a fused HF tensor (e.g. a fused q|k|v projection) and `view` splits HF axes only (e.g. [H*Dh, D] -> (H, Dh, D)).
    With `parts` = n > 0 our (per-layer) parameter is n such tensors stacked on a leading axis: '{j}' in the
    name stands for the index along it (e.g. a layer's experts stored one HF tensor each).
    """
    name: str  # HF tensor name; '{i}' stands for the layer index of a stacked parameter, '{j}' for the part
    hf_shape: tuple  # the whole HF tensor (one part's)
    view: tuple
    perm: tuple = None  # view axes in our order (default: as they are)
    block: tuple = None  # (axis, start, stop) of the HF tensor that is ours
    parts: int = 0  # > 0: our leading axis stacks this many HF tensors, named with '{j}' = 0 .. parts-1

    @property
    def stacked(self) -> bool:
        return "{i}" in self.name

    def tensor_names(self, layer: int) -> list[str]:
        """The HF tensors of one layer of this parameter (one per part)."""
        if self.parts:
            return [self.name.format(i=layer, j=j) for j in range(self.parts)]
        return [self.name.format(i=layer)]

    def block_shape(self) -> tuple:
        shape = list(self.hf_shape)
        if self.block:
            axis, start, stop = self.block
            shape[axis] = stop - start
        return tuple(shape)

    def groups(self) -> list[list[int]]:
        """For each HF axis (after the block cut), the view axes it splits into."""
        groups, v = [], 0
        for size in self.block_shape():
            group, prod = [], 1
            while prod < size or not group:
                group.append(v)
                prod *= self.view[v]
                v += 1
            if prod != size:
                raise ValueError(f"{self.name}: view {self.view} does not split {self.block_shape()}")
            groups.append(group)
        return groups

    def our_shape(self) -> tuple:
        perm = self.perm or tuple(range(len(self.view)))
        return (self.parts,) * bool(self.parts) + tuple(self.view[p] for p in perm)

    def read(self, handle, layer: int, our_index: tuple) -> np.ndarray:
        """Our slice `our_index` (one slice per our per-layer axis) of layer `layer`, as float32.

        Reads from the file the rows of each HF axis that the slice of its leading view axis covers; a slice
        of an inner view axis (e.g. head_dim, which the rules never shard) is cut after the read. With
        `parts`, only the parts the slice of our leading axis covers are read."""
        if self.parts:
            names = self.tensor_names(layer)[our_index[0]]
            return np.stack([self._read(handle, name, our_index[1:]) for name in names])
        return self._read(handle, self.name.format(i=layer), our_index)

    def _read(self, handle, name: str, our_index: tuple) -> np.ndarray:
        perm = self.perm or tuple(range(len(self.view)))
        view_index = [slice(None)] * len(self.view)
        for ours, v in enumerate(perm):
            view_index[v] = our_index[ours]
        hf_index, inner = [], []
        for axis, group in enumerate(self.groups()):
            first = view_index[group[0]]
            start, stop, _ = first.indices(self.view[group[0]])
            rest = math.prod(self.view[v] for v in group[1:])
            offset = self.block[1] if self.block and self.block[0] == axis else 0
            hf_index.append(slice(offset + start * rest, offset + stop * rest))
            inner += [slice(None)] + [view_index[v] for v in group[1:]]
        data = np.asarray(handle(name)[tuple(hf_index)])
        shape = []  # the read rows, split as the view splits each HF axis
        for axis, group in enumerate(self.groups()):
            rest = [self.view[v] for v in group[1:]]
            shape += [(hf_index[axis].stop - hf_index[axis].start) // math.prod(rest)] + rest
        data = data.reshape(shape)[tuple(inner)]
        return np.transpose(data, perm).astype(np.float32)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        """One layer (and part, with `parts`) of our parameter -> its block of the HF tensor (the inverse of
        `read`)."""
        perm = self.perm or tuple(range(len(self.view)))
        return np.transpose(ours, np.argsort(perm)).reshape(self.block_shape())


@dataclasses.dataclass(frozen=True)
class Constant:
    """A stacked parameter that no HF checkpoint holds: one number per layer that the HF config.json sets
    (e.g. which layers attend through a sliding window, from its `layer_types`), so import fills it from
    `values` and export writes no tensor for it (`hf_config` writes the config key it came from)."""
    values: tuple  # one per layer
    name: str = ""  # no tensor
    hf_shape: tuple = ()
    stacked = True

    def tensor_names(self, layer: int) -> list[str]:
        return []

    def our_shape(self) -> tuple:
        return ()

    def read(self, handle, layer: int, our_index: tuple) -> np.ndarray:
        return np.float32(self.values[layer])


# --- helpers for the models' `hf_model_keys` -------------------------------------------------------------

def required(hf: dict, key: str, where: str):
    """hf[key], or a ConfigError saying the config.json lacks it."""
    if key not in hf:
        raise ConfigError(f"{where}: config.json has no {key!r}; it is not a complete HF config")
    return hf[key]


def unsupported(where: str, key: str, value, fix: str):
    """Raises the ConfigError for an HF option the model does not implement."""
    raise ConfigError(f"{where}: {key}={value!r} is not supported by parallax's model; {fix}")
