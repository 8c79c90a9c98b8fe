"""The pipeline executor: runs a schedule table as one `lax.scan` over ticks inside a `jax.shard_map`.

`compile_schedule` (`program.py`) lowers a `Schedule` (numpy, ahead of time) into per-tick, per-rank
instructions (`Op`, `Field`). Every tick each rank `lax.switch`es on its instruction's branch, then the
tick's outputs move to the neighbour ranks (+1 ring "up", -1 ring "down") by one `ppermute` per distinct
set of sending pairs, run only on the ticks that use it (`Program.send_patterns`). What a branch runs on a
chunk is `stage.Stage` (a forward with stored residuals, a fused or split backward); where the arguments
live is `layout.Layout`; what it runs, with which specs and region, one `StageCall`. Three entry points share one run: `pipeline_value_and_grad` (loss and gradients),
`pipeline_loss` (the F actions only: evaluation) and `pipeline_steady_step` (one window of a steady
schedule, 2bw, with two weight versions and the activation slots and inbox carried from call to call).
A weight version is data: each branch is traced with the weights it is given, one set per version.
"""
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from parallax.parallel.tensor import reduction_dtype
from parallax.compat import varying_axes as vma
from parallax.parallel.region import SINGLE, Region, vary
from parallax.pipeline.layout import Layout, to_memory_of, zeros
from parallax.pipeline.program import Field, Op, Program, compile_schedule
from parallax.pipeline.schedule import Schedule
from parallax.pipeline.stage import Stage


@dataclasses.dataclass(frozen=True)
class StageCall:
    """What the executor runs and where: one object for its three entry points.

    The model is `sum_mb last_fn(last, stage_{S-1}(... stage_0(first_fn(first, mb)) ...), mb)`. Give either
    `stage_fn(chunk, x, mb)` (a chunk as a black box) or `layer_fn(layer, x, mb)` (one layer: the executor
    runs a chunk's layers itself, and a split backward (zb_h1, zbv) computes each layer's weight gradient
    once, in W). With `stage_aux` they return `(x, (aux_loss, stats))`: `aux_loss` is added to the loss and
    differentiated, `stats` (per-rank sums, e.g. a router's load) are summed over microbatches, batch shards
    and the other manual axes they vary over but `pipe`.

    last_fn(last, x, mb) -> scalar whose sum over microbatches, batch shards and every other manual axis it
      varies over is the loss (a value complete over an axis, e.g. a vocabulary-parallel cross-entropy, is
      invariant over it and not summed).
    batch_axes: the mesh axes microbatch rows are split over (those of size > 1 are manual).
    param_specs: optional {'first', 'stages', 'last'} trees of PartitionSpecs (for 'stages' the dims after
      `[p, v]`): the functions run on these shards, with collectives of their own. A spec may name a batch
      axis (FSDP): the function all-gathers the weight where it uses it and the gather's transpose
      reduce-scatters its gradient, so the accumulator stays sharded.
    input_spec: the dims of each input after `[m, rows]`, e.g. `P('seq')`.
    routed_inputs: {key: 'first' | 'last'} for inputs only first_fn or only last_fn reads: split over `pipe`
      along dim 2 as well, gathered on the rank that reads them (`Layout.gather`).
    remat: store each chunk's input only and recompute its forward.
    region (`parallax.parallel.region.Region`): with copies (DiLoCo), R independent pipelines over the copy
      axis: every params leaf has a leading [R] dim split over it, the input rows are split over it first,
      and every result gains a leading [R] dim: copy r's, from its own weights and rows; nothing is summed
      over it. With `pipe` in its `vocab_axes`, last_fn runs on every pipe rank, on its own shard of the
      `last` weights (their specs name `pipe`, e.g. the head split along the vocabulary), as a pass outside
      the per-rank switch in the tick of each microbatch's last-stage forward (`_Ticks.head_pass`): the last
      stage's output is broadcast over `pipe`, last_fn may use collectives over `pipe` and returns the same
      loss on every rank, and the input cotangent (summed over `pipe` by the transpose) goes to the last
      stage's B. Likewise first_fn runs on every rank on its `first` shard and returns that rank's share of
      the embedding, summed over `pipe` before the tick of stage 0's forward (`_Ticks.embed_pass`); stage 0's
      input cotangent is broadcast after its backward and each rank takes its shard's gradient.
    """
    first_fn: Callable
    last_fn: Callable
    mesh: object
    stage_fn: Callable | None = None
    layer_fn: Callable | None = None
    batch_axes: tuple = ("data", "fsdp")
    param_specs: dict | None = None
    input_spec: P = P()
    stage_aux: bool = False
    routed_inputs: dict | None = None
    remat: bool = False
    region: Region = SINGLE

    @property
    def spreads_vocab(self) -> bool:
        """The embedding and head run on every pipe rank, on their vocabulary shards (`region.vocab_axes`)."""
        return "pipe" in self.region.vocab_axes

    def layout(self, schedule, params, inputs, microbatches=None) -> Layout:
        return Layout.make(schedule, params, inputs, self.mesh, self.batch_axes, self.param_specs, self.input_spec,
                           microbatches=microbatches, routed_inputs=self.routed_inputs, region=self.region)


def pipeline_value_and_grad(schedule: Schedule, call: StageCall, params, inputs):
    """Loss and gradients of a pipelined model (`call`, a `StageCall`), running `schedule` over the mesh
    axis `pipe`.

    params: {'first': used by stage 0's rank, 'stages': leaves `[p, v, ...]` (`layout.to_pipeline_layout`,
      dim 0 sharded over `pipe`), 'last'}. inputs: arrays `[m, rows, ...]`, rows split over the call's
      `batch_axes` of size > 1, the next dims as its `input_spec` says.

    Returns (loss, grads[, stats]): grads in the structure and layout of `params`, fp32, equal to
    `jax.value_and_grad` of the unpipelined model; stats leaves `[p, v, ...]`. Every weight is cast to
    varying over the manual axes before any vjp (no transpose inserts a collective in the loop); each
    gradient leaf is summed once, after the loop. Collectives inside the functions run in per-rank switch
    branches, so they must stay within one pipeline rank: those with replica groups (psum, all-gather,
    all-to-all over the model axes) do; a `ppermute` does not (XLA:CPU pairs permutes of different branches).
    """
    if schedule.steady:
        raise ValueError(f"{schedule.name} is a steady schedule: run it with pipeline_steady_step")
    layout, region = call.layout(schedule, params, inputs), call.region

    def finish(ticks, loss, grads, stats, _):
        gw, gf, gl = grads
        loss, grads = layout.reduce(loss, {"first": gf, "stages": jax.tree.map(lambda a: a[None], gw), "last": gl},
                                    layout.specs, ticks.loss_axes)
        return region.tagged((loss, grads, layout.reduce_stats(stats)) if call.stage_aux else (loss, grads))
    # Stats leaves are [1, v, ...] per rank, split over `pipe` (P("pipe") is a prefix spec for all of them).
    out_specs = (region.param_spec(P()), layout.specs, region.param_spec(P("pipe")))[:3 if call.stage_aux else 2]
    # A schedule's paired actions (dualpipev) run in one branch; with the vocabulary over the pipe ranks, whose
    # head and embedding passes follow one action per tick, one after the other.
    return _run(layout, compile_schedule(schedule, serialize=call.spreads_vocab), call, (params,), inputs, finish,
                out_specs, remat=call.remat, stage_aux=call.stage_aux, split_w=True)


def pipeline_loss(schedule: Schedule, call: StageCall, params, inputs):
    """The loss of `pipeline_value_and_grad` alone (evaluation): the same shard_map and layout, running
    only the schedule's F actions (`compile_schedule(..., forward_only=True)`); nothing is stored for a
    backward and no gradient is accumulated. Stages' aux losses are not included (last_fn's loss alone).
    With copies (`call.region`), each copy's loss [R]."""
    layout, region = call.layout(schedule, params, inputs), call.region
    return _run(layout, compile_schedule(schedule, forward_only=True), call, (params,), inputs,
                lambda ticks, loss, *_: region.tagged(layout.reduce(loss, {}, {}, ticks.loss_axes)[0]),
                region.param_spec(P()), forward_only=True, stage_aux=call.stage_aux)


def pipeline_steady_step(schedule: Schedule, call: StageCall, params, previous, inputs, inflight=None):
    """One step of a steady schedule (`2bw`): one window of an endless pipeline, with no flush.

    The window runs the current step's forwards with `params` and finishes the previous step's
    microbatches in flight with `previous` (the weights their forwards used: PipeDream-2BW's second weight
    version). `inputs` hold 2m microbatches `[2m, rows, ...]`: the previous step's m, then the current
    step's. `inflight`: what the previous window left in flight (None: an empty pipeline; the previous
    step's microbatches then run on zeros). `call` as for `pipeline_value_and_grad` (no stage aux, no copies).

    Returns `((loss, grads) of the previous step's part run in this window, (loss, grads) of the current
    step's part, inflight)`: a step's loss and gradient are the sum of its parts in two windows.
    `inflight`: this rank's activation slots and inbox, leaves `[devices, ...]` with the leading dim split
    over the shard_map's manual axes (`layout.manual_axes`); opaque: hand them to the next call."""
    if not schedule.steady:
        raise ValueError(f"{schedule.name} flushes every step: run it with pipeline_value_and_grad")
    if call.region.copied:
        raise ValueError(f"{schedule.name} runs without copies: a window carries the previous step's microbatches")
    m = schedule.num_microbatches
    layout = call.layout(schedule, params, inputs, microbatches=2 * m)
    call.layout(schedule, previous, inputs, microbatches=2 * m)
    spec = P(layout.manual)

    def finish(ticks, loss, grads, _, inflight):
        gw, gf, gl = grads
        v = ticks.num_chunks
        parts = tuple({"first": jax.tree.map(lambda a: a[k], gf), "last": jax.tree.map(lambda a: a[k], gl),
                       "stages": jax.tree.map(lambda a: a[None, k * v:(k + 1) * v], gw)} for k in range(2))
        loss, parts = layout.reduce(loss, parts, (layout.specs, layout.specs), ticks.loss_axes)
        inflight = jax.tree.map(lambda a: vary(a, layout.manual)[None], inflight)
        return (loss[0], parts[0]), (loss[1], parts[1]), inflight
    return _run(layout, compile_schedule(schedule), call, (previous, params), inputs, finish,
                ((P(), layout.specs), (P(), layout.specs), spec), inflight=inflight, inflight_spec=spec,
                remat=call.remat)


def _run(layout, prog, call, weights, inputs, finish, out_specs, inflight=None, inflight_spec=P(), **options):
    """Runs `prog` in `layout`'s shard_map with the weight versions `weights` (oldest first) and returns
    `finish(ticks, loss, grads, stats, inflight)` of this rank's results. `call`: the `StageCall`, with
    exactly one of stage_fn / layer_fn given."""
    first_fn, stage_fn, layer_fn, last_fn = call.first_fn, call.stage_fn, call.layer_fn, call.last_fn
    if (stage_fn is None) == (layer_fn is None):
        raise TypeError("give the executor exactly one of stage_fn (a chunk) and layer_fn (one layer)")
    fns, k = (first_fn, stage_fn or layer_fn, last_fn), len(weights)
    options["layered"] = layer_fn is not None
    options["active"] = layout.active
    options["spread_vocab"] = call.spreads_vocab
    # The devices' platform (for `reduction_dtype`); an abstract mesh (shape checks) has none: the host's.
    options["platform"] = layout.mesh.devices.flat[0].platform if isinstance(layout.mesh, jax.sharding.Mesh) else None

    def body(*args):
        versions = [dict(zip(("first", "stages", "last"), layout.region.own(args[3 * i:3 * i + 3]))) for i in range(k)]
        inputs, carried = args[3 * k], args[3 * k + 1]
        ticks = _Ticks(fns, layout.manual, versions, layout.gather(inputs), batch=layout.batch, **options)
        if carried is not None:
            carried = jax.tree.map(lambda a: a[0], carried)
        return finish(ticks, *ticks.run(prog, carried))
    return layout.call(body, weights, inputs, out_specs, extra=(inflight,), extra_specs=(inflight_spec,))


def _write(buf, i, value):
    """buf[i] = value where i >= 0; in place, outside any switch branch."""
    j = jnp.maximum(i, 0)
    old = jax.lax.dynamic_index_in_dim(buf, j, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(i >= 0, value, old), j, 0)


def _send(pattern, msg, patterns):
    """`ppermute(msg, "pipe", patterns[pattern - 1])`, or zeros (nothing moves) for pattern 0. The pattern
    comes from a table every device holds whole, so all devices take the same branch: each permute is one
    collective that every device joins (permutes in per-rank branches would be paired wrongly)."""
    branches = [zeros] + [lambda m, perm=perm: jax.lax.ppermute(m, "pipe", perm) for perm in patterns]
    return jax.lax.switch(pattern, branches, msg)


def _add_chunk(acc, c, d):
    def one(a, b):
        cur = jax.lax.dynamic_index_in_dim(a, c, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(a, cur + b, c, 0)
    return jax.tree.map(one, acc, d)


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


class _Ticks:
    """The tick interpreter as traced on one rank inside the shard_map: the switch branches (one per kind of
    action and weight version), the tick (one scan step) and the run; `Layout.reduce` then sums the
    results over the manual axes. `versions`: the weights `{first, stages, last}` of each version
    (stages `[1, v, ...]` on this rank), oldest first; one for a flushing schedule."""

    def __init__(self, fns, manual, versions, inputs, *, remat=False, forward_only=False, stage_aux=False,
                 batch=(), layered=False, split_w=False, active=None, spread_vocab=False, platform=None):
        self.first_fn, layer_fn, self.last_fn = fns
        self.spread_vocab, self.platform = spread_vocab, platform
        self.active = active  # bool [p, v, Lc] numpy: an uneven layout's real layer slots (`active_layers`)
        self.manual, self.forward_only = manual, forward_only
        # Every weight varies over every manual axis, so that no vjp transpose inserts a psum.
        varying = functools.partial(jax.tree.map, lambda a: vary(a, manual))
        self.versions = tuple((varying(w["first"]), varying(jax.tree.map(lambda a: a[0], w["stages"])),
                               varying(w["last"])) for w in versions)  # stages: [v, ...]
        first, stages, last = self.versions[-1]
        self.num_chunks = jax.tree.leaves(stages)[0].shape[0]
        # Inputs vary over `pipe` too (so that whatever the stages derive from them counts as per-microbatch,
        # see `Stage.probe`) but stay invariant over the model axes: they are the same on those ranks, which
        # keeps, e.g., a vocabulary-parallel loss invariant over `tensor`.
        self.inputs = jax.tree.map(lambda a: vary(a, ("pipe",)), inputs)
        mb0 = _index(self.inputs, 0)
        self.x0 = self.first_fn(first, mb0)
        # Stats are this rank's sums over its rows: typed varying over `pipe` and the batch axes, so that the
        # reduction sums them over the batch shards whatever their type (a per-rank constant included).
        self.stage = Stage(layer_fn, _index(stages, 0), self.x0, mb0, layered=layered, stage_aux=stage_aux,
                           remat=remat, forward_only=forward_only, split_w=split_w, stats_axes=("pipe", *batch))
        # The loss is summed over `pipe` and the manual axes last_fn's value (and, in training, the stages'
        # aux losses) vary over.
        loss_vma = vma(self.last_fn(last, self.x0, mb0)) | ({"pipe"} if spread_vocab else set())
        if self.stage.term0 is not None:
            loss_vma = loss_vma | vma(self.stage.term0)
        self.loss_axes = tuple(a for a in manual if a == "pipe" or a in loss_vma)

    def out(self, msg=None, res=None, dw=None, dfirst=None, dlast=None, loss=None, stats=None, cots=None):
        """What one tick produced: (message to send (an activation or an input cotangent, shaped like x),
        what to store in the activation slot, per-layer cotangents to store (split W), (dW of the chunk,
        d first, d last) in fp32, loss, the chunk's stats), zeros where it produced nothing. The carry is
        updated outside the switch, so that XLA updates the buffers in place instead of copying them
        through the conditional."""
        f32, stage = jnp.float32, self.stage
        first, stages, last = self.versions[-1]

        def f32_or_zeros(grad, like):
            return jax.tree.map(lambda a: zeros(a, f32), like) if grad is None else \
                jax.tree.map(lambda g: g.astype(f32), grad)
        grads = () if self.forward_only else (
            f32_or_zeros(dw, _index(stages, 0)), f32_or_zeros(dfirst, first), f32_or_zeros(dlast, last))
        cot = () if not stage.split_w else tuple(map(zeros, stage.cot_avals())) if cots is None else cots
        return (zeros(self.x0) if msg is None else msg.astype(self.x0.dtype),
                tuple(zeros(a) for a in stage.slot_avals()) if res is None else res, cot, grads,
                zeros(jax.ShapeDtypeStruct((), f32), axes=self.loss_axes) if loss is None else
                vary(loss.astype(f32), self.loss_axes),
                jax.tree.map(zeros, stage.stats0) if stats is None else stats)

    def active_of(self, ins):
        """This rank's flags of the layer slots of the instruction's chunk, or None (an even layout)."""
        if self.active is None:
            return None
        return jnp.asarray(self.active)[jax.lax.axis_index("pipe"), ins[Field.CHUNK]]

    def branches(self, prog: Program):
        """The switch branches, each `(slots, cots, inbox, instruction) -> out(...)`: index
        `instruction[BRANCH] + len(prog.branches) * instruction[VERSION]`, every branch `prog` uses traced
        once per weight version with that version's weights."""
        stage = self.stage

        def idle(w, slots, cots, inbox, ins):
            return self.out()

        def fwd_in(w, inbox, ins, first):  # -> (microbatch inputs, chunk input)
            mb = _index(self.inputs, ins[Field.MB])
            if first:  # with the vocabulary over the pipe ranks, the embedding pass's sum, computed before the switch (`tick`)
                return mb, self.embedded if self.spread_vocab else self.first_fn(w[0], mb)
            return mb, inbox[ins[Field.IN]]

        def fwd_out(w, mb, y, res, term, stats, last):
            if not last or self.spread_vocab:  # with the vocabulary over the pipe ranks the head runs after the switch (`head_pass`)
                return self.out(msg=y, res=res, loss=term, stats=stats or None)
            last_p = w[2]
            if self.forward_only:
                return self.out(loss=self.last_fn(last_p, y, mb))
            l, pb = jax.vjp(lambda lp, y: self.last_fn(lp, y, mb), last_p, y)
            dlast, dy = pb(jnp.ones_like(l))
            if term is not None:
                l = vary(l.astype(jnp.float32), self.loss_axes) + vary(term, self.loss_axes)
            return self.out(msg=dy, res=res, dlast=dlast, loss=l, stats=stats or None)

        def fwd(w, slots, cots, inbox, ins, first=False, last=False):
            mb, x = fwd_in(w, inbox, ins, first)
            y, res, term, stats = stage.forward(_index(w[1], ins[Field.CHUNK]), x, mb, self.active_of(ins))
            return fwd_out(w, mb, y, res, term, stats, last)

        def bwd_out(w, mb, dx, dw, keep, need_dx, first):
            if need_dx and first and self.spread_vocab:  # the embedding's backward runs after the switch
                return self.out(msg=dx, dw=dw, cots=keep)
            if need_dx and first:
                return self.out(dw=dw, cots=keep, dfirst=jax.vjp(lambda fp: self.first_fn(fp, mb), w[0])[1](dx)[0])
            return self.out(msg=dx, dw=dw, cots=keep)

        def bwd(w, slots, cots, inbox, ins, need_dx, need_dw, first=False):
            mb = _index(self.inputs, ins[Field.MB])
            stored = tuple(c[ins[Field.SLOT]] for c in cots) if stage.split_w and not need_dx else None
            dx, dw, keep = stage.backward(_index(w[1], ins[Field.CHUNK]), ins[Field.SLOT], mb, slots,
                                          inbox[ins[Field.IN]], stored, need_dx, need_dw, self.active_of(ins))
            return bwd_out(w, mb, dx, dw, keep, need_dx, first)

        def fwd_bwd(w, slots, cots, inbox, ins, ins1, first=False, last=False, first1=False):
            """A forward (`ins`) and a fused backward (`ins1`) of other microbatches, overlapped in one scan
            over their chunks' layers (`Stage.forward_backward`)."""
            mb, x = fwd_in(w, inbox, ins, first)
            mb1 = _index(self.inputs, ins1[Field.MB])
            (y, res, term, stats), (dx, dw) = stage.forward_backward(
                _index(w[1], ins[Field.CHUNK]), x, mb, _index(w[1], ins1[Field.CHUNK]), ins1[Field.SLOT], mb1, slots,
                inbox[ins1[Field.IN]])
            return fwd_out(w, mb, y, res, term, stats, last), bwd_out(w, mb1, dx, dw, None, True, first1)
        self.fwd_bwd = {(f, b): functools.partial(fwd_bwd, first=f == Op.F_FIRST, last=f == Op.F_LAST,
                                                  first1=b == Op.BW_FIRST)
                        for f in (Op.F, Op.F_FIRST, Op.F_LAST) for b in (Op.BW, Op.BW_FIRST)}

        impls = {Op.IDLE: idle, Op.F: fwd, Op.F_FIRST: functools.partial(fwd, first=True),
                 Op.F_LAST: functools.partial(fwd, last=True),
                 Op.B: functools.partial(bwd, need_dx=True, need_dw=False),
                 Op.B_FIRST: functools.partial(bwd, need_dx=True, need_dw=False, first=True),
                 Op.W: functools.partial(bwd, need_dx=False, need_dw=True),
                 Op.BW: functools.partial(bwd, need_dx=True, need_dw=True),
                 Op.BW_FIRST: functools.partial(bwd, need_dx=True, need_dw=True, first=True)}
        return [functools.partial(impls[b], w) for w in self.versions for b in prog.branches]

    def head_pass(self, mb_index, last_rank, msg, inbox, ins, loss, glast):
        """The vocabulary-parallel head (`spread_vocab`) of microbatch `mb_index` on every pipe rank, in the
        tick of its last-stage forward: the last stage's output `msg` broadcast from `last_rank` (a psum of
        zeros elsewhere), last_fn on this rank's `last` shard (its collectives over `pipe` give every rank the
        loss), and, training, the vjp: this rank's `last` gradient accumulated, and the output cotangent,
        summed over `pipe` by the transpose of the broadcast value's use, written where the last stage's B
        reads it (its LOCAL inbox entry). Outside the switch: every rank takes the same branch."""
        rank = jax.lax.axis_index("pipe")
        _, _, last = self.versions[-1]
        # Both sums over `pipe` (the broadcast, and its transpose: the cotangent) run in `reduction_dtype`
        # (fp32 for bf16 on XLA:CPU, whose bf16 all-reduce aborts the compile; the input dtype elsewhere).
        wide = reduction_dtype(msg.dtype, self.platform)
        h = jax.lax.psum(jnp.where(rank == last_rank, msg, jnp.zeros((), msg.dtype)).astype(wide), "pipe")
        mb = _index(self.inputs, mb_index)
        on_last = rank == last_rank  # the loss counts once, summed over `pipe` by the reduction

        def head(lp, h):  # h made varying over `pipe` before the cast, so that its transpose sums in `wide`
            return self.last_fn(lp, vary(h, ("pipe",)).astype(msg.dtype), mb)
        if self.forward_only:
            l = head(last, h).astype(jnp.float32)
            return inbox, loss + vary(jnp.where(on_last, l, 0.0), self.loss_axes), glast
        l, pb = jax.vjp(head, last, h)
        # The loss is the same on every rank; typed varying over `pipe` (the inputs are), a cotangent of 1 on
        # each rank would count it p times, so it is seeded on one rank.
        seed = vary(jnp.where(on_last, 1.0, 0.0).astype(l.dtype), tuple(vma(l))) if "pipe" in vma(l) else \
            jnp.ones_like(l)
        dlast, dh = pb(seed)
        inbox = _write(inbox, jnp.where(on_last, ins[Field.LOCAL], -1), dh.astype(inbox.dtype))
        glast = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), glast, dlast)
        return inbox, loss + vary(jnp.where(on_last, l.astype(jnp.float32), 0.0), self.loss_axes), glast

    def embed_pass(self, mb_index):
        """The vocabulary-parallel embedding of microbatch `mb_index` (`spread_vocab`), before the tick of
        its stage-0 forward: every rank's share (first_fn on its `first` shard), summed over `pipe` in
        `reduction_dtype`. Outside the switch: every rank takes the same branch."""
        first, _, _ = self.versions[-1]
        part = self.first_fn(first, _index(self.inputs, mb_index))
        wide = reduction_dtype(part.dtype, self.platform)
        return vary(jax.lax.psum(part.astype(wide), "pipe").astype(self.x0.dtype), tuple(vma(self.x0)))

    def embed_grad(self, mb_index, first_rank, msg, gfirst):
        """After the tick of stage 0's backward of microbatch `mb_index`: its input cotangent (`msg` on
        `first_rank`) broadcast over `pipe`, and each rank's `first` shard's gradient accumulated."""
        rank = jax.lax.axis_index("pipe")
        first, _, _ = self.versions[-1]
        wide = reduction_dtype(msg.dtype, self.platform)
        dx = jax.lax.psum(jnp.where(rank == first_rank, msg, jnp.zeros((), msg.dtype)).astype(wide), "pipe")
        part, pb = jax.vjp(lambda fp: self.first_fn(fp, _index(self.inputs, mb_index)), first)
        dfirst = pb(vary(dx.astype(part.dtype), tuple(vma(part))))[0]
        return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), gfirst, dfirst)

    def tick(self, prog: Program):
        """One scan step: every rank switches on its own instruction, then the messages move.

        Cost per tick: every branch returns every output, so an action that computes no weight gradient
        writes fp32 zeros the size of its chunk's weights, which are then added into the accumulator (and
        likewise an empty slot). Running each kind of action as a `while` loop of 0 or 1 trips instead
        removes those copies (XLA updates a loop's carry in place) but made the step 2.7x (d_model 128) to
        3x (d_model 512) slower on XLA:CPU (`launch/bench.py` Llama, p = 4, m = 8; tried 2026-12), so the
        switch stays; worth measuring again on GPU / TPU."""
        branches, rank = self.branches(prog), jax.lax.axis_index("pipe")
        stores = jnp.asarray(np.isin(np.array(prog.branches), (Op.F, Op.F_FIRST, Op.F_LAST)))
        stores_cots = jnp.asarray(np.isin(np.array(prog.branches), (Op.B, Op.B_FIRST)))
        up_patterns, down_patterns = prog.send_patterns("up")[1], prog.send_patterns("down")[1]
        versions, v = len(self.versions), self.num_chunks

        ops = self.ops(prog)
        last_rank = int(np.argwhere(ops == Op.F_LAST)[0][1]) if self.spread_vocab else -1
        first_rank = int(np.argwhere(ops == Op.F_FIRST)[0][1]) if self.spread_vocab else -1

        def step(carry, xs):  # code_t: [p, fields]; send_t: this tick's send pattern up and down (0: none);
            # head_t / embed_t / dembed_t: the microbatch of this tick's last-stage forward, stage-0 forward,
            code_t, send_t, head_t, embed_t, dembed_t = xs  # stage-0 backward (-1: none)
            slots, cots, inbox, grads, loss, stats = carry
            ins = code_t[rank]
            if self.spread_vocab:  # read by stage 0's forward branch (`branches`): a value of this trace
                self.embedded = jax.lax.cond(embed_t >= 0, self.embed_pass, lambda _: zeros(self.x0), embed_t)
            version = ins[Field.VERSION]
            branch = ins[Field.BRANCH] + len(prog.branches) * version
            msg, res, cot, dgrads, dloss, dstats = jax.lax.switch(branch, branches, slots, cots, inbox, ins)
            stats = _add_chunk(stats, ins[Field.CHUNK], dstats)
            slots = tuple(_write(buf, jnp.where(stores[ins[Field.BRANCH]], ins[Field.SLOT], -1), r)
                          for buf, r in zip(slots, res))
            cots = tuple(_write(buf, jnp.where(stores_cots[ins[Field.BRANCH]], ins[Field.SLOT], -1), c)
                         for buf, c in zip(cots, cot))
            if grads:  # one accumulator per version: gw [versions * v, ...]; gf / gl [versions, ...] if > 1
                (gw, gf, gl), (dw, df, dl) = grads, dgrads
                gw = _add_chunk(gw, version * v + ins[Field.CHUNK], dw)
                if versions > 1:
                    gf, gl = _add_chunk(gf, version, df), _add_chunk(gl, version, dl)
                    dloss = jnp.where(jnp.arange(versions) == version, dloss, jnp.zeros((), dloss.dtype))
                else:
                    gf, gl = jax.tree.map(jnp.add, gf, df), jax.tree.map(jnp.add, gl, dl)
                grads = (gw, gf, gl)
            inbox = _write(inbox, ins[Field.LOCAL], msg)
            if self.spread_vocab:  # xs carries the microbatch of this tick's last-stage forward (-1: none)
                # Only the head's / embedding's accumulators pass through the conds (the stage gradients,
                # the big ones, would be copied through a conditional).
                def head(inbox, loss, glast):
                    return self.head_pass(head_t, last_rank, msg, inbox, ins, loss, glast)
                gw, gf, gl = grads if grads else ((), (), ())
                inbox, loss, gl = jax.lax.cond(head_t >= 0, head, lambda *a: a, inbox, loss, gl)
                if grads:
                    gf = jax.lax.cond(dembed_t >= 0, lambda g: self.embed_grad(dembed_t, first_rank, msg, g),
                                      lambda g: g, gf)
                    grads = (gw, gf, gl)
            if up_patterns:
                inbox = _write(inbox, ins[Field.FROM_UP], _send(send_t[0], msg, up_patterns))
            if down_patterns:
                inbox = _write(inbox, ins[Field.FROM_DOWN], _send(send_t[1], msg, down_patterns))
            return (slots, cots, inbox, grads, loss + dloss, stats), None
        return step

    def paired_tick(self, prog: Program):
        """One scan step of a program with paired actions (`Program.pair_code`, dualpipev): lane 0 holds the
        forwards, lane 1 the backwards. Every rank switches once, on the pair of its two instructions, and
        the branch of a pair runs both actions: no data passes between them, so within that one
        computation the compiler may run one's collectives while the other computes. The branch returns
        one of each result (the forward's activation and loss, the backward's cotangents and weight
        gradients), so the carry is written once per tick, as `tick` does; each lane's message moves by its
        own permutes."""
        branches, rank = self.branches(prog), jax.lax.axis_index("pipe")
        stores = jnp.asarray(np.isin(np.array(prog.branches), (Op.F, Op.F_FIRST, Op.F_LAST)))
        stores_cots = jnp.asarray(np.isin(np.array(prog.branches), (Op.B, Op.B_FIRST)))
        patterns = [(prog.send_patterns("up", k)[1], prog.send_patterns("down", k)[1]) for k in (0, 1)]
        combos = prog.pair_branches()[1]
        # A forward beside a fused backward runs as one scan over the layers when the chunks are layers
        # with stored residuals and of equal counts (an even layout); otherwise one after the other.
        fused = self.stage.can_overlap() and self.active is None
        w = self.versions[-1]

        def both(a, b):
            pair = (prog.branches[a], prog.branches[b])

            def run(slots, cots, inbox, ins0, ins1):
                if fused and pair in self.fwd_bwd:
                    out0, out1 = self.fwd_bwd[pair](w, slots, cots, inbox, ins0, ins1)
                else:
                    out0, out1 = branches[a](slots, cots, inbox, ins0), branches[b](slots, cots, inbox, ins1)
                (msg0, res, _, g0, loss0, stats0), (msg1, _, cot, g1, loss1, stats1) = out0, out1
                grads = (g1[0], g1[1], g0[2]) if g1 else ()  # dW and d first from the backward, d last: F_LAST
                return (msg0, msg1), res, cot, grads, loss0 + loss1, (stats0, stats1)
            return run
        combo_fns = [both(a, b) for a, b in combos]

        def step(carry, xs):  # code_t / pair_t: [p, fields] of each lane; combo_t [p]; send_t [lane, up / down]
            code_t, pair_t, combo_t, send_t = xs
            slots, cots, inbox, grads, loss, stats = carry
            ins0, ins1 = code_t[rank], pair_t[rank]
            msgs, res, cot, dgrads, dloss, dstats = jax.lax.switch(combo_t[rank], combo_fns, slots, cots, inbox,
                                                                   ins0, ins1)
            stats = _add_chunk(_add_chunk(stats, ins0[Field.CHUNK], dstats[0]), ins1[Field.CHUNK], dstats[1])
            slots = tuple(_write(buf, jnp.where(stores[ins0[Field.BRANCH]], ins0[Field.SLOT], -1), r)
                          for buf, r in zip(slots, res))
            cots = tuple(_write(buf, jnp.where(stores_cots[ins1[Field.BRANCH]], ins1[Field.SLOT], -1), c)
                         for buf, c in zip(cots, cot))
            if grads:
                (gw, gf, gl), (dw, df, dl) = grads, dgrads
                grads = (_add_chunk(gw, ins1[Field.CHUNK], dw), jax.tree.map(jnp.add, gf, df),
                         jax.tree.map(jnp.add, gl, dl))
            for ins, msg in zip((ins0, ins1), msgs):
                inbox = _write(inbox, ins[Field.LOCAL], msg)
            for k, (ins, msg) in enumerate(zip((ins0, ins1), msgs)):
                up, down = patterns[k]
                if up:
                    inbox = _write(inbox, ins[Field.FROM_UP], _send(send_t[k, 0], msg, up))
                if down:
                    inbox = _write(inbox, ins[Field.FROM_DOWN], _send(send_t[k, 1], msg, down))
            return (slots, cots, inbox, grads, loss + dloss, stats), None
        return step

    @staticmethod
    def ops(prog: Program) -> np.ndarray:
        """int [ticks, p]: the `Op` of each rank's instruction."""
        return np.asarray(prog.branches)[prog.code[..., Field.BRANCH]]

    def op_ticks(self, prog: Program, ops) -> np.ndarray:
        """int [ticks]: the microbatch of the instruction of kind in `ops` at each tick (one rank's), or -1."""
        hit = np.isin(self.ops(prog), ops)  # [ticks, p]
        return np.where(hit.any(axis=1), (prog.code[..., Field.MB] * hit).sum(axis=1), -1)

    def run(self, prog: Program, inflight=None):
        """Runs every tick of `prog`; returns this rank's (loss, (dW, d first, d last), stats per chunk
        `[v, ...]`, (slots, inbox) left in flight) before reduction, having started from `inflight` (None:
        an empty pipeline). With two weight versions, loss and each gradient leaf have a leading version dim
        (stage dW: `[2 * v, ...]`)."""
        f32, stage = jnp.float32, self.stage

        def buffer(a, n):
            return to_memory_of(a, zeros(jax.ShapeDtypeStruct((n, *a.shape), a.dtype), axes=vma(a)))
        slots = tuple(buffer(a, prog.num_slots) for a in stage.slot_avals())
        inbox = buffer(self.x0, prog.inbox_size)
        if inflight is not None:  # typed as the empty pipeline's buffers
            slots = tuple(vary(a, vma(z)) for a, z in zip(inflight[0], slots))
            inbox = vary(inflight[1], vma(inbox))
        cots = tuple(buffer(a, prog.num_slots) for a in stage.cot_avals()) if stage.split_w else ()
        k = len(self.versions)
        lead = () if k == 1 else (k,)
        first, stages, last = self.versions[-1]
        grads = () if self.forward_only else (
            jax.tree.map(lambda a: zeros(jax.ShapeDtypeStruct((k * a.shape[0], *a.shape[1:]), f32), axes=vma(a)),
                         stages),
            *(jax.tree.map(lambda a: zeros(jax.ShapeDtypeStruct(lead + a.shape, f32), axes=vma(a)), x)
              for x in (first, last)))
        stats = jax.tree.map(lambda a: buffer(a, self.num_chunks), stage.stats0)
        carry = (slots, cots, inbox, grads, zeros(jax.ShapeDtypeStruct(lead, f32), axes=self.loss_axes), stats)
        if prog.pair_code is not None:
            sends = np.stack([np.stack([prog.send_patterns(d, k)[0] for d in ("up", "down")], axis=1)
                              for k in (0, 1)], axis=1)  # [ticks, lane, direction]
            (slots, _, inbox, grads, loss, stats), _ = jax.lax.scan(
                self.paired_tick(prog), carry, (jnp.asarray(prog.code), jnp.asarray(prog.pair_code),
                                                jnp.asarray(prog.pair_branches()[0]), jnp.asarray(sends)))
            return loss, grads, stats, (slots, inbox)
        sends = np.stack([prog.send_patterns("up")[0], prog.send_patterns("down")[0]], axis=1)
        (slots, _, inbox, grads, loss, stats), _ = jax.lax.scan(
            self.tick(prog), carry, (jnp.asarray(prog.code), jnp.asarray(sends),
                                     *(jnp.asarray(self.op_ticks(prog, ops)) for ops in
                                       ((Op.F_LAST,), (Op.F_FIRST,), (Op.B_FIRST, Op.BW_FIRST)))))
        return loss, grads, stats, (slots, inbox)
