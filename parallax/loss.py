"""The three loss paths behind one object: dense (compiler-sharded), manual (tensor / sequence parallel
in one shard_map), and pipelined (the schedule executor). Training and eval take the same path.

`LossPath(plan, mesh)` gives the weighted loss *sum* of a batch (`sum`, forward only: eval) and the sum
with its gradients (`sum_and_grads`: training). The caller divides by the weight total. Layers with aux
values (`parallax.model`, e.g. MoE): training differentiates the loss plus their aux losses and returns
the global aux sums for metrics; eval reports the model's loss alone.

- dense: `tensor == seq == pipe == 1` (and `expert == 1` for a model declaring it). The model's plain
  code under `activation_sharding`; GSPMD shards it over the data / FSDP axes from the parameters' and
  activations' logical names.
- manual: `tensor > 1`, `seq > 1` or (a model declaring it) `expert > 1`, without a pipeline. The model
  runs per rank inside `parallax.parallel.manual.shard_loss` and adds its collectives through
  `plan.parallelism`.
- pipelined: `pipe > 1`. The first stage gets the parameters outside `blocks` that `embed` reads, the
  last stage those that `loss` reads (found by tracing each once: a tied embedding is in both); the
  stacked blocks go to the executor in its [p, v, L/(p*v), ...] layout. Layers with aux values add their
  aux loss to the loss in each chunk's forward, and their stats come back per stage. Eval runs
  the executor's F ticks only (`pipeline_loss`), so it works on every mesh training works on.

The steady schedule `2bw` has no flush, so one batch's loss and gradients span two steps: the trainer
calls `steady_step` (the executor's `pipeline_steady_step`), while `sum` and `sum_and_grads` run the 1F1B
schedule of the same shape (an evaluation, a synchronous gradient for the tools).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax import model as model_lib
from parallax import sharding
from parallax.parallel import sequence
from parallax.parallel.manual import DENSE, MODEL_AXES, shard_loss
from parallax.plan import abstract_batch
from parallax.pipeline import executor
from parallax.pipeline.schedule import make_schedule


class LossPath:
    """The weighted loss sum (and its gradients) of a batch on `mesh`, by the path `plan` needs."""

    def __init__(self, plan, mesh):
        self.plan, self.mesh = plan, mesh
        self.schedule = plan.schedule  # what `sum` and `sum_and_grads` run: a flushing schedule
        if plan.schedule is not None and plan.schedule.steady:
            self.schedule = make_schedule("1f1b", plan.schedule.num_ranks, plan.schedule.num_microbatches)
        if plan.schedule is not None:
            self.kind = "pipelined"
        elif plan.parallelism.manual:
            self.kind = "manual"
        else:
            self.kind = "dense"

    def sum(self, params, batch):
        """Weighted loss sum over the global batch (forward only), without the layers' aux losses."""
        if self.kind == "pipelined":
            return executor.pipeline_loss(self.schedule, **self._pipeline_args(params, batch))
        return self._unpipelined_terms(params, batch)[0]

    def sum_and_grads(self, params, batch):
        """(weighted loss sum, gradients, aux) over the global batch; pipelined gradients are fp32.

        The sum and gradients include the layers' aux losses; `aux` is the global aux sums (stacked over
        layers; {} for layers without aux values)."""
        if self.kind == "pipelined":
            return self._pipeline_sum_and_grads(params, batch)

        def objective(p, b):
            lm, aux = self._unpipelined_terms(p, b)
            return lm + model_lib.aux_loss(aux), aux
        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, batch)
        return loss, grads, jax.lax.stop_gradient(aux)

    def split_microbatches(self, batch, m: int):
        """(B, T) arrays -> (M, B/M, T); microbatch i takes rows i, i+M, ... so each batch shard stays local.
        Routed inputs (`routed_inputs`) keep their split over `pipe` along T."""
        spec = sharding.logical_to_spec((None, "batch", "length"), self.plan.rules, self.mesh)
        routed = self.routed_inputs()

        def split(key, x):
            x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
            s = P(None, *self.batch_spec(key)) if key in routed else spec
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, s))
        return {k: split(k, x) for k, x in batch.items()}

    def batch_spec(self, key: str) -> P:
        """The spec of the [B, T] batch array `key`: rows over the batch axes, and a routed input's T over
        `seq` (when the stages split it) and `pipe` (see `routed_inputs`)."""
        rows = sharding.logical_to_spec(("batch", "length"), self.plan.rules, self.mesh)
        if key not in self.routed_inputs():
            return rows
        seq = ("seq",) if self.plan.sizes["seq"] > 1 else ()
        return P(tuple(rows)[0] if len(rows) else None, (*seq, "pipe"))

    def routed_inputs(self) -> dict:
        """{batch key: 'first' | 'last'} for the inputs that only the first stage (the embedding) or only the
        last (the head and loss) reads, e.g. tokens and targets / weights: with a pipeline they are stored
        split over `pipe` as well and gathered on the one rank that reads them (the executor's
        `routed_inputs`), instead of every pipeline rank receiving them. Keys the layers read (segment ids,
        positions) go to every rank. Empty without a pipeline, when seq_len is not divisible by seq x pipe,
        or with a zigzag sequence layout (all-gather attention reorders the tokens first). Found by tracing
        the model's single-device code (what each part's value depends on), so a model must read the same
        batch keys in every layout."""
        if getattr(self, "_routed", None) is None:
            plan, sizes = self.plan, self.plan.sizes
            self._routed = {}
            if (self.kind == "pipelined" and not plan.parallelism.zigzag
                    and plan.config.train.seq_len % (sizes["seq"] * sizes["pipe"]) == 0):
                self._routed = self._find_routed()
        return self._routed

    def _find_routed(self) -> dict:
        t = self._tracing()

        def keys(fn, params):  # the batch keys fn(params, mb)'s value depends on
            read = _leaves_live(lambda a: fn(a["p"], a["mb"]), {"p": params, "mb": t.mb})
            return {k for k in t.mb if f"['mb']['{k}']" in read}
        first = keys(lambda p, b: t.model(p).embed(b, DENSE), t.rest)
        last = keys(lambda p, b: t.model(p).loss(t.x0(), b, DENSE), t.rest)
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), t.blocks)  # one layer
        layers = keys(lambda p, b: model_lib.apply_layer_aux(t.graphdef, p, t.x0(), b, self.plan.remat, DENSE),
                      one)  # its aux values count too
        return {**{k: "first" for k in first - last - layers}, **{k: "last" for k in last - first - layers}}

    def _tracing(self) -> _Tracing:
        """The pieces the abstract traces of the model's parts below share (built once)."""
        if getattr(self, "_traced", None) is None:
            plan = self.plan
            rest = {k: v for k, v in plan.abstract_params.items() if k != "blocks"}
            blocks = plan.abstract_params["blocks"]
            graphdef = nnx.split(nnx.merge(plan.graphdef, plan.abstract_params).blocks)[0]
            mb = zero_row_batch(plan)

            def model(p):
                return nnx.merge(plan.graphdef, {**p, "blocks": blocks})
            x = jax.eval_shape(lambda p: model(p).embed(mb, DENSE), rest)
            self._traced = _Tracing(mb, rest, blocks, graphdef, model, x)
        return self._traced

    # --- dense and manual -----------------------------------------------------------------------------

    def _unpipelined_terms(self, params, batch):
        """(the model's loss sum, the layers' aux sums) of `model_lib.loss_terms`."""
        plan = self.plan
        if self.kind == "manual":
            def per_rank(p, b):
                return model_lib.loss_terms(nnx.merge(plan.graphdef, p), b, plan.remat, plan.parallelism)
            return shard_loss(per_rank, plan.parallelism, self.mesh, plan.logical)(params, batch)
        with sharding.activation_sharding(self.mesh, plan.rules):
            return model_lib.loss_terms(nnx.merge(plan.graphdef, params), batch, plan.remat, plan.parallelism)

    # --- pipelined ------------------------------------------------------------------------------------

    def _pipeline_parts(self):
        """(keys of the non-block parameter leaves `embed` reads, those `loss` reads), as flat paths."""
        if getattr(self, "_parts", None) is None:
            t = self._tracing()
            self._parts = (_leaves_read(lambda p: t.model(p).embed(t.mb, DENSE), t.rest),
                           _leaves_read(lambda p: t.model(p).loss(t.x0(), t.mb, DENSE), t.rest))
        return self._parts

    def _stage_aux(self) -> bool:
        """Whether the blocks' layers return aux values (traced once, abstractly, on one layer)."""
        if getattr(self, "_has_aux", None) is None:
            t = self._tracing()
            one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), t.blocks)
            aux = jax.eval_shape(lambda c, x: model_lib.apply_blocks_aux(t.graphdef, c, x, t.mb)[1], one, t.x)
            self._has_aux = bool(aux)
        return self._has_aux

    def _stage_parallelism(self):
        """What the stages run with: FSDP shards gathered per layer inside the stage (`par.weight`) when the
        model reads its weights through `par.weight` (it declares `parallel_axes`) and every axis its block
        weights are sharded over, besides seq / tensor, is a batch axis; else the weights enter whole over
        those axes (the compiler gathers them once per step, before the region)."""
        plan = self.plan
        specs = jax.tree.leaves(plan.parallelism.param_specs(plan.logical["blocks"]))
        gathered = {a for s in specs for e in s[1:] for a in sharding.spec_axes(e)} - set(MODEL_AXES)
        if plan.model_class.parallel_axes and gathered <= set(plan.batch_axes):
            return plan.parallelism
        return plan.parallelism.model_axes_only()

    def _pipeline_args(self, params, batch) -> dict:
        """The executor's functions, parameters, inputs and specs for the model.

        With tensor / sequence parallelism every stage runs per rank as in `shard_loss`: weights split over
        `tensor`, microbatch arrays [rows, T/s] (Ulysses, or all-gather attention: its zigzag layout is
        made here, on the global batch before the region; the plan rejects ring), residual stream
        [rows, T/(s*t), D] -- also between pipeline ranks. Stage weights stay sharded over FSDP inside the
        region (ZeRO-3 within a stage): `par.weight` all-gathers one layer at a time in the forward and
        again in the backward, and its transpose reduce-scatters the layer's gradient into an accumulator
        that stays 1/fsdp the size. The first / last stage parts (embedding, head) enter whole over FSDP
        (the compiler gathers them once per step, outside the loop).
        """
        plan = self.plan
        par = plan.parallelism.model_axes_only()  # first / last: weights whole over FSDP
        stage_aux = self._stage_aux()
        stage_par = self._stage_parallelism()
        rest = {k: v for k, v in params.items() if k != "blocks"}
        no_blocks = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), plan.abstract_params["blocks"])
        blocks_graphdef = nnx.split(nnx.merge(plan.graphdef, plan.abstract_params).blocks)[0]

        unread = {k: v for k, v in plan.abstract_params.items() if k != "blocks"}

        def model(rest_params):  # the embedding / head parts of the model; its blocks are never called
            # A stage gets only the leaves it reads (`_pipeline_parts`); the others are placeholders.
            rest_params = jax.tree.map(lambda a, x: a if x is None else x, unread, rest_params)
            return nnx.merge(plan.graphdef, {**rest_params, "blocks": no_blocks})

        def first_fn(rest_params, mb):
            return model(rest_params).embed(mb, par)

        def layer_fn(layer, x, mb):  # the executor runs a stage's layers, one vjp per layer (split backward)
            x, aux = model_lib.apply_layer_aux(blocks_graphdef, layer, x, mb, plan.remat, stage_par)
            if not stage_aux:
                return x
            # This rank's sums over its tokens; the executor sums them over the batch axes. Tensor ranks
            # computed the same values from the same tokens: averaged, as `Parallelism.sum_aux` does.
            if stage_par.tensor > 1:
                aux = jax.tree.map(lambda a: jax.lax.pmean(a, "tensor"), aux)
            return x, (model_lib.aux_loss(aux), aux)

        def last_fn(rest_params, x, mb):  # this rank's tokens; the executor sums over the batch axes and seq
            return model(rest_params).loss(x, mb, par)

        first_keys, last_keys = self._pipeline_parts()
        laid_out = batch
        if par.zigzag:  # each seq rank's contiguous shard is then its zigzag chunks (i, 2s-1-i)
            laid_out = jax.tree.map(lambda a: sequence.ring_layout(a, par.seq, axis=1), batch)
        rest_specs = par.param_specs({k: v for k, v in plan.logical.items() if k != "blocks"})
        # Stage weights: the dims after the executor's [p, v], i.e. [Lc, ...] with the layers dim whole.
        stage_specs = jax.tree.map(lambda s: P(None, *s[1:]), stage_par.param_specs(plan.logical["blocks"]))
        return dict(
            first_fn=first_fn, layer_fn=layer_fn, last_fn=last_fn,
            params={"first": _subtree(rest, first_keys),
                    "stages": executor.to_pipeline_layout(params["blocks"], self.schedule),
                    "last": _subtree(rest, last_keys)},
            inputs=self.split_microbatches(laid_out, self.schedule.num_microbatches), mesh=self.mesh,
            batch_axes=plan.batch_axes, param_specs={"first": _subtree(rest_specs, first_keys), "stages": stage_specs,
                                                     "last": _subtree(rest_specs, last_keys)},
            input_spec=P("seq") if par.seq > 1 else P(), stage_aux=stage_aux, routed_inputs=self.routed_inputs())

    def steady_step(self, previous, params, previous_batch, batch, inflight):
        """One step of the steady schedule (2bw): `((loss sum, grads) of the previous batch's part run in
        this step, (loss sum, grads) of this batch's part, inflight)`; `previous` are the weights the
        previous batch's forwards used. Gradients are fp32, in the layout of `params`."""
        schedule = self.plan.schedule
        prev, cur = self._pipeline_args(previous, previous_batch), self._pipeline_args(params, batch)
        if cur.pop("stage_aux"):
            raise ValueError("the 2bw schedule does not run layers with aux values (MoE) yet; use 1f1b or zbv")
        inputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), prev["inputs"], cur["inputs"])
        parts = executor.pipeline_steady_step(
            schedule, remat=bool(self.plan.config.pipeline.remat), previous=prev["params"], inflight=inflight,
            **{**cur, "inputs": inputs})
        rest = {k: v for k, v in params.items() if k != "blocks"}

        def unstage(grads):
            return {**_combine(rest, grads["first"], grads["last"]),
                    "blocks": executor.from_pipeline_layout(grads["stages"], schedule)}
        return (parts[0][0], unstage(parts[0][1])), (parts[1][0], unstage(parts[1][1])), parts[2]

    def steady_manual_axes(self) -> tuple:
        """The mesh axes `steady_step`'s in-flight leaves are split over (their leading dim)."""
        found = []

        def trace(params, batch):
            args = self._pipeline_args(params, batch)
            found.append(executor.manual_axes(self.mesh, args["batch_axes"], args["param_specs"], args["input_spec"]))
            return jnp.zeros(())
        jax.eval_shape(trace, self.plan.abstract_params, abstract_batch(self.plan.config))
        return found[0]

    def _pipeline_sum_and_grads(self, params, batch):
        schedule = self.schedule
        out = executor.pipeline_value_and_grad(
            schedule, remat=bool(self.plan.config.pipeline.remat), **self._pipeline_args(params, batch))
        loss, grads = out[:2]
        aux = executor.from_pipeline_layout(out[2], schedule) if len(out) > 2 else {}
        rest = {k: v for k, v in params.items() if k != "blocks"}
        rest_grads = _combine(rest, grads["first"], grads["last"])
        return loss, {**rest_grads, "blocks": executor.from_pipeline_layout(grads["stages"], schedule)}, aux


class _Tracing(NamedTuple):
    """A zero-row microbatch, the non-block parameters, the stacked blocks (all abstract), the blocks'
    graphdef, `model(rest)`: the model on those, and `x`: the residual stream's shape after `embed`."""
    mb: dict
    rest: dict
    blocks: dict
    graphdef: object
    model: Callable
    x: jax.ShapeDtypeStruct

    def x0(self):
        return jnp.zeros(self.x.shape, self.x.dtype)


def zero_row_batch(plan) -> dict:
    """A one-row batch of zeros shaped like the training batch (to trace what a stage reads)."""
    return jax.tree.map(lambda a: jnp.zeros((1, *a.shape[1:]), a.dtype), abstract_batch(plan.config))


def _paths(tree) -> list:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _leaves_read(fn, tree) -> frozenset:
    """Paths of the leaves of `tree` that `fn(tree)` reads: the inputs of its jaxpr that any equation or
    output uses (traced with the dense code; a model reads the same parameters under every layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    closed = jax.make_jaxpr(lambda *xs: fn(jax.tree.unflatten(treedef, xs)))(*leaves)
    used = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars} | {id(v) for v in closed.jaxpr.outvars}
    return frozenset(path for path, var in zip(_paths(tree), closed.jaxpr.invars) if id(var) in used)


def _leaves_live(fn, tree) -> frozenset:
    """Paths of the leaves of `tree` that `fn(tree)`'s value depends on: `_leaves_read` after dead-code
    elimination, so that an input only reshaped or padded along the way (the chunked loss splits every
    batch key into chunks, and reads only some) does not count."""
    from parallax.compat import dce_jaxpr
    leaves, treedef = jax.tree.flatten(tree)
    closed = jax.make_jaxpr(lambda *xs: fn(jax.tree.unflatten(treedef, xs)))(*leaves)
    _, live = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return frozenset(path for path, used in zip(_paths(tree), live) if used)


def _subtree(tree, keep: frozenset):
    """`tree` with the leaves at paths outside `keep` replaced by None (no leaf: the executor holds nothing
    for them; `_pipeline_args.model` fills abstract placeholders where the stage function merges the model)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [x if path in keep else None for path, x in zip(_paths(tree), leaves)])


def _combine(rest, first, last):
    """Gradient of the non-block parameters: first + last where both read a leaf, zeros where neither."""
    def one(p, f, l):
        if f is None and l is None:
            return jnp.zeros(p.shape, jnp.float32)
        return f if l is None else l if f is None else f + l
    return jax.tree.map(one, rest, first, last, is_leaf=lambda x: x is None)
