"""A manual region's facts beyond the model's own axes, in one object: `Region`.

A step kind decides them once (DiLoCo's replicas, a pipeline's vocabulary split over its ranks) and hands
the `Region` down; `shard_loss`, the pipeline executor's layout and the step paths read it, so no layer
below the step kind takes a flag for them. What it says:

- `copies`: mesh axes over which each group of ranks holds its own copy of the model (DiLoCo's `replica`).
  Every parameter and every result has one leading dim per such axis, split over it; the batch rows are
  split over it first; nothing is summed over it (`own` drops the leading dim inside the region, `tagged`
  puts it back, the `*_spec` methods say how each lies).
- `vocab_axes`: axes of the region that split the embedding and the head along the vocabulary besides
  `tensor` (a pipeline's vocabulary parallelism: `pipe`), so the head and embedding run on every rank of
  them, outside the per-rank pipeline switch.

`vary` is the one cast of a value to varying over manual axes (a parameter replicated over an axis whose
ranks compute different things must be varying before any differentiation, so its gradient is summed once,
at the region's boundary).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from parallax.compat import varying_axes
from parallax.sharding import spec_axes


def vary(x, axes):
    """`x` varying over the manual `axes` as well (a no-op over those it already varies over)."""
    have = varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


@dataclasses.dataclass(frozen=True)
class Region:
    """See the module docstring. `SINGLE` (the default) is one copy of the model, the vocabulary over `tensor`."""
    copies: tuple = ()
    vocab_axes: tuple = ()

    @property
    def copied(self) -> bool:
        return bool(self.copies)

    def param_spec(self, spec: P) -> P:
        """The spec of a parameter (or result) of one copy's spec `spec`, with its leading copy dims."""
        return P(*self.copies, *spec) if self.copies else spec

    def rows_spec(self, spec: P) -> P:
        """`spec` of a [B, ...] array with its rows split over the copy axes first."""
        if not self.copies:
            return spec
        rows = spec_axes(spec[0]) if len(spec) else ()
        return P((*self.copies, *rows), *spec[1:])

    def own(self, tree):
        """Inside the region: this copy's values (the leading copy dims, 1 per rank, dropped)."""
        for _ in self.copies:
            tree = jax.tree.map(lambda a: a[0], tree)
        return tree

    def tagged(self, tree):
        """Inside the region: results with their leading copy dims (1 per rank) back."""
        for _ in self.copies:
            tree = jax.tree.map(lambda a: a[None], tree)
        return tree

    def per_copy(self, fn):
        """`fn` over one copy's values -> over values with the leading copy dims (outside the region)."""
        for _ in self.copies:
            fn = jax.vmap(fn)
        return fn

    def reduced_over(self, axes) -> tuple:
        """`axes` without the copy axes: nothing is summed over them."""
        return tuple(a for a in axes if a not in self.copies)


SINGLE = Region()
