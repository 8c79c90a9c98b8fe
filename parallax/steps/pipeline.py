"""The pipelined step path (`mesh.pipe > 1`): the model's parts handed to the schedule executor.

The first stage gets the parameters outside `blocks` that `embed` reads, the last stage those that `loss`
reads (found by tracing each once: a tied embedding is in both); the stacked blocks go to the executor in
its `[p, v, L/(p*v), ...]` layout. Layers with aux values add their aux loss to the loss in each chunk's
forward, and their stats come back per stage. Eval runs the executor's F ticks only (`pipeline_loss`), so
it works on every mesh training works on. What the model's parts read is decided once, here, by abstract
traces of the single-device code (`parallax.pipeline.parts.Parts`, made by the plan); a model must read the same batch keys and parameters in
every layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from parallax import lora
from parallax import model as model_lib
from parallax import sharding
from parallax.parallel.manual import DENSE, WEIGHT_AXES
from parallax.parallel.region import SINGLE, Region
from parallax.steps.base import StepPath
from parallax.pipeline import executor
from parallax.pipeline.layout import from_pipeline_layout, to_pipeline_layout
from parallax.pipeline.parts import leaves_live, paths


class PipelinePath(StepPath):
    """A flushing pipeline schedule (gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv, v_half, v_min) over `pipe`.

    With tensor / sequence parallelism every stage runs per rank as in `shard_loss`: weights split over
    `tensor`, microbatch arrays [rows, T/s] (Ulysses, or all-gather attention: its zigzag layout is made
    here, on the global batch before the region; the plan rejects ring), residual stream [rows, T/(s*t), D]
    -- also between pipeline ranks. Stage weights stay sharded over FSDP inside the region (ZeRO-3 within a
    stage) when the model reads them through `par.weight`: it all-gathers one layer at a time in the forward
    and again in the backward, and its transpose reduce-scatters the layer's gradient into an accumulator
    that stays 1/fsdp the size. The first / last stage parts (embedding, head) enter whole over FSDP (the
    compiler gathers them once per step, outside the loop).
    """

    @classmethod
    def runs(cls, plan) -> bool:
        return plan.schedule is not None and not plan.schedule.steady

    def __init__(self, plan, mesh):
        super().__init__(plan, mesh)
        self.schedule = plan.schedule  # what `sum` and `sum_and_grads` run: a flushing schedule
        t = self.tracing = plan.parts  # what the model's parts read, traced once by the plan (`Parts`)
        # The non-block parameter leaves (flat paths) `embed` reads, and those `loss` reads.
        self.first_keys, self.last_keys, self.stage_aux = t.first_keys, t.last_keys, t.stage_aux
        self.routed = self._find_routed() if (
            not plan.parallelism.reordered
            and plan.train.seq_len % (plan.sizes["seq"] * plan.sizes["pipe"]) == 0) else {}
        self.outer_par = plan.parallelism.model_axes_only()  # first / last: weights whole over FSDP
        self.stage_par = self._stage_parallelism()
        self.vocab_parallel = plan.pipeline.vocab_parallel
        rest_logical = {k: v for k, v in plan.logical.items() if k != "blocks"}
        rest_specs = self.outer_par.param_specs(rest_logical)
        if self.vocab_parallel:  # its conditions on the model: `pipeline.settings.check_parts`
            # The embedding and the head split along the vocabulary over pipe (x tensor), pipe-major.
            rest_specs = jax.tree.map(_vocab_over_pipe, rest_specs, rest_logical, is_leaf=lambda x: isinstance(x, P))
            self.routed = {}  # every rank reads the tokens and the targets
        # Stage weights: the dims after the executor's [p, v], i.e. [Lc, ...] with the layers dim whole.
        self.param_specs = {
            "first": _subtree(rest_specs, self.first_keys),
            "stages": jax.tree.map(lambda s: P(None, *s[1:]), self.stage_par.param_specs(plan.logical["blocks"])),
            "last": _subtree(rest_specs, self.last_keys)}
        self.input_spec = P("seq") if self.outer_par.seq > 1 else P()

    # --- the batch ------------------------------------------------------------------------------------

    def batch_spec(self, key: str) -> P:
        """Rows over the batch axes, and a routed input's T over `seq` (when the stages split it) and `pipe`
        (see `_find_routed`)."""
        rows = super().batch_spec(key)
        if key not in self.routed:
            return rows
        seq = ("seq",) if self.plan.sizes["seq"] > 1 else ()
        return P(tuple(rows)[0] if len(rows) else None, (*seq, "pipe"))

    def _find_routed(self) -> dict:
        """{batch key: 'first' | 'last'} for the inputs that only the first stage (the embedding) or only the
        last (the head and loss) reads, e.g. tokens and targets / weights: they are stored split over `pipe`
        as well and gathered on the one rank that reads them (`Layout.gather`), instead of every pipeline
        rank receiving them. Keys the layers read (segment ids, positions) go to every rank. None when
        seq_len is not divisible by seq x pipe, or with a zigzag sequence layout (all-gather attention
        reorders the tokens first). Decided by what each part's value depends on."""
        t = self.tracing

        def keys(fn, params):  # the batch keys fn(params, mb)'s value depends on
            read = leaves_live(lambda a: fn(a["p"], a["mb"]), {"p": params, "mb": t.mb})
            return {k for k in t.mb if f"['mb']['{k}']" in read}
        first = keys(lambda p, b: t.model(p).embed(b, DENSE), t.rest)
        last = keys(lambda p, b: t.model(p).loss(t.x0(), b, DENSE), t.rest)
        layers = keys(lambda p, b: model_lib.apply_layer_aux(t.graphdef, p, t.x0(), b, self.plan.remat, DENSE),
                      t.one_layer())  # its aux values count too
        return {**{k: "first" for k in first - last - layers}, **{k: "last" for k in last - first - layers}}

    def _stage_parallelism(self):
        """What the stages run with: FSDP shards gathered per layer inside the stage (`par.weight`) when the
        model reads its weights through `par.weight` (it declares `parallel_axes`) and every axis its block
        weights are sharded over, besides tensor, is a batch axis or seq; else the weights enter whole over
        those axes (the compiler gathers them once per step, before the region)."""
        plan = self.plan
        specs = jax.tree.leaves(plan.parallelism.param_specs(plan.logical["blocks"]))
        gathered = {a for s in specs for e in s[1:] for a in sharding.spec_axes(e)} - set(WEIGHT_AXES)
        if plan.model_class.parallel_axes and gathered <= {*plan.batch_axes, "seq"}:
            return plan.parallelism
        return self.outer_par

    # --- the executor's arguments ---------------------------------------------------------------------

    def functions(self) -> dict:
        """The executor's `first_fn`, `layer_fn` and `last_fn` for the model."""
        plan, t, par, stage_par, stage_aux = self.plan, self.tracing, self.outer_par, self.stage_par, self.stage_aux
        unread = t.rest

        def model(rest_params):  # the embedding / head parts of the model; its blocks are never called
            # A stage gets only the leaves it reads; the others are placeholders.
            rest_params = jax.tree.map(lambda a, x: a if x is None else x, unread, rest_params)
            return nnx.merge(plan.graphdef, {**rest_params, "blocks": t.blocks})

        head_par = par
        if self.vocab_parallel:  # the vocabulary over (pipe, tensor): rank pipe * t + tensor
            head_par = dataclasses.replace(par, vocab_axes=("pipe", "tensor") if par.tensor > 1 else ("pipe",))

        # Frozen leaves (LoRA's base) enter every part under stop_gradient: their gradients are zeros.
        trainable = plan.trainable  # None: every leaf trains
        rest_trainable = None if trainable is None else {k: v for k, v in trainable.items() if k != "blocks"}
        first_trainable, last_trainable, blocks_trainable = (None, None, None) if trainable is None else (
            _subtree(rest_trainable, self.first_keys), _subtree(rest_trainable, self.last_keys), trainable["blocks"])

        def first_fn(rest_params, mb):  # with vocab_parallel: this rank's share (`Parallelism.embed`)
            return model(lora.freeze(rest_params, first_trainable)).embed(mb, head_par)

        def layer_fn(layer, x, mb):  # the executor runs a stage's layers, one vjp per layer (split backward)
            layer = lora.freeze(layer, blocks_trainable)
            x, aux = model_lib.apply_layer_aux(t.graphdef, layer, x, mb, plan.remat, stage_par)
            if not stage_aux:
                return x
            # This rank's sums over its tokens; the executor sums them over the batch axes. Tensor ranks
            # computed the same values from the same tokens: averaged, as `Parallelism.sum_aux` does.
            if stage_par.tensor > 1:
                aux = jax.tree.map(lambda a: jax.lax.pmean(a, "tensor"), aux)
            return x, (model_lib.aux_loss(aux), aux)

        def last_fn(rest_params, x, mb):  # this rank's tokens; the executor sums over the batch axes and seq
            return model(lora.freeze(rest_params, last_trainable)).loss(x, mb, head_par)
        return {"first_fn": first_fn, "layer_fn": layer_fn, "last_fn": last_fn}

    def stage_call(self, region: Region = SINGLE) -> executor.StageCall:
        """What the executor runs for this path in `region` (with copies, DiLoCo's: every params leaf has a
        leading [R] dim); the vocabulary over the pipe ranks with `pipeline.vocab_parallel`."""
        if self.vocab_parallel:
            region = dataclasses.replace(region, vocab_axes=("pipe",))
        return executor.StageCall(
            **self.functions(), mesh=self.mesh, batch_axes=self.plan.batch_axes, param_specs=self.param_specs,
            input_spec=self.input_spec, routed_inputs=self.routed, stage_aux=self.stage_aux,
            remat=self.plan.pipeline.remat, region=region)

    def executor_inputs(self, params, batch, schedule, region: Region = SINGLE) -> tuple:
        """(params, inputs) of the executor's entry points for `params` and `batch` under `schedule`."""
        rest = {k: v for k, v in params.items() if k != "blocks"}
        to_layout = functools.partial(to_pipeline_layout, schedule=schedule)
        laid_out = self.outer_par.laid_out(batch)  # zigzag, usp or balanced: each seq rank's shard is then its own
        return ({"first": _subtree(rest, self.first_keys), "stages": region.per_copy(to_layout)(params["blocks"]),
                 "last": _subtree(rest, self.last_keys)},
                self.split_microbatches(laid_out, schedule.num_microbatches, region))

    def unstage(self, params, grads, schedule, region: Region = SINGLE):
        """Executor gradients `{first, stages, last}` -> the layout of `params`."""
        rest = {k: v for k, v in params.items() if k != "blocks"}
        from_layout = functools.partial(from_pipeline_layout, schedule=schedule)
        return {**_combine(rest, grads["first"], grads["last"]),
                "blocks": region.per_copy(from_layout)(grads["stages"])}

    # --- the loss -------------------------------------------------------------------------------------

    def sum(self, params, batch, region: Region = SINGLE):
        """The loss sum; in a region with copies (DiLoCo: params [R, ...]), each copy's [R] over its own
        rows of `batch`."""
        return executor.pipeline_loss(self.schedule, self.stage_call(region),
                                      *self.executor_inputs(params, batch, self.schedule, region))

    def sum_and_grads(self, params, batch, region: Region = SINGLE):
        """Pipelined gradients are fp32. In a region with copies, each copy's ([R] sums, gradients [R, ...],
        aux [R, ...]) on its own rows."""
        schedule = self.schedule
        out = executor.pipeline_value_and_grad(schedule, self.stage_call(region),
                                               *self.executor_inputs(params, batch, schedule, region))
        from_layout = functools.partial(from_pipeline_layout, schedule=schedule)
        aux = region.per_copy(from_layout)(out[2]) if self.stage_aux else {}
        return out[0], self.unstage(params, out[1], schedule, region), aux


def _vocab_over_pipe(spec: P, names) -> P:
    """A `last` weight's spec with its vocabulary dim split over `pipe` as well, pipe-major (vocab_parallel)."""
    if not names or "vocab" not in names:
        return spec
    entries = list(spec) + [None] * (len(names) - len(spec))
    for i, name in enumerate(names):
        if name == "vocab":
            entries[i] = ("pipe", *sharding.spec_axes(entries[i]))
    return P(*entries)


def rank_balance(plan) -> list:
    """Per pipeline rank of a pipelined plan: what its stages use and do, one dict per rank with `stages`
    (global stage ids), `layers` (real ones), `params` (parameters its stages read: their layers, the
    embedding on stage 0's rank, the head on the last stage's; whole, before FSDP / tensor splits) and
    `flops` (matmul FLOPs of a training step over the global batch: forward + backward = 3 x the counted
    forward of `Parts.flops`, no recomputation counted). With `pipeline.vocab_parallel` the embedding, the
    head and the loss are split evenly over the ranks. What balanced layouts are judged by (docs/pipeline.md)."""
    import math
    schedule, t = plan.schedule, plan.parts
    flops, n = t.flops(plan.remat), plan.num_layers
    counts = schedule.stage_layers(n)
    per_layer = sum(math.prod(a.shape[1:]) for a in jax.tree.leaves(t.blocks))

    def size(keys):
        return sum(math.prod(a.shape) for path, a in zip(paths(t.rest), jax.tree.leaves(t.rest)) if path in keys)
    first, last = size(t.first_keys), size(t.last_keys)
    sequences = 3 * plan.train.global_batch_size
    rows, spread = [], plan.pipeline.vocab_parallel
    for r in range(schedule.num_ranks):
        stages = sorted(int(s) for s in schedule.stage_of[r])
        layers = sum(counts[s] for s in stages)
        has_first = 1 / schedule.num_ranks if spread else 0 in stages
        has_last = 1 / schedule.num_ranks if spread else schedule.num_stages - 1 in stages
        rows.append({"rank": r, "stages": stages, "layers": layers,
                     "params": layers * per_layer + first * has_first + last * has_last,
                     "flops": sequences * (layers * flops["layer"] + flops["embed"] * has_first
                                           + flops["loss"] * has_last)})
    return rows


def balance_table(rows, peak=None) -> str:
    """`rank_balance` rows as a markdown table, with the max / min ratios; `peak`: the step's per-device peak
    (one SPMD program: every rank allocates the same buffers)."""
    def ratio(key):
        values = [r[key] for r in rows]
        return max(values) / max(min(values), 1)
    lines = ["| pipe rank | stages | layers | parameters used | training FLOPs (matmul) |", "|---|---|---|---|---|"]
    lines += [f"| {r['rank']} | {','.join(map(str, r['stages']))} | {r['layers']} | {r['params'] / 1e6:,.2f} M | "
              f"{r['flops']:.3e} |" for r in rows]
    lines.append(f"| max / min | | | {ratio('params'):.2f} | {ratio('flops'):.2f} |")
    if peak is not None:
        lines.append(f"\nper-rank peak: {peak / 2**30:.2f} GiB on every rank (one SPMD program: each rank "
                     f"allocates the largest stage's buffers)")
    return "\n".join(lines)


def _subtree(tree, keep: frozenset):
    """`tree` with the leaves at paths outside `keep` replaced by None (no leaf: the executor holds nothing
    for them; `functions().model` fills abstract placeholders where the stage function merges the model)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [x if path in keep else None for path, x in zip(paths(tree), leaves)])


def _combine(rest, first, last):
    """Gradient of the non-block parameters: first + last where both read a leaf, zeros where neither."""
    def one(p, f, l):
        if f is None and l is None:
            return jnp.zeros(p.shape, jnp.float32)
        return f if l is None else l if f is None else f + l
    return jax.tree.map(one, rest, first, last, is_leaf=lambda x: x is None)
