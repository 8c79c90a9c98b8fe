"""The pipeline executor: runs a schedule table as one `lax.scan` over ticks inside a `jax.shard_map`.

`compile_schedule` (`program.py`) lowers a `Schedule` (numpy, ahead of time) into per-tick, per-rank
integer instructions. `pipeline_value_and_grad` runs those instructions: every tick each rank `lax.switch`es
on its branch, then the tick's outputs move to the neighbour ranks (+1 ring "up", -1 ring "down") by one
`ppermute` per distinct set of sending pairs, run only on the ticks that use it (`Program.send_patterns`).
With `layer_fn` a chunk is run layer by layer and a split backward partitions each layer's pullback
(`split.py`), so B + W does the work of one fused BW. `to_pipeline_layout` / `from_pipeline_layout` move stacked layer
weights `[L, ...]` to the executor's `[p, v, L / (p * v), ...]` layout and back. `pipeline_steady_step`
runs a steady schedule (2bw): one window of an endless pipeline per call, with two weight versions and the
activation slots and inbox carried from call to call.

Axis names: `pipe` (ranks), and the batch axes (`data`, `fsdp` by default) over which microbatch rows
are split.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from parallax.pipeline.program import (  # noqa: F401  (compile_schedule is part of this module's API)
    _B, _B_FIRST, _BRANCH, _BW, _BW_FIRST, _CHUNK, _F, _F_FIRST, _F_LAST, _FROM_DOWN, _FROM_UP, _IDLE, _IN,
    _LOCAL, _MB, _SLOT, _VERSION, _W, Program, compile_schedule)
from parallax.pipeline.schedule import Schedule
from parallax.pipeline.split import SplitBackward

def _take_rows(a, idx):
    """`a[idx]` along dim 0. For explicitly sharded arrays dim 0 of the result is unsharded and the other
    dims keep their sharding (a gather needs its output sharding spelled out)."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    if sharding is None or AxisType.Explicit not in sharding.mesh.axis_types:
        return a[idx]
    spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
    return a.at[idx].get(out_sharding=NamedSharding(sharding.mesh, P(None, *spec[1:])))


def _identity(order) -> bool:
    return bool((np.asarray(order) == np.arange(len(order))).all())


def to_pipeline_layout(stacked, schedule: Schedule):
    """Stacked layer weights (leaves `[L, ...]`) -> executor layout `[p, v, L / (p * v), ...]`.

    Stage s holds layers `[s * Lc, (s + 1) * Lc)`; `staged[r, c]` is stage `schedule.stage_of[r, c]`.
    When rank r's chunk c is stage r * v + c (gpipe, 1f1b, zb_h1) this is a reshape: the layers dim sharded
    over `pipe` stays where it lives, and no collective moves layer weights. Otherwise (interleaved, zbv)
    the stages are permuted with a gather, which the partitioner implements by moving the stack.
    """
    p, v = schedule.stage_of.shape
    order = schedule.stage_of.ravel()

    def one(a):
        if a.shape[0] % (p * v):
            raise ValueError(f"{a.shape[0]} layers do not split evenly into {p * v} pipeline stages "
                             f"({p} ranks x {v} chunks); use a layer count divisible by {p * v}")
        stages = a.reshape(p * v, a.shape[0] // (p * v), *a.shape[1:])  # [S, Lc, ...]
        if not _identity(order):
            stages = _take_rows(stages, order)
        return stages.reshape(p, v, *stages.shape[1:])

    return jax.tree.map(one, stacked)


def from_pipeline_layout(staged, schedule: Schedule):
    """The inverse of `to_pipeline_layout`: `[p, v, Lc, ...]` -> `[p * v * Lc, ...]`."""
    order = np.argsort(schedule.stage_of.ravel())  # flat (r * v + c) of each stage, in stage order

    def one(a):
        stages = a.reshape(-1, *a.shape[2:])  # [S, Lc, ...] in rank order
        if not _identity(order):
            stages = _take_rows(stages, order)
        return stages.reshape(-1, *a.shape[3:])

    return jax.tree.map(one, staged)


def _place(tree, mesh, specs):
    """Puts `tree` in sharding `specs` (one spec, or a tree of them) if the mesh has explicit axes
    (shard_map then requires it)."""
    if all(t != AxisType.Explicit for t in mesh.axis_types):
        return tree
    if isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, tree)
    return jax.tree.map(lambda a, s: jax.reshard(a, NamedSharding(mesh, s)), tree, specs)


def _vma(a) -> frozenset:
    """The manual mesh axes over which `a` varies (its type inside the shard_map)."""
    return jax.typeof(a).manual_axis_type.varying


def _axes_of(spec) -> set:
    """Mesh axes a PartitionSpec names."""
    return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def pipeline_value_and_grad(schedule: Schedule, *, first_fn, last_fn, params, inputs, mesh, stage_fn=None,
                            layer_fn=None, remat=False, batch_axes=("data", "fsdp"), param_specs=None,
                            input_spec=P(), stage_aux=False, routed_inputs=None):
    """Loss and gradients of a pipelined model, running `schedule` over the mesh axis `pipe`.

    The model is `sum_mb last_fn(last, stage_{S-1}(... stage_0(first_fn(first, mb)) ...), mb)`, where
    stage s applies `stage_fn` with the weights of stage s. Give either `stage_fn` (a chunk as a black box)
    or `layer_fn` (one layer): then a chunk is its layers in order (the stage leaves' dim after `[p, v]`),
    the executor runs them itself, and a split backward (zb_h1, zbv) computes each layer's weight
    gradient once in W instead of re-running the chunk's chain of input cotangents (B stores each
    layer's output cotangent for it: one activation per layer per microbatch waiting for its W).

    params: {'first': pytree (used by stage 0's rank), 'stages': pytree with leaves `[p, v, ...]` in the
      local chunk layout of `to_pipeline_layout` (dim 0 sharded over `pipe`), 'last': pytree}.
    inputs: dict of arrays `[m, mb_rows, ...]`; rows are split over the `batch_axes` of size > 1, the
      dims after them as `input_spec` says (e.g. `P('seq')`: the sequence split over `seq`).
    layer_fn(layer, x, mb_inputs): like stage_fn for one layer (leaves of `layer` without the layers dim).
    param_specs: optional {'first', 'stages', 'last'} trees of PartitionSpecs (a missing key or None:
      replicated) for model parallelism inside the stages, e.g. `P(None, 'tensor')`; for 'stages' they
      describe the dims after `[p, v]`. The functions then run on these shards, with collectives of
      their own over the axes the specs (and `input_spec`) name. A spec may name a batch axis (FSDP:
      `P(None, 'fsdp')`): the function all-gathers that weight where it uses it, the gather's transpose
      reduce-scatters its gradient over the batch shards, and the accumulator stays sharded.
    first_fn(first, mb_inputs) -> x `[rows, ...]`; stage_fn(chunk, x, mb_inputs) -> x (same shape and
      dtype), or with `stage_aux`, `(x, (aux_loss, stats))` (stages with aux values, e.g. MoE layers): `aux_loss` a scalar
      added to the loss (and differentiated; normalised like last_fn's value), `stats` a pytree of
      per-rank sums that are not differentiated (e.g. a router's per-expert load), summed over the
      microbatches, the batch shards and the other manual axes they vary over but `pipe`; last_fn(last, x, mb_inputs) -> scalar, normalised so the sum over microbatches, over the
      batch shards and over every other manual axis its value varies over (e.g. `seq` shards of the
      tokens) is the loss. A value already complete on every rank of an axis (e.g. a vocabulary-parallel
      cross-entropy, psummed over `tensor`) is invariant over it, and is not summed over it.
    remat: store only each chunk's input and recompute its forward in the backward, instead of storing
      the vjp residuals.

    Returns (loss, grads), or (loss, grads, stats) when stage_fn returns stats: grads has the structure
    and layout of `params` (sharded as `param_specs`), in float32 (accumulated in float32), and equals
    `jax.value_and_grad` of the unpipelined model; stats leaves are `[p, v, ...]` like the stage weights
    (`from_pipeline_layout` stacks them per layer).

    The shard_map is manual over `pipe`, the batch axes and the axes the specs name. Every weight is cast
    to varying over all of them before any vjp, so no transpose inserts a collective inside the loop; each
    gradient leaf is summed once, after the loop, over the manual axes its spec replicates it over. Every
    rank gets every microbatch's inputs (replicated over `pipe`), except `routed_inputs`: {key: 'first' |
    'last'} for inputs only the first stage's function (first_fn) or only the last's (last_fn) reads; they
    come split over `pipe` along dim 2 as well (the minor part: `P(None, rows, ('seq', 'pipe'))` with
    `input_spec=P('seq')`), and are gathered on the rank that reads them before the loop.

    Collectives inside the functions run inside per-rank switch branches, so they must stay within one
    pipeline rank: those with replica groups (psum, all-gather, reduce-scatter, all-to-all over the model
    axes) do. A `ppermute` does not: an XLA collective-permute has no replica groups, every device joins
    each one, and on XLA:CPU permutes of different branches and ticks get matched (wrong values).
    """
    if schedule.steady:
        raise ValueError(f"{schedule.name} is a steady schedule: run it with pipeline_steady_step")
    layout = _Layout.make(schedule, params, inputs, mesh, batch_axes, param_specs, input_spec,
                          routed_inputs=routed_inputs)
    prog = compile_schedule(schedule)
    fns = (first_fn, _one_of(stage_fn, layer_fn), last_fn)

    def body(first_p, stage_p, last_p, inputs):
        inputs = layout.gather(inputs)
        trace = _Trace(fns, layout.manual, remat, first_p, stage_p, last_p, inputs, stage_aux=stage_aux,
                       batch=layout.batch, layered=layer_fn is not None, split_w=True)
        trace.probe()
        loss, (gw, gf, gl), stats = trace.run(prog)
        loss, grads = trace.reduce(loss, {"first": gf, "stages": jax.tree.map(lambda a: a[None], gw), "last": gl},
                                   layout.specs)
        return (loss, grads, trace.reduce_stats(stats)) if stage_aux else (loss, grads)

    # Stats leaves are [1, v, ...] per rank, split over `pipe` (P("pipe") is a prefix spec for all of them).
    return layout.call(body, params, inputs, out_specs=(P(), layout.specs, P("pipe")) if stage_aux else
                       (P(), layout.specs))


def pipeline_steady_step(schedule: Schedule, *, first_fn, last_fn, params, previous, inputs, mesh, inflight=None,
                         stage_fn=None, layer_fn=None, remat=False, batch_axes=("data", "fsdp"), param_specs=None,
                         input_spec=P(), routed_inputs=None):
    """One step of a steady schedule (`2bw`): one window of an endless pipeline, with no flush.

    The window runs the current step's forwards with `params` and finishes the previous step's
    microbatches still in flight with `previous` (the weights their forwards used: PipeDream-2BW's second
    weight version). `inputs` hold 2m microbatches `[2m, rows, ...]`: the previous step's m, then the
    current step's. `inflight` is what the previous window left in flight (None: an empty pipeline, at the
    first step; the previous step's microbatches then run on zeros and their results mean nothing).
    The other arguments are those of `pipeline_value_and_grad` (stage aux values are not supported).

    Returns `((loss, grads) of the previous step's microbatches' part run in this window, (loss, grads) of
    the current step's part, inflight)`: a step's loss and gradient are the sum of its part in the window
    where it started and its part in the next one (the caller adds them). `inflight`: this rank's
    activation slots and inbox, leaves `[devices, ...]` whose leading dim is split over the shard_map's
    manual axes (`manual_axes`); opaque: hand them to the next call."""
    if not schedule.steady:
        raise ValueError(f"{schedule.name} flushes every step: run it with pipeline_value_and_grad")
    m = schedule.num_microbatches
    layout = _Layout.make(schedule, params, inputs, mesh, batch_axes, param_specs, input_spec, microbatches=2 * m,
                          routed_inputs=routed_inputs)
    _Layout.make(schedule, previous, inputs, mesh, batch_axes, param_specs, input_spec, microbatches=2 * m)
    prog = compile_schedule(schedule)
    fns = (first_fn, _one_of(stage_fn, layer_fn), last_fn)
    spec = P(layout.manual)

    def body(prev_first, prev_stage, prev_last, first_p, stage_p, last_p, inputs, inflight):
        inputs = layout.gather(inputs)
        trace = _Trace(fns, layout.manual, remat, first_p, stage_p, last_p, inputs, batch=layout.batch,
                       layered=layer_fn is not None, previous=(prev_first, prev_stage, prev_last))
        trace.probe()
        if inflight is not None:
            inflight = jax.tree.map(lambda a: a[0], inflight)
        loss, (gw, gf, gl), _, inflight = trace.run(prog, inflight)
        v = trace.stage_p_chunks
        grads = tuple({"first": jax.tree.map(lambda a: a[k], gf), "last": jax.tree.map(lambda a: a[k], gl),
                       "stages": jax.tree.map(lambda a: a[None, k * v:(k + 1) * v], gw)} for k in range(2))
        loss, grads = trace.reduce(loss, grads, (layout.specs, layout.specs))
        inflight = jax.tree.map(lambda a: _cast(a, layout.manual)[None], inflight)
        return (loss[0], grads[0]), (loss[1], grads[1]), inflight

    in_specs = (layout.specs["first"], layout.specs["stages"], layout.specs["last"]) * 2 + (layout.batch_spec,)
    args = (previous["first"], previous["stages"], previous["last"], params["first"], params["stages"],
            params["last"], inputs)
    args = tuple(_place(a, mesh, sp) for a, sp in zip(args, in_specs))
    if inflight is not None:
        inflight = _place(inflight, mesh, spec)
    run = jax.shard_map(body, mesh=mesh, in_specs=in_specs + (spec,), axis_names=set(layout.manual),
                        out_specs=((P(), layout.specs), (P(), layout.specs), spec))
    return run(*args, inflight)


def pipeline_loss(schedule: Schedule, *, first_fn, last_fn, params, inputs, mesh, stage_fn=None, layer_fn=None,
                  batch_axes=("data", "fsdp"), param_specs=None, input_spec=P(), stage_aux=False, routed_inputs=None):
    """The loss of `pipeline_value_and_grad` alone (evaluation): the same shard_map and layout, running
    only the schedule's F actions (`compile_schedule(..., forward_only=True)`); nothing is stored for a
    backward and no gradient is accumulated. Stages' aux losses are not included (last_fn's loss alone)."""
    layout = _Layout.make(schedule, params, inputs, mesh, batch_axes, param_specs, input_spec,
                          routed_inputs=routed_inputs)
    prog = compile_schedule(schedule, forward_only=True)

    def body(first_p, stage_p, last_p, inputs):
        inputs = layout.gather(inputs)
        trace = _Trace((first_fn, _one_of(stage_fn, layer_fn), last_fn), layout.manual, False, first_p, stage_p,
                       last_p, inputs, forward_only=True, stage_aux=stage_aux, layered=layer_fn is not None)
        loss, _, _ = trace.run(prog)
        return trace.reduce(loss, {}, {})[0]

    return layout.call(body, params, inputs, out_specs=P())


def manual_axes(mesh, batch_axes, param_specs, input_spec) -> tuple:
    """The mesh axes the executor's shard_map is manual over: `pipe`, the batch axes of size > 1, and the
    other axes of size > 1 that the specs name. A steady step's in-flight leaves are split over them."""
    batch = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1)
    named = set().union(_axes_of(input_spec), *map(_axes_of, jax.tree.leaves(param_specs))) - {"pipe"}
    return ("pipe",) + batch + tuple(a for a in mesh.axis_names if a in named and a not in batch and mesh.shape[a] > 1)


def _one_of(stage_fn, layer_fn):
    if (stage_fn is None) == (layer_fn is None):
        raise TypeError("give the executor exactly one of stage_fn (a chunk) and layer_fn (one layer)")
    return stage_fn or layer_fn


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the executor's arguments lie on the mesh: the shard_map's specs and its manual axes."""
    mesh: object
    specs: dict  # full in/out spec per params leaf, {'first', 'stages', 'last'}
    batch_spec: P
    manual: tuple
    batch: tuple  # the batch axes of size > 1 (manual)
    routed: tuple = ()  # (input key, the pipe rank that reads it): split over `pipe` along dim 2, see `gather`

    @classmethod
    def make(cls, schedule, params, inputs, mesh, batch_axes, param_specs, input_spec,
             microbatches=None, routed_inputs=None) -> "_Layout":
        """Checks the arguments' shapes against the schedule and the mesh, and derives the specs."""
        p, v, m = schedule.num_ranks, schedule.num_chunks, microbatches or schedule.num_microbatches
        if mesh.shape.get("pipe") != p:
            raise ValueError(f"schedule {schedule.name} has {p} ranks but the mesh has pipe="
                             f"{mesh.shape.get('pipe')}; set mesh pipe={p}")
        batch = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1)
        dp = int(np.prod([mesh.shape[a] for a in batch]))
        for path, a in jax.tree_util.tree_leaves_with_path(inputs):
            if a.ndim < 2 or a.shape[0] != m or a.shape[1] % dp:
                raise ValueError(f"input {jax.tree_util.keystr(path)} has shape {a.shape}; it needs [m={m}, "
                                 f"rows, ...] with rows divisible by {dp} (the size of {batch})")
        for path, a in jax.tree_util.tree_leaves_with_path(params["stages"]):
            if a.shape[:2] != (p, v):
                raise ValueError(f"stage weight {jax.tree_util.keystr(path)} has shape {a.shape}; it needs "
                                 f"[p={p}, v={v}, ...]: convert stacked weights with to_pipeline_layout")
        param_specs = param_specs or {}
        specs = {}
        for key in ("first", "stages", "last"):
            given = param_specs.get(key)
            tree = jax.tree.structure(params[key])
            leaf_specs = [P()] * tree.num_leaves if given is None else tree.flatten_up_to(given)
            if key == "stages":
                leaf_specs = [P("pipe", None, *s) for s in leaf_specs]
            specs[key] = jax.tree.unflatten(tree, leaf_specs)
        model_axes = set().union(_axes_of(input_spec), *map(_axes_of, jax.tree.leaves(specs))) - {"pipe"}
        unknown = model_axes - set(mesh.axis_names)
        if unknown or set(batch) & _axes_of(input_spec):
            raise ValueError(f"param_specs / input_spec name axes {sorted(model_axes)}: they must be mesh axes "
                             f"{mesh.axis_names} other than pipe, and input_spec none of the batch axes {batch}")
        batch_spec = P(None, batch if batch else None, *input_spec)
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
            batch_spec = {k: P(None, batch if batch else None, split) if k in routed_inputs else batch_spec
                          for k in inputs}
        return cls(mesh, specs, batch_spec, manual_axes(mesh, batch_axes, specs, input_spec), batch, routed)

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

    def call(self, body, params, inputs, out_specs):
        in_specs = (self.specs["first"], self.specs["stages"], self.specs["last"], self.batch_spec)
        args = (params["first"], params["stages"], params["last"], inputs)
        args = tuple(_place(a, self.mesh, s) for a, s in zip(args, in_specs))
        run = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, axis_names=set(self.manual),
                            out_specs=out_specs)
        return run(*args)


def _cast(a, axes):
    """`a` varying over `axes` as well."""
    missing = tuple(x for x in axes if x not in _vma(a))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def _zeros(a, dtype=None, axes=None):
    """Zeros like `a`, varying over `axes` (default: as `a` is)."""
    axes = tuple(_vma(a)) if axes is None else axes
    return _cast(jnp.zeros(a.shape, dtype or a.dtype), axes)


def _write(buf, i, value):
    """buf[i] = value where i >= 0; in place, outside any switch branch."""
    j = jnp.maximum(i, 0)
    old = jax.lax.dynamic_index_in_dim(buf, j, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(i >= 0, value, old), j, 0)


def _send(pattern, msg, patterns):
    """`ppermute(msg, "pipe", patterns[pattern - 1])`, or zeros (nothing moves) for pattern 0. The pattern
    comes from a table every device holds whole, so all devices take the same branch: each permute is one
    collective that every device joins (permutes in per-rank branches would be paired wrongly)."""
    branches = [_zeros] + [lambda m, perm=perm: jax.lax.ppermute(m, "pipe", perm) for perm in patterns]
    return jax.lax.switch(pattern, branches, msg)


def _add_chunk(acc, c, d):
    def one(a, b):
        cur = jax.lax.dynamic_index_in_dim(a, c, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(a, cur + b, c, 0)
    return jax.tree.map(one, acc, d)


class _Trace:
    """The executor's body as traced on one rank inside the shard_map, in four parts: the probe (what a
    layer's pullback holds), the switch branches (one per kind of action), the tick (one scan step), and
    the reduction of the results over the manual axes after the loop.

    A chunk is a sequence of layers: with `layer_fn` the executor scans the chunk's layers itself (the
    leaves' dim after `[p, v]`), one vjp per layer, so the backward can be split per layer (see
    `backward`); with `stage_fn` alone the chunk is one opaque "layer" and nothing changes but the names.

    Every weight is cast to varying over all manual axes before any vjp, so no transpose inserts a
    collective inside the loop. With `forward_only` the branches run forwards and the loss only.
    """

    def __init__(self, fns, manual, remat, first_p, stage_p, last_p, inputs, forward_only=False, stage_aux=False,
                 batch=(), layered=False, split_w=False, previous=None):
        self.first_fn, self.layer_fn, self.last_fn = fns
        self.manual, self.remat, self.forward_only, self.stage_aux = manual, remat, forward_only, stage_aux
        self.layered = layered
        # Per-layer weight gradients in W (see `backward`): B stores each layer's output cotangent.
        self.split_w = split_w and layered and not remat and not forward_only
        # Stats are this rank's sums over its rows: typed varying over `pipe` and the batch axes, so that the
        # reduction sums them over the batch shards whatever their type (a per-rank constant included).
        self.stats_axes = ("pipe", *batch)
        # Weight versions: [current], or [previous, current] for a steady schedule (2bw), whose branches
        # are traced once per version (`branches`); `version` selects the one being traced.
        self.versions = [tuple(self.vary(x) for x in (f, jax.tree.map(lambda a: a[0], st), l))  # stages: [v, ...]
                         for f, st, l in ([previous] if previous else []) + [(first_p, stage_p, last_p)]]
        self.version = len(self.versions) - 1
        self.stage_p_chunks = jax.tree.leaves(stage_p)[0].shape[1]
        # Inputs vary over `pipe` too (so that whatever the stages derive from them counts as per-microbatch,
        # see `probe`) but stay invariant over the model axes: they are the same on those ranks, which
        # keeps, e.g., a vocabulary-parallel loss invariant over `tensor`.
        self.inputs = jax.tree.map(lambda a: _cast(a, ("pipe",)), inputs)
        self.mb0, self.w0 = self.mb_inputs(0), self.layer(self.chunk(0), 0)
        self.x0 = self.first_fn(self.first_p, self.mb0)
        self.res_avals, self.roles, self.treedef = [], [], None
        # The loss is summed over `pipe` and over the manual axes last_fn's value (and the stages' aux
        # losses, in training) vary over. Probes: only their types are used.
        loss_vma = _vma(self.last_fn(self.last_p, self.x0, self.mb0))
        self.term0, self.stats0 = None, ()
        if stage_aux and not forward_only:
            _, self.term0, stats = self.apply(self.w0, self.x0, self.mb0)
            self.stats0 = self.stack_like(stats)  # a chunk's stats: stacked over its layers
            loss_vma = loss_vma | _vma(self.term0)
        self.loss_axes = tuple(a for a in manual if a == "pipe" or a in loss_vma)

    @property
    def first_p(self):
        return self.versions[self.version][0]

    @property
    def stage_p(self):
        return self.versions[self.version][1]

    @property
    def last_p(self):
        return self.versions[self.version][2]

    def vary(self, tree):  # varying over every manual axis, so that no vjp transpose inserts a psum
        return jax.tree.map(lambda a: _cast(a, self.manual), tree)

    def mb_inputs(self, i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), self.inputs)

    def chunk(self, c):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False), self.stage_p)

    @property
    def chunk_layers(self) -> int:
        return jax.tree.leaves(self.stage_p)[0].shape[1] if self.layered else 1

    def layer(self, w, i):
        """Layer i's weights of chunk weights w (the chunk itself when it is one opaque layer)."""
        return jax.tree.map(lambda a: a[i], w) if self.layered else w

    def stack_like(self, tree):
        """Zeros like `tree` (same types), stacked over the chunk's layers (unstacked for an opaque chunk)."""
        lead = (self.chunk_layers,) if self.layered else ()
        return jax.tree.map(lambda a: _zeros(jax.ShapeDtypeStruct(lead + a.shape, a.dtype), axes=_vma(a)), tree)

    def over_layers(self, fn, carry, xs, reverse=False):
        """`lax.scan(fn, carry, xs)` over the chunk's layers; one call of fn on the whole chunk when opaque."""
        if self.layered:
            return jax.lax.scan(fn, carry, xs, reverse=reverse)
        return fn(carry, xs)

    def apply(self, w, x, mb):
        """One layer: layer_fn -> (y, aux loss term or None, stats or ())."""
        out = self.layer_fn(w, x, mb)
        if not self.stage_aux:
            return out, None, ()
        y, (term, stats) = out
        return y, term.astype(jnp.float32), jax.tree.map(lambda a: _cast(jax.lax.stop_gradient(a),
                                                                        self.stats_axes), stats)

    def vjp_layer(self, w, x, mb):
        """-> (y, pullback, aux loss term, stats). With stage aux values the pullback takes (dy, d term)
        (`seed`) and the term's gradient flows into dw and dx with the activations'."""
        if not self.stage_aux:
            y, pb = jax.vjp(lambda w, x: self.layer_fn(w, x, mb), w, x)
            return y, pb, None, ()

        def f(w, x):
            y, term, stats = self.apply(w, x, mb)
            return (y, term), stats
        (y, term), pb, stats = jax.vjp(f, w, x, has_aux=True)
        return y, pb, term, stats

    def seed(self, dy):
        """The pullback's cotangent for an output cotangent dy: (dy, 1) with stage aux losses, else dy."""
        if not self.stage_aux:
            return dy
        return dy, _cast(jnp.ones((), jnp.float32), tuple(_vma(self.term0)))

    # --- the probe ------------------------------------------------------------------------------------

    def probe(self):
        """Traces one layer's pullback to learn its treedef and which leaves are real residuals (to store),
        which are the weights or microbatch inputs (refetched in the backward), and which are constants."""
        _, probe, _, _ = self.vjp_layer(self.w0, self.x0, self.mb0)
        probe_leaves, self.treedef = jax.tree.flatten(probe)
        w_leaves, mb_leaves = jax.tree.leaves(self.w0), jax.tree.leaves(self.mb0)
        roles = []  # per pullback leaf: ("w", i) | ("mb", i) | ("const", leaf) | ("res", i)
        for leaf in probe_leaves:
            if any(leaf is a for a in w_leaves):
                roles.append(("w", next(i for i, a in enumerate(w_leaves) if leaf is a)))
            elif any(leaf is a for a in mb_leaves):
                roles.append(("mb", next(i for i, a in enumerate(mb_leaves) if leaf is a)))
            elif "pipe" not in _vma(leaf):  # derived from neither the weights nor the inputs
                roles.append(("const", leaf))
            else:
                roles.append(("res", sum(r == "res" for r, _ in roles)))
        self.roles = roles
        self.res_avals = [leaf for (r, _), leaf in zip(roles, probe_leaves) if r == "res"]
        if self.split_w:
            self.split = SplitBackward(lambda leaves, dy: jax.tree.unflatten(self.treedef, leaves)(self.seed(dy)),
                                       probe_leaves, self.x0)
            self.boundary0 = self.split.b(probe_leaves, self.x0)[1]  # only their types are used

    def slot_avals(self):
        """What one activation slot holds: the chunk input (remat) or every layer's residuals."""
        if self.remat:
            return [self.x0]
        return self.stack_like(self.res_avals)

    def forward(self, c, x, mb):
        """-> (y, what to store in the slot, aux loss term or None, stats or ())."""
        w = self.chunk(c)
        if self.forward_only or self.remat:
            def body(h, wl):
                y, term, stats = self.apply(wl, h, mb)
                return y, (term, stats)
            y, (terms, stats) = self.over_layers(body, x, w)
            if self.forward_only:  # evaluation: the loss alone
                return y, (), None, ()
            return y, (x,), self.total(terms), stats
        y, res, term, stats = self.forward_residuals(w, x, mb)
        return y, res, term, stats

    def total(self, terms):
        return None if terms is None else jnp.sum(terms) if self.layered else terms

    def forward_residuals(self, w, x, mb):
        """The chunk's forward with a vjp per layer -> (y, residual leaves stacked over layers, term, stats)."""
        def body(h, wl):
            y, pb, term, stats = self.vjp_layer(wl, h, mb)
            leaves, refs = jax.tree.leaves(pb), {"w": jax.tree.leaves(wl), "mb": jax.tree.leaves(mb)}
            if len(leaves) != len(self.roles) or any(r in refs and a is not refs[r][i]
                                                     for (r, i), a in zip(self.roles, leaves)):
                raise RuntimeError("the stage's pullback changed structure between traces; stage_fn / layer_fn "
                                   "must not branch in Python on the values of its inputs")
            return y, (tuple(a for (r, _), a in zip(self.roles, leaves) if r == "res"), term, stats)
        y, (res, terms, stats) = self.over_layers(body, x, w)
        return y, res, self.total(terms), stats

    def pullback_leaves(self, wl, res, mb):
        """One layer's pullback leaves from its weights wl and residual leaves res."""
        w_leaves, mb_leaves = jax.tree.leaves(wl), jax.tree.leaves(mb)
        return [w_leaves[i] if r == "w" else mb_leaves[i] if r == "mb" else i if r == "const" else
                res[i] for r, i in self.roles]

    def pullback(self, wl, res, mb):
        """One layer's pullback rebuilt from its weights wl and residual leaves res."""
        return jax.tree.unflatten(self.treedef, self.pullback_leaves(wl, res, mb))

    def backward(self, c, slot, mb, slots, dy, cots, need_dx, need_dw):
        """-> (dx or None, dW of the chunk or None, per-layer output cotangents to store or None).

        B / BW run down the layers, each layer's pullback taking the cotangent of its output; B keeps only
        dx (the weight-gradient products are dead code, removed by the compiler) and, with `split_w`,
        stores each layer's output cotangent. W then runs each layer's pullback once more on that
        cotangent and keeps only dW: the weight-gradient products alone, no chain through the chunk, so
        B + W does the work of one BW. Without per-layer cotangents (an opaque chunk, or remat) W takes
        the chunk's output cotangent and re-runs the chain below it (the inner layers' dx, then dead)."""
        w = self.chunk(c)
        if self.remat:  # recompute the residuals from the stored chunk input
            res = self.forward_residuals(w, slots[0][slot], mb)[1]
        else:
            res = tuple(s[slot] for s in slots)
        if cots is not None:  # W: each layer's weight-gradient equations on B's stored boundary values
            def body(_, xs):
                wl, rl, bnd = xs
                return None, self.split.w(self.pullback_leaves(wl, rl, mb), bnd)
            return None, self.over_layers(body, None, (w, res, cots))[1], None

        if self.split_w and need_dx and not need_dw:  # B: the input-cotangent equations, keeping the boundary
            def body(d, xs):
                wl, rl = xs
                return self.split.b(self.pullback_leaves(wl, rl, mb), d)
            dx, stored = self.over_layers(body, dy, (w, res), reverse=True)
            return dx, None, stored

        def body(d, xs):
            wl, rl = xs
            dwl, dx = self.pullback(wl, rl, mb)(self.seed(d))
            return dx, dwl if need_dw else None
        dx, dw = self.over_layers(body, dy, (w, res), reverse=True)
        return (dx if need_dx else None), dw, None

    # --- the branches ---------------------------------------------------------------------------------

    def cot_avals(self):
        """What one boundary slot holds (`split_w`): each of a chunk's layers' boundary values (B -> W)."""
        return self.stack_like(self.boundary0)

    def out(self, msg=None, res=None, dw=None, dfirst=None, dlast=None, loss=None, stats=None, cots=None):
        """What one tick produced: (message to send (an activation or an input cotangent, shaped like x),
        what to store in the activation slot, per-layer cotangents to store (`split_w`), (dW of the chunk,
        d first, d last) in fp32, loss, the chunk's stats), zeros where it produced nothing. The carry is
        updated outside the switch, so that XLA updates the buffers in place instead of copying them
        through the conditional."""
        f32 = jnp.float32

        def f32_or_zeros(grad, like):
            return jax.tree.map(lambda a: _zeros(a, f32), like) if grad is None else \
                jax.tree.map(lambda g: g.astype(f32), grad)
        grads = () if self.forward_only else (
            f32_or_zeros(dw, self.stage_w0), f32_or_zeros(dfirst, self.first_p), f32_or_zeros(dlast, self.last_p))
        cot = () if not self.split_w else tuple(map(_zeros, self.cot_avals())) if cots is None else cots
        return (_zeros(self.x0) if msg is None else msg.astype(self.x0.dtype),
                tuple(_zeros(a) for a in self.slot_avals()) if res is None else res, cot, grads,
                _zeros(jax.ShapeDtypeStruct((), f32), axes=self.loss_axes) if loss is None else
                _cast(loss.astype(f32), self.loss_axes),
                jax.tree.map(_zeros, self.stats0) if stats is None else stats)

    @property
    def stage_w0(self):
        return self.chunk(0)

    def branches(self, prog: Program):
        """The switch branches `prog` uses, each `(slots, cots, inbox, instruction) -> out(...)`."""
        def idle(slots, cots, inbox, ins):
            return self.out()

        def fwd(slots, cots, inbox, ins):
            y, res, term, stats = self.forward(ins[_CHUNK], inbox[ins[_IN]], self.mb_inputs(ins[_MB]))
            return self.out(msg=y, res=res, loss=term, stats=stats or None)

        def fwd_first(slots, cots, inbox, ins):
            mb = self.mb_inputs(ins[_MB])
            y, res, term, stats = self.forward(ins[_CHUNK], self.first_fn(self.first_p, mb), mb)
            return self.out(msg=y, res=res, loss=term, stats=stats or None)

        def fwd_last(slots, cots, inbox, ins):
            mb = self.mb_inputs(ins[_MB])
            y, res, term, stats = self.forward(ins[_CHUNK], inbox[ins[_IN]], mb)
            if self.forward_only:
                return self.out(loss=self.last_fn(self.last_p, y, mb))
            l, pb = jax.vjp(lambda lp, y: self.last_fn(lp, y, mb), self.last_p, y)
            dlast, dy = pb(jnp.ones_like(l))
            if term is not None:
                l = _cast(l.astype(jnp.float32), self.loss_axes) + _cast(term, self.loss_axes)
            return self.out(msg=dy, res=res, dlast=dlast, loss=l, stats=stats or None)

        def bwd(slots, cots, inbox, ins, need_dx, need_dw, first):
            mb = self.mb_inputs(ins[_MB])
            stored = tuple(c[ins[_SLOT]] for c in cots) if self.split_w and not need_dx else None
            dx, dw, keep = self.backward(ins[_CHUNK], ins[_SLOT], mb, slots, inbox[ins[_IN]], stored,
                                         need_dx, need_dw)
            if need_dx and first:
                return self.out(dw=dw, cots=keep,
                                dfirst=jax.vjp(lambda fp: self.first_fn(fp, mb), self.first_p)[1](dx)[0])
            return self.out(msg=dx, dw=dw, cots=keep)

        impls = {
            _IDLE: idle, _F: fwd, _F_FIRST: fwd_first, _F_LAST: fwd_last,
            _B: lambda *a: bwd(*a, True, False, False), _B_FIRST: lambda *a: bwd(*a, True, False, True),
            _W: lambda *a: bwd(*a, False, True, False), _BW: lambda *a: bwd(*a, True, True, False),
            _BW_FIRST: lambda *a: bwd(*a, True, True, True),
        }
        if len(self.versions) == 1:
            return [impls[b] for b in prog.branches]

        def versioned(impl, version):  # the branch traced with weight version `version`
            def run(*args):
                self.version = version
                try:
                    return impl(*args)
                finally:
                    self.version = len(self.versions) - 1
            return run
        # Branch index: ins[_BRANCH] + len(prog.branches) * ins[_VERSION].
        return [versioned(impls[b], k) for k in range(len(self.versions)) for b in prog.branches]

    # --- the tick and the loop ------------------------------------------------------------------------

    def tick(self, prog: Program):
        """One scan step: every rank switches on its own instruction, then the messages move.

        Cost per tick: every branch returns every output, so an action that computes no weight gradient
        writes fp32 zeros the size of its chunk's weights, which are then added into the accumulator (and
        likewise an empty slot). Running each kind of action as a `while` loop of 0 or 1 trips instead
        removes those copies (XLA updates a loop's carry in place) but made the step 2.7x (d_model 128) to
        3x (d_model 512) slower on XLA:CPU (`launch/bench.py` Llama, p = 4, m = 8; tried 2026-12), so the
        switch stays; worth measuring again on GPU / TPU."""
        branches, rank = self.branches(prog), jax.lax.axis_index("pipe")
        stores = jnp.asarray(np.isin(np.array(prog.branches), (_F, _F_FIRST, _F_LAST)))
        stores_cots = jnp.asarray(np.isin(np.array(prog.branches), (_B, _B_FIRST)))

        up_patterns, down_patterns = prog.send_patterns("up")[1], prog.send_patterns("down")[1]

        versions = len(self.versions)

        def step(carry, xs):  # code_t: [p, fields]; send_t: this tick's send pattern up and down (0: none)
            code_t, send_t = xs
            slots, cots, inbox, grads, loss, stats = carry
            ins = code_t[rank]
            branch = ins[_BRANCH] if versions == 1 else ins[_BRANCH] + len(prog.branches) * ins[_VERSION]
            msg, res, cot, dgrads, dloss, dstats = jax.lax.switch(branch, branches, slots, cots, inbox, ins)
            stats = _add_chunk(stats, ins[_CHUNK], dstats)
            slot = jnp.where(stores[ins[_BRANCH]], ins[_SLOT], -1)
            slots = tuple(_write(buf, slot, r) for buf, r in zip(slots, res))
            cslot = jnp.where(stores_cots[ins[_BRANCH]], ins[_SLOT], -1)
            cots = tuple(_write(buf, cslot, c) for buf, c in zip(cots, cot))
            if grads and versions > 1:  # one accumulator per version: gw [versions * v, ...], gf / gl [versions, ...]
                (gw, gf, gl), (dw, df, dl) = grads, dgrads
                grads = (_add_chunk(gw, ins[_VERSION] * self.stage_p_chunks + ins[_CHUNK], dw),
                         _add_chunk(gf, ins[_VERSION], df), _add_chunk(gl, ins[_VERSION], dl))
                dloss = jnp.where(jnp.arange(versions) == ins[_VERSION], dloss, jnp.zeros((), dloss.dtype))
            elif grads:
                (gw, gf, gl), (dw, df, dl) = grads, dgrads
                grads = (_add_chunk(gw, ins[_CHUNK], dw), jax.tree.map(jnp.add, gf, df),
                         jax.tree.map(jnp.add, gl, dl))
            inbox = _write(inbox, ins[_LOCAL], msg)
            if up_patterns:
                inbox = _write(inbox, ins[_FROM_UP], _send(send_t[0], msg, up_patterns))
            if down_patterns:
                inbox = _write(inbox, ins[_FROM_DOWN], _send(send_t[1], msg, down_patterns))
            return (slots, cots, inbox, grads, loss + dloss, stats), None
        return step

    def inflight_zeros(self, prog: Program):
        """(activation slots, inbox) at the start of a run from an empty pipeline: zeros."""
        slots = tuple(_zeros(jax.ShapeDtypeStruct((prog.num_slots, *a.shape), a.dtype), axes=_vma(a))
                      for a in self.slot_avals())
        inbox = _zeros(jax.ShapeDtypeStruct((prog.inbox_size, *self.x0.shape), self.x0.dtype), axes=_vma(self.x0))
        return slots, inbox

    def run(self, prog: Program, inflight=None):
        """Runs every tick of `prog`; returns this rank's (loss, (dW, d first, d last), stats per chunk
        `[v, ...]`) before reduction, and with a steady program also the (slots, inbox) it leaves in flight,
        having started from `inflight` (None: an empty pipeline). With two weight versions, loss and each
        gradient leaf have a leading version dim (stage dW: `[2 * v, ...]`)."""
        f32 = jnp.float32
        slots, inbox = self.inflight_zeros(prog) if inflight is None else inflight
        if inflight is not None:
            slots, inbox = tuple(_cast(a, _vma(z)) for a, z in zip(slots, self.inflight_zeros(prog)[0])), \
                _cast(inbox, _vma(self.inflight_zeros(prog)[1]))
        cots = () if not self.split_w else tuple(
            _zeros(jax.ShapeDtypeStruct((prog.num_slots, *a.shape), a.dtype), axes=_vma(a)) for a in self.cot_avals())
        k = len(self.versions)
        lead = () if k == 1 else (k,)
        grads = () if self.forward_only else (
            jax.tree.map(lambda a: _zeros(jax.ShapeDtypeStruct((k * a.shape[0], *a.shape[1:]), f32), axes=_vma(a)),
                         self.stage_p),
            *(jax.tree.map(lambda a: _zeros(jax.ShapeDtypeStruct(lead + a.shape, f32), axes=_vma(a)), x)
              for x in (self.first_p, self.last_p)))
        stats = jax.tree.map(lambda a: _zeros(jax.ShapeDtypeStruct((self.stage_p_chunks, *a.shape), a.dtype),
                                              axes=_vma(a)), self.stats0)
        carry = (slots, cots, inbox, grads, _zeros(jax.ShapeDtypeStruct(lead, f32), axes=self.loss_axes), stats)
        sends = np.stack([prog.send_patterns("up")[0], prog.send_patterns("down")[0]], axis=1)
        (slots, _, inbox, grads, loss, stats), _ = jax.lax.scan(self.tick(prog), carry,
                                                                (jnp.asarray(prog.code), jnp.asarray(sends)))
        if prog.steady:
            return loss, grads, stats, (slots, inbox)
        return loss, grads, stats

    # --- the reduction --------------------------------------------------------------------------------

    def reduce(self, loss, grads, specs):
        """Sums once, after the loop, the loss and each gradient leaf over the manual axes it is replicated
        over: the batch shards (and model axes such as `seq`) hold partial sums, and only the ranks holding
        stage 0 / the last stage contributed to the first / last grads and the loss. One psum per distinct
        axis set."""
        leaves, tree = jax.tree.flatten((loss, grads))
        axes = [self.loss_axes] + [tuple(a for a in self.manual if a not in _axes_of(s))
                                   for s in jax.tree.leaves(specs)]
        for group in dict.fromkeys(a for a in axes if a):
            idx = [i for i, a in enumerate(axes) if a == group]
            for i, r in zip(idx, jax.lax.psum([leaves[i] for i in idx], group)):
                leaves[i] = r
        return jax.tree.unflatten(tree, leaves)

    def reduce_stats(self, stats):
        """Stats `[v, ...]` per rank -> `[1, v, ...]` summed over the batch axes and the other manual axes
        but `pipe` they vary over (e.g. `seq`)."""
        def one(a):
            axes = tuple(x for x in self.manual if x != "pipe" and x in _vma(a))
            return (jax.lax.psum(a, axes) if axes else a)[None]
        return jax.tree.map(one, stats)
