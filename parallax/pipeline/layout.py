"""Where the executor's arguments live: the stage-weight layout, the shard_map's specs and manual axes, and
the values' varying-axis types inside it.

`to_pipeline_layout` / `from_pipeline_layout` move stacked layer weights `[L, ...]` to the executor's
`[p, v, Lc, ...]` layout and back (`Lc = L / (p * v)`, or an uneven layout's largest stage, padded). `Layout.make` checks the executor's arguments against the
schedule and the mesh and derives the in/out specs; `Layout.gather` brings a routed input whole to the
one rank that reads it; `Layout.call` runs a body in the shard_map. `zeros` (and `region.vary`) give values
the varying-axis types (`compat.varying_axes`) the executor's carry and branches need.

Axis names: `pipe` (ranks), and the batch axes (`data`, `fsdp` by default) over which microbatch rows
are split. A region with copies (`parallax.parallel.region.Region`: DiLoCo's `replica`) adds its axis:
every weight has a leading [R] dim split over it, the rows are split over it first, and every result gains
a leading [R] dim; the executor then runs R independent pipelines and sums nothing over it.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from parallax.compat import varying_axes
from parallax.parallel.region import SINGLE, Region, vary
from parallax.pipeline.schedule import Schedule


def _take_rows(a, idx, fill=False):
    """`a[idx]` along dim 0 (with `fill`, zeros where idx is out of range). For explicitly sharded arrays
    dim 0 of the result is unsharded and the other dims keep their sharding (a gather needs its output
    sharding spelled out)."""
    kw = dict(mode="fill", fill_value=0) if fill else {}
    sharding = getattr(jax.typeof(a), "sharding", None)
    if sharding is None or AxisType.Explicit not in sharding.mesh.axis_types:
        return jnp.asarray(a).at[idx].get(**kw) if fill else a[idx]
    spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
    return a.at[idx].get(out_sharding=NamedSharding(sharding.mesh, P(None, *spec[1:])), **kw)


def _identity(order) -> bool:
    return bool((np.asarray(order) == np.arange(len(order))).all())


def _uneven(schedule: Schedule) -> bool:
    return schedule.layers is not None and len(set(schedule.layers)) > 1


def layer_rows(schedule: Schedule, num_layers: int) -> np.ndarray:
    """int `[p, v, Lc]`: the model layer each of a chunk's layer slots holds (`Lc` the largest stage), or
    `num_layers` for a padding slot (an uneven layout's shorter stages: the executor skips it)."""
    counts = schedule.stage_layers(num_layers)
    starts = np.cumsum((0, *counts[:-1]))
    rows = np.full((len(counts), max(counts)), num_layers)
    for s, n in enumerate(counts):
        rows[s, :n] = starts[s] + np.arange(n)
    return rows[schedule.stage_of]


def active_layers(schedule: Schedule):
    """bool `[p, v, Lc]`: which of each chunk's layer slots hold a layer, or None for an even layout."""
    if not _uneven(schedule):
        return None
    return layer_rows(schedule, sum(schedule.layers)) < sum(schedule.layers)


def to_pipeline_layout(stacked, schedule: Schedule):
    """Stacked layer weights (leaves `[L, ...]`) -> executor layout `[p, v, Lc, ...]`.

    Stage s holds the next `schedule.stage_layers(L)[s]` layers (`Lc = L / (p * v)` each by default);
    `staged[r, c]` is stage `schedule.stage_of[r, c]`. When the stages are even and rank r's chunk c is
    stage r * v + c (gpipe, 1f1b, zb_h1) this is a reshape: the layers dim sharded over `pipe` stays where it
    lives, and no collective moves layer weights. Otherwise (interleaved, zbv, an uneven layout) the layers
    are gathered into place, which the partitioner implements by moving the stack. An uneven layout pads
    each chunk to the largest stage's `Lc` with zeros (`layer_rows`), slots the executor skips.
    """
    p, v = schedule.stage_of.shape
    order = schedule.stage_of.ravel()

    def one(a):
        if _uneven(schedule):
            rows = layer_rows(schedule, a.shape[0])
            return _take_rows(a, rows.ravel(), fill=True).reshape(p, v, rows.shape[2], *a.shape[1:])
        schedule.stage_layers(a.shape[0])  # raises ScheduleError (a ValueError) if they do not split evenly
        stages = a.reshape(p * v, a.shape[0] // (p * v), *a.shape[1:])  # [S, Lc, ...]
        if not _identity(order):
            stages = _take_rows(stages, order)
        return stages.reshape(p, v, *stages.shape[1:])

    return jax.tree.map(one, stacked)


def from_pipeline_layout(staged, schedule: Schedule):
    """The inverse of `to_pipeline_layout`: `[p, v, Lc, ...]` -> `[L, ...]` (padding slots dropped)."""
    if _uneven(schedule):
        num_layers = sum(schedule.layers)
        rows = layer_rows(schedule, num_layers).ravel()
        where = np.argsort(rows, kind="stable")[:num_layers]  # flat slot of each layer, in layer order
        return jax.tree.map(lambda a: _take_rows(a.reshape(-1, *a.shape[3:]), where), staged)
    order = np.argsort(schedule.stage_of.ravel())  # flat (r * v + c) of each stage, in stage order

    def one(a):
        stages = a.reshape(-1, *a.shape[2:])  # [S, Lc, ...] in rank order
        if not _identity(order):
            stages = _take_rows(stages, order)
        return stages.reshape(-1, *a.shape[3:])

    return jax.tree.map(one, staged)


def place(tree, mesh, specs):
    """Puts `tree` in sharding `specs` (one spec, or a tree of them) if the mesh has explicit axes
    (shard_map then requires it)."""
    if all(t != AxisType.Explicit for t in mesh.axis_types):
        return tree
    if isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, tree)
    return jax.tree.map(lambda a, s: jax.reshard(a, NamedSharding(mesh, s)), tree, specs)


def zeros(a, dtype=None, axes=None):
    """Zeros like `a`, varying over `axes` (default: as `a` is), in `a`'s memory (a host residual of
    `model.remat=offload` stays in host memory: a switch's branches and a scan's carry must agree)."""
    axes = tuple(varying_axes(a)) if axes is None else axes
    return to_memory_of(a, vary(jnp.zeros(a.shape, dtype or a.dtype), axes))


def to_memory_of(a, x):
    """`x` moved to host memory if `a` (an array or an aval) lives there (`jax.memory.Space.Host`)."""
    host = getattr(jax.typeof(a), "memory_space", None) == jax.memory.Space.Host
    return jax.device_put(x, jax.memory.Space.Host) if host else x


def axes_of(spec) -> set:
    """Mesh axes a PartitionSpec names."""
    return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def manual_axes(mesh, batch_axes, param_specs, input_spec, region: Region = SINGLE) -> tuple:
    """The mesh axes the executor's shard_map is manual over: `pipe`, the batch axes of size > 1, and the
    other axes of size > 1 that the specs name. A steady step's in-flight leaves are split over them."""
    batch = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1)
    named = set().union(axes_of(input_spec), *map(axes_of, jax.tree.leaves(param_specs))) - {"pipe", *region.copies}
    return ("pipe",) + batch + tuple(a for a in mesh.axis_names if a in named and a not in batch and mesh.shape[a] > 1)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the executor's arguments lie on the mesh: the shard_map's specs and its manual axes."""
    mesh: object
    specs: dict  # full in/out spec per params leaf, {'first', 'stages', 'last'}
    batch_spec: P
    manual: tuple
    batch: tuple  # the batch axes of size > 1 (manual)
    routed: tuple = ()  # (input key, the pipe rank that reads it): split over `pipe` along dim 2, see `gather`
    region: Region = SINGLE  # copies (DiLoCo): weights and results [R, ...] over `replica`, rows split over it first
    active: object = None  # an uneven layout's bool [p, v, Lc] of real layer slots (`active_layers`), or None

    @classmethod
    def make(cls, schedule, params, inputs, mesh, batch_axes, param_specs, input_spec,
             microbatches=None, routed_inputs=None, region: Region = SINGLE) -> "Layout":
        """Checks the arguments' shapes against the schedule and the mesh, and derives the specs."""
        p, v, m = schedule.num_ranks, schedule.num_chunks, microbatches or schedule.num_microbatches
        if mesh.shape.get("pipe") != p:
            raise ValueError(f"schedule {schedule.name} has {p} ranks but the mesh has pipe="
                             f"{mesh.shape.get('pipe')}; set mesh pipe={p}")
        batch = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1)
        rows = region.copies + batch
        dp = int(np.prod([mesh.shape[a] for a in rows]))
        for path, a in jax.tree_util.tree_leaves_with_path(inputs):
            if a.ndim < 2 or a.shape[0] != m or a.shape[1] % dp:
                raise ValueError(f"input {jax.tree_util.keystr(path)} has shape {a.shape}; it needs [m={m}, "
                                 f"rows, ...] with rows divisible by {dp} (the size of {rows})")
        lead = len(region.copies)
        active = active_layers(schedule)
        for path, a in jax.tree_util.tree_leaves_with_path(params["stages"]):
            if a.shape[lead:lead + 2] != (p, v) or (active is not None and a.shape[lead + 2] != active.shape[2]):
                lc = "" if active is None else f"Lc={active.shape[2]}, "
                raise ValueError(f"stage weight {jax.tree_util.keystr(path)} has shape {a.shape}; it needs "
                                 f"[{'R, ' * lead}p={p}, v={v}, {lc}...]: convert stacked weights with "
                                 f"to_pipeline_layout")
        param_specs = param_specs or {}
        specs = {}
        for key in ("first", "stages", "last"):
            given = param_specs.get(key)
            tree = jax.tree.structure(params[key])
            leaf_specs = [P()] * tree.num_leaves if given is None else tree.flatten_up_to(given)
            if key == "stages":
                leaf_specs = [P("pipe", None, *s) for s in leaf_specs]
            leaf_specs = [region.param_spec(s) for s in leaf_specs]
            specs[key] = jax.tree.unflatten(tree, leaf_specs)
        model_axes = set().union(axes_of(input_spec), *map(axes_of, jax.tree.leaves(specs))) - {"pipe", *region.copies}
        unknown = model_axes - set(mesh.axis_names)
        if unknown or set(batch) & axes_of(input_spec):
            raise ValueError(f"param_specs / input_spec name axes {sorted(model_axes)}: they must be mesh axes "
                             f"{mesh.axis_names} other than pipe, and input_spec none of the batch axes {batch}")
        batch_spec = P(None, rows if rows else None, *input_spec)
        routed = ()
        if routed_inputs:
            ranks = {"first": int(np.argwhere(schedule.stage_of == 0)[0][0]),
                     "last": int(np.argwhere(schedule.stage_of == schedule.num_stages - 1)[0][0])}
            split = tuple(input_spec)[0] if len(input_spec) else None
            split = ("pipe",) if split is None else (*((split,) if isinstance(split, str) else split), "pipe")
            pieces = int(np.prod([mesh.shape[a] for a in split]))
            for key, role in routed_inputs.items():
                if role not in ranks or key not in inputs or inputs[key].ndim != 3 or inputs[key].shape[2] % pieces:
                    raise ValueError(f"routed input {key!r} -> {role!r}: expected 'first' or 'last' for an input "
                                     f"[m, rows, T] with T divisible by {' x '.join(split)} = {pieces}")
            routed = tuple((key, ranks[role]) for key, role in sorted(routed_inputs.items()))
            batch_spec = {k: P(None, rows if rows else None, split) if k in routed_inputs else batch_spec
                          for k in inputs}
        manual = region.copies + manual_axes(mesh, batch_axes, specs, input_spec, region)
        return cls(mesh, specs, batch_spec, manual, batch, routed, region, active)

    def gather(self, inputs):
        """Inside the shard_map: each routed input whole on the rank that reads it (stage 0's rank for the
        first stage's inputs, the last stage's rank for the last's), from the pieces the pipe ranks hold
        (dim 2 split over `pipe`, the minor part of its split): p - 1 single-pair permutes, so only that
        rank receives the input, once per step. On the other ranks the result is never read."""
        if not self.routed:
            return inputs
        out, p = dict(inputs), self.mesh.shape["pipe"]
        for key, owner in self.routed:
            x = inputs[key]
            out[key] = jnp.concatenate([x if r == owner else jax.lax.ppermute(x, "pipe", [(r, owner)])
                                        for r in range(p)], axis=2)
        return out

    def param_in_specs(self) -> tuple:
        return self.specs["first"], self.specs["stages"], self.specs["last"]

    def call(self, body, weights, inputs, out_specs, extra=(), extra_specs=()):
        """`body(*weights, inputs, *extra)` in the shard_map manual over `manual`: `weights` a tuple of
        `{first, stages, last}` trees (one per weight version), `extra` further arguments with their specs."""
        in_specs = self.param_in_specs() * len(weights) + (self.batch_spec, *extra_specs)
        args = tuple(w[k] for w in weights for k in ("first", "stages", "last")) + (inputs, *extra)
        args = tuple(a if a is None else place(a, self.mesh, s) for a, s in zip(args, in_specs))
        # Manual over the mesh's axes of size 1 too: nothing is split over them, and a region with no auto axis
        # is one a hand-written kernel (a Mosaic custom call: splash attention) can be lowered in.
        ones = {a for a in self.mesh.axis_names if self.mesh.shape[a] == 1}
        run = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, axis_names=set(self.manual) | ones,
                            out_specs=out_specs)
        return run(*args)

    def reduce(self, loss, grads, specs, loss_axes):
        """Inside the shard_map, after the loop: the loss summed over `loss_axes`, and each gradient leaf once
        over the manual axes its spec (`specs`, a tree like `grads`) replicates it over: the batch shards
        (and model axes such as `seq`) hold partial sums, and only the ranks holding stage 0 / the last
        stage contributed to the first / last grads and the loss. One psum per distinct axis set; none over
        `replica` (each replica's results are its own)."""
        leaves, tree = jax.tree.flatten((loss, grads))
        axes = [loss_axes] + [tuple(a for a in self.manual if a not in axes_of(s)) for s in jax.tree.leaves(specs)]
        axes = [self.region.reduced_over(group) for group in axes]
        for group in dict.fromkeys(a for a in axes if a):
            idx = [i for i, a in enumerate(axes) if a == group]
            for i, r in zip(idx, jax.lax.psum([leaves[i] for i in idx], group)):
                leaves[i] = r
        return jax.tree.unflatten(tree, leaves)

    def reduce_stats(self, stats):
        """Stats `[v, ...]` per rank -> `[1, v, ...]` summed over the batch axes and the other manual axes
        but `pipe` they vary over (e.g. `seq`)."""
        def one(a):
            axes = tuple(x for x in self.region.reduced_over(self.manual) if x != "pipe" and x in varying_axes(a))
            return (jax.lax.psum(a, axes) if axes else a)[None]
        return jax.tree.map(one, stats)
