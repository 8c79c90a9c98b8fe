"""DiLoCo: replicas that train alone and sync every H steps through an outer optimizer (`mesh.replica > 1`).

The `replica` mesh axis (outermost) holds R copies of the model. Each replica is a whole training run of
its own inside its devices: its parameters and inner optimizer state are sharded by the other axes (data,
FSDP, tensor, seq, expert) exactly as a run without replicas would shard them, and it takes 1/R of every
global batch's rows. An inner step is every replica's step at once, and issues **no collective over
`replica`**: the model runs per rank in the manual region (`shard_loss` in a `Region` whose copies are `replica`), `replica` one more
manual axis that only splits the stacked parameters and the rows; a model the plan runs densely runs
there too, with data and FSDP explicit.

Every `diloco.sync_every` (H) steps, after the inner step, the outer step (DiLoCo, arXiv 2311.08105):

    delta_r = global - params_r                     the pseudo-gradient of replica r (fp32)
    delta   = mean_r delta_r                        the one collective over `replica`
    global  = global - lr * step(delta)             SGD with (Nesterov) momentum: lr 0.7, momentum 0.9
    params_r = global                               every replica restarts from it; inner states stay

With outer lr 1, momentum 0 and H = 1, global = mean_r params_r: with a linear inner optimizer
(`optim.name=sgd`) that is one data-parallel step on the whole batch (tests/test_diloco.py checks it).

Pseudo-gradients travel as `diloco.pseudo_grad_dtype`: float32 (an all-reduce), bfloat16 (an all-reduce
of half the bytes) or int8 (an absmax scale per replica and tensor, per layer of the stack; an all-gather of
the int8 values and the scales, dequantised and averaged on arrival: a quarter of the bytes, since an
all-reduce cannot sum int8 without overflow). With `diloco.error_feedback` each replica keeps what
rounding took from its pseudo-gradient (fp32, one more copy of its parameters) and adds it to the next one.

State: `params` are the global parameters (what eval, sampling and export read), `opt_state` the
replicas' inner optimizer states stacked [R, ...], and `diloco` holds the replicas' parameters [R, ...],
the outer optimizer's state and the rounding errors. All of it is checkpointed, so a run resumes exactly,
also in the middle of an inner phase; a checkpoint resumes with the same `mesh.replica` only.

Streaming DiLoCo (arXiv 2501.18512): `diloco.fragments=F` cuts the layer stack into F layer ranges (the
parameters outside it go with the first) synced at staggered steps, t = f H / F (mod H); `diloco.overlap=1`
exchanges the parameters after step t during step t + 1 and applies the result after that step's inner
step, mixing it into the replicas' fragment with `diloco.mix` (the paper's tau = 1 semantics). The training
loop runs each kind of step (no sync, fragment f's sync: `step_kind`) as its own program, so the exchange
is at the top level of the step rather than in a conditional, and with overlap independent of the inner
step (see docs/diloco.md for what the TPU compiler does with it). The outer optimizer is written out (SGD
with Nesterov momentum, optax.sgd's rule) so that a fragment's step touches its own slice of the momentum
alone.

The inner loss is each replica's own token mean (its rows' weight total), and the pseudo-gradients are
averaged with equal weights, as in the paper. Metrics stay [R] on the devices (averaging them there would
be a collective over `replica` at every step) and are averaged on the host.

Pipelines (`mesh.pipe > 1`, flushing schedules): the executor runs the R replicas' pipelines in one region
with `replica` as one more manual axis (the region's copies); its sums and gradients are divided by each
replica's weight total here.
"""

from __future__ import annotations

import dataclasses
import functools

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax import model as model_lib
from parallax import sharding
from parallax.errors import ConfigError
from parallax.mesh import REPLICA
from parallax.parallel.manual import shard_loss
from parallax.parallel.region import Region
from parallax.parallel.tensor import reduction_dtype
from parallax.steps.base import StepPath, accumulate
from parallax.steps.pipeline import PipelinePath


def _stacked(s: NamedSharding) -> NamedSharding:
    """The sharding of a leaf stacked [R, ...] over replicas from that of one replica's leaf."""
    return NamedSharding(s.mesh, P(REPLICA, *s.spec))


def _fit_spec(shape, spec: P, sizes) -> P:
    """`spec` for an array of `shape` cut from one it fits (a fragment of a layer stack): the axes of a dim
    they no longer divide (a fragment's layers, split over `pipe`) move to the largest dim that nothing splits
    and that they divide, so that each parameter still travels over `replica` once; else that dim is whole."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    moved = []
    for i, entry in enumerate(entries):
        axes = sharding.spec_axes(entry)
        if axes and shape[i] % int(np.prod([sizes[a] for a in axes])):
            entries[i], moved = None, moved + list(axes)
    if moved:
        n = int(np.prod([sizes[a] for a in moved]))
        free = [i for i, entry in enumerate(entries) if entry is None and shape[i] % n == 0]
        if free:
            entries[max(free, key=lambda i: shape[i])] = tuple(moved)
    return P(*entries)


class DilocoPath(StepPath):
    """`mesh.replica > 1`: R replicas of the inner path (dense, manual or a flushing pipeline), synced every H
    steps."""

    state_keys = ("diloco",)
    state_label = "DiLoCo replicas' parameters, outer state"

    @classmethod
    def runs(cls, plan) -> bool:
        return plan.sizes[REPLICA] > 1

    def __init__(self, plan, mesh):
        super().__init__(plan, mesh)
        from parallax.steps import PATHS  # the inner path: the one this plan would run without replicas

        self.inner = next(c for c in PATHS if c is not DilocoPath and c.runs(plan))(plan, mesh)
        # A pipeline (flushing schedules): R independent pipelines in one executor run (the region's copies).
        self.pipelined = isinstance(self.inner, PipelinePath)
        self.replicas = plan.sizes[REPLICA]
        self.region = Region(copies=(REPLICA,))  # each replica its own copy of the model
        if isinstance(mesh, jax.sharding.Mesh) and jax.process_count() > 1:
            # Each replica within one process (host) keeps every inner collective off the network between them.
            where = [sorted({d.process_index for d in mesh.devices[r].flat}) for r in range(self.replicas)]
            logging.info("DiLoCo: %d replicas on processes %s", self.replicas, where)
        # The inner step always runs in the manual region, `replica` one more manual axis that only splits:
        # the dense path's model code too, with data and FSDP explicit (as the manual path does). Under
        # jax.vmap(spmd_axis_name='replica') instead, each while loop whose trip count differs per row (the
        # blockwise attention's tile ranges) reduced its predicate over the replicas at every iteration, a
        # collective over `replica` in every inner step; and vmap over the manual region fails JAX's
        # varying-axes checks.
        par = plan.parallelism
        if not par.mesh_shape:
            par = dataclasses.replace(par, mesh_shape=tuple(plan.sizes.items()), rules=tuple(plan.rules.items()))
        self.par = par
        d = plan.diloco
        self.every, self.dtype, self.feedback = d.sync_every, d.pseudo_grad_dtype, d.error_feedback
        # One replica's parameter specs: how the outer exchange splits each tensor.
        self.param_specs = None if mesh is None else jax.tree.map(
            lambda s: s.spec, sharding.param_shardings(plan.abstract_params, plan.logical, mesh, plan.rules))
        self.lr, self.momentum, self.nesterov = d.outer_lr, d.outer_momentum, d.nesterov
        # Streaming: fragment f holds layers [f L/F, (f+1) L/F) of the block stack (and fragment 0 every
        # parameter outside it) and syncs at the inner steps t = f H/F (mod H).
        self.fragments, self.overlap, self.mix = d.fragments, d.overlap, d.mix
        layers = plan.num_layers
        self.layer_ranges = [(f * layers // self.fragments, (f + 1) * layers // self.fragments)
                             for f in range(self.fragments)]
        self.offsets = [f * self.every // self.fragments for f in range(self.fragments)]
        steps = plan.train.steps
        if mesh is not None and (steps % self.every or self.overlap or self.fragments > 1):
            logging.warning("DiLoCo: the global parameters (eval, sampling, export) hold what the replicas learnt "
                            "up to each fragment's last sync; train.steps=%d is not a step at which every fragment "
                            "has just synced (sync_every=%d, fragments=%d, overlap=%d), so the replicas' last inner "
                            "steps stay in the replicas", steps, self.every, self.fragments, self.overlap)

    # --- the batch ------------------------------------------------------------------------------------

    def batch_spec(self, key: str) -> P:
        return self.region.rows_spec(self.inner.batch_spec(key))

    def rows_sharding(self) -> NamedSharding:
        s = self.inner.rows_sharding()
        return NamedSharding(s.mesh, self.region.rows_spec(s.spec))

    def per_replica(self, batch):
        """[B, ...] arrays -> [R, B/R, ...]: replica r's rows (the r-th block of the rows)."""
        r = self.replicas
        return jax.tree.map(lambda x: x.reshape(r, x.shape[0] // r, *x.shape[1:]), batch)

    # --- the loss -------------------------------------------------------------------------------------

    def sum(self, params, batch):
        """The global parameters' loss sum over the global batch (eval): each replica's rows on its own
        devices, the R sums added (the one collective over `replica`: a scalar)."""
        stacked = self._stack(params)
        if self.pipelined:
            return jnp.sum(self.inner.sum(stacked, batch, self.region))
        return jnp.sum(self.replica_terms(stacked, batch)[0])

    def sum_and_grads(self, params, batch):
        """The synchronous gradient of the global parameters (tools; training uses `replica_grads`)."""
        return self.inner.sum_and_grads(params, batch)

    def replica_terms(self, stacked, batch):
        """([R] loss sums, aux sums [R, ...]) of each replica's parameters on its own rows of `batch`."""
        plan, par = self.plan, self.par

        def per_rank(p, b):
            return model_lib.loss_terms(nnx.merge(plan.graphdef, p), b, plan.remat, par)
        return shard_loss(per_rank, par, self.mesh, plan.logical, self.region)(stacked, batch)

    def replica_grads(self, stacked, batch):
        """([R] mean losses, gradients [R, ...] fp32, aux [R, ...]): each replica's loss (aux losses
        included) over its own rows' weight total, in `train.microbatches` pieces as `loss_grads_aux`."""
        totals = jnp.maximum(jnp.sum(self.per_replica(batch)["weights"], axis=(1, 2)), 1.0)  # (R,)

        def objective(p, b):
            lm, aux = self.replica_terms(p, b)
            losses = lm + jax.vmap(model_lib.aux_loss)(aux) if aux else lm
            return jnp.sum(losses / totals), (losses / totals, aux)

        def grads_of(b):
            if self.pipelined:  # the executor's sums and their gradients, each replica's over its total
                sums, grads, aux = self.inner.sum_and_grads(stacked, b, self.region)
                per = lambda g: g.astype(jnp.float32) / totals.reshape(-1, *(1,) * (g.ndim - 1))
                return sums / totals, jax.tree.map(per, grads), aux
            (_, (losses, aux)), grads = jax.value_and_grad(objective, has_aux=True)(stacked, b)
            return losses, jax.tree.map(lambda g: g.astype(jnp.float32), grads), jax.lax.stop_gradient(aux)

        m = self.plan.train.microbatches
        if m == 1:
            return grads_of(batch)

        return accumulate(grads_of, self.split_microbatches(batch, m))

    # --- the step and its state -----------------------------------------------------------------------

    def abstract_extra(self) -> dict:
        params = self.plan.abstract_params
        return {"diloco": jax.eval_shape(self._init_diloco, params)}

    def _stack(self, tree):
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.replicas, *a.shape)), tree)

    def _init_diloco(self, params):
        f32 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        out = {"params": self._stack(params), "momentum": f32 if self.momentum else {}}
        if self.feedback:
            out["error"] = self._stack(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        return out

    def init_extra(self, params) -> dict:
        return {"diloco": self._init_diloco(params)}

    def extra_shardings(self, param_shardings) -> dict:
        out = {"params": jax.tree.map(_stacked, param_shardings), "momentum": param_shardings if self.momentum else {}}
        if self.feedback:
            out["error"] = jax.tree.map(_stacked, param_shardings)
        return {"diloco": out}

    def init_opt_state(self, tx, params):
        return self._stack(tx.init(params))

    def opt_state_shardings(self, shardings):
        return jax.tree.map(_stacked, shardings)

    def _due(self, before):
        """Per fragment, whether it syncs in the step that starts at step `before` (an int or a traced
        scalar). The sync point t is the number of inner steps the exchanged parameters have taken: with
        `overlap=0` the replicas' parameters after this step; with `overlap=1` those it started from."""
        point = before if self.overlap else before + 1
        return [((point - o) % self.every == 0) & (point > 0) for o in self.offsets]

    def step_kind(self, step: int):
        """The fragment that syncs in the step starting at `step`, or -1: the training loop runs each kind's
        own program, so the exchange is at the top level of the step, not in a conditional; with
        `overlap=1` it does not depend on the inner step, and XLA's scheduler can run it under the inner
        step's compute (a conditional runs as one operation after all its operands)."""
        return next((f for f, due in enumerate(self._due(step)) if due), -1)

    def step_kinds(self) -> tuple:
        return (-1, *range(self.fragments))

    def train_step(self, update, state, batch, kind=None):
        """One inner step on every replica, then the outer sync of the fragment whose turn it is, if any.
        `kind` (`step_kind`, from the host): that fragment's sync, or none (-1). None: decided on the
        device by a `lax.switch` on the step (the other steps run no collective over `replica`). With
        `overlap=1` the exchange takes the parameters this step started from and is applied after its
        inner step."""
        new, metrics = self.inner_step(update, state, batch)
        exchanged = (state if self.overlap else new)["diloco"]["params"]
        if kind is not None:
            fn = self._no_sync if kind < 0 else functools.partial(self.sync, f=kind)
            glob, inner, metrics["path"] = fn(new["params"], new["diloco"], exchanged)
            return {**new, "params": glob, "diloco": inner}, metrics
        due = self._due(state["step"])
        index = jnp.int32(self.fragments)
        for f in reversed(range(self.fragments)):
            index = jnp.where(due[f], f, index)
        branches = [lambda g, d, x, f=f: self.sync(g, d, x, f) for f in range(self.fragments)] + [self._no_sync]
        glob, inner, metrics["path"] = jax.lax.switch(index, branches, new["params"], new["diloco"], exchanged)
        return {**new, "params": glob, "diloco": inner}, metrics

    def inner_step(self, update, state, batch):
        """Every replica's step on its own rows with its own inner optimizer: (state, metrics [R] per
        replica). The global parameters stay as they are."""
        d = state["diloco"]
        losses, grads, aux = self.replica_grads(d["params"], batch)

        def inner_update(params, opt_state, loss, g, aux, rows):
            new, metrics = update({"step": state["step"], "params": params, "opt_state": opt_state}, rows, loss, g,
                                  aux)
            return new["params"], new["opt_state"], metrics
        params, opt_state, metrics = jax.vmap(inner_update, spmd_axis_name=REPLICA)(
            d["params"], state["opt_state"], losses, grads, aux, self.per_replica(batch))
        return {"step": state["step"] + 1, "params": state["params"], "opt_state": opt_state,
                "diloco": {**d, "params": params}}, metrics

    # --- the outer step -------------------------------------------------------------------------------

    def mean_pseudo_grad(self, glob, stacked, error, specs):
        """(mean over replicas of the pseudo-gradients as they arrive, the new rounding errors [R, ...] or
        None, the mean over replicas of their squared norms). `glob` the global parameters, `stacked` the
        replicas' [R, ...], `error` [R, ...] or None, `specs` one replica's PartitionSpecs of them. One
        `shard_map` holds the exchange, so what travels is explicit: a psum in fp32 or bf16, or an all-gather
        of int8."""
        shard_axes = [tuple(a for e in s for a in sharding.spec_axes(e)) for s in jax.tree.leaves(specs)]
        others = tuple(a for a in self.mesh.axis_names if a != REPLICA)

        def square_norm(tree):  # this replica's |tree|^2, each leaf summed over the axes that split it
            parts = [jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)]
            return sum(jax.lax.psum(v, axes) if axes else v for v, axes in zip(parts, shard_axes))

        def scale(x, stacked_layers):  # int8 absmax scale: per layer of a stacked [L, ...] leaf, else per tensor
            keep = (0,) if stacked_layers and x.ndim > 1 else ()
            peak = jnp.max(jnp.abs(x), axis=tuple(d for d in range(x.ndim) if d not in keep), keepdims=True)
            return jnp.maximum(jax.lax.pmax(peak, others), 1e-30) / 127.0

        def per_replica(glob, stacked, error):
            delta = jax.tree.map(lambda g, p: g.astype(jnp.float32) - p[0].astype(jnp.float32), glob, stacked)
            if error is not None:
                delta = jax.tree.map(lambda d, e: d + e[0], delta, error)
            square = jax.lax.pmean(square_norm(delta), REPLICA)
            if self.dtype == "float32":
                return jax.tree.map(lambda x: jax.lax.pmean(x, REPLICA), delta), None, square
            if self.dtype == "bfloat16":
                sent = jax.tree.map(lambda x: x.astype(jnp.bfloat16), delta)
                wire = reduction_dtype(jnp.bfloat16, self.plan.platform)  # XLA:CPU: fp32 (its bf16 sums abort)
                mean = jax.tree.map(lambda q: jax.lax.psum(q.astype(wire), REPLICA).astype(jnp.float32)
                                    / self.replicas, sent)
                arrived = jax.tree.map(lambda q: q.astype(jnp.float32), sent)
            else:
                scales = {k: jax.tree.map(lambda x, k=k: scale(x, k == "blocks"), v) for k, v in delta.items()}
                sent = jax.tree.map(lambda x, c: jnp.round(x / c).astype(jnp.int8), delta, scales)
                arrived = jax.tree.map(lambda q, c: q.astype(jnp.float32) * c, sent, scales)
                # An all-reduce cannot sum int8 without overflow: every replica receives every replica's
                # int8 values and scale (all-gathers), and sums in fp32.
                gathered = jax.tree.map(lambda q: jax.lax.all_gather(q, REPLICA), sent)
                all_scales = jax.tree.map(lambda c: jax.lax.all_gather(c, REPLICA), scales)
                # q [R, ...] int8, c [R, L or 1, 1, ...]: the replicas' dequantised values, averaged
                mean = jax.tree.map(lambda q, c: jnp.mean(q.astype(jnp.float32) * c, axis=0), gathered, all_scales)
            new_error = None
            if error is not None:
                new_error = jax.tree.map(lambda d, a: (d - a)[None], delta, arrived)
            return mean, new_error, square

        stacked_spec = jax.tree.map(lambda s: P(REPLICA, *s), specs)
        error_spec = None if error is None else stacked_spec
        # Manual over every axis, each leaf in its own sharding: what travels over `replica` is this
        # device's shard of each tensor, nothing else. check_vma off: the int8 mean is computed on every
        # replica from the same all-gathered values (the type system counts an all-gather's result as
        # varying); nothing here is differentiated.
        region = jax.shard_map(per_replica, mesh=self.mesh, in_specs=(specs, stacked_spec, error_spec),
                               out_specs=(specs, error_spec, P()), axis_names=set(self.mesh.axis_names),
                               check_vma=False)
        return region(glob, stacked, error)

    def _part(self, tree, f: int, stacked: bool = False):
        """Fragment f's part of a params-shaped tree (`stacked`: with a leading [R] dim)."""
        lo, hi = self.layer_ranges[f]
        cut = (lambda x: x[:, lo:hi]) if stacked else (lambda x: x[lo:hi])
        return {k: jax.tree.map(cut, v) if k == "blocks" else v for k, v in tree.items() if k == "blocks" or f == 0}

    def _merge(self, tree, part, f: int, stacked: bool = False):
        """`tree` with fragment f's part replaced by `part`."""
        lo = self.layer_ranges[f][0]
        axis = 1 if stacked else 0
        put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), lo, axis)
        return {k: (jax.tree.map(put, v, part[k]) if k == "blocks" else jax.tree.map(lambda x, y: y.astype(x.dtype), v,
                                                                                       part[k]))
                if k in part else v for k, v in tree.items()}

    def sync(self, glob, inner, exchanged, f: int = 0):
        """The outer step of fragment f (every parameter when `diloco.fragments` is 1): (global
        parameters, replica state, metrics). `exchanged` are the replicas' parameters [R, ...] whose
        pseudo-gradients travel (`train_step`)."""
        part = lambda tree, stacked=False: self._part(tree, f, stacked)
        g = part(glob)
        error = part(inner["error"], True) if "error" in inner else None
        specs = {k: v for k, v in self.param_specs.items() if k == "blocks" or f == 0}
        specs = jax.tree.map(lambda a, s: _fit_spec(a.shape, s, self.plan.sizes), g, specs)  # a cut's spec
        mean, error, square = self.mean_pseudo_grad(g, part(exchanged, True), error, specs)
        # SGD on the pseudo-gradient, as optax.sgd: m = mu m + delta; step = delta + mu m (Nesterov) or m
        out = dict(inner)
        step = mean
        if self.momentum:
            m = jax.tree.map(lambda m, d: self.momentum * m + d, part(inner["momentum"]), mean)
            step = jax.tree.map(lambda m, d: d + self.momentum * m, m, mean) if self.nesterov else m
            out["momentum"] = self._merge(inner["momentum"], m, f)
        new = jax.tree.map(lambda x, u: x.astype(jnp.float32) - self.lr * u, g, step)
        mine = part(inner["params"], True)
        if self.overlap:  # the replicas moved on while the exchange ran: mix their fragment with the new one
            mine = jax.tree.map(lambda p, x: self.mix * p.astype(jnp.float32) + (1 - self.mix) * x[None], mine, new)
        else:
            mine = self._stack(new)
        out["params"] = self._merge(inner["params"], mine, f, True)
        if error is not None:
            out["error"] = self._merge(inner["error"], error, f, True)
        norm = optax.tree.norm(mean)
        # The replicas' spread around their mean: mean_r |delta_r|^2 - |mean delta|^2 (no second exchange).
        divergence = jnp.sqrt(jnp.maximum(square - norm ** 2, 0.0))
        return self._merge(glob, new, f), out, self._per_replica(
            {"outer_pseudo_grad_norm": norm, "outer_divergence": divergence, "outer_fragment": jnp.float32(f)})

    def _no_sync(self, glob, inner, exchanged):
        """A step without a sync: everything as it is, NaN metrics (logged only on the steps that sync)."""
        nan = jnp.full((), jnp.nan, jnp.float32)
        return glob, inner, self._per_replica({"outer_pseudo_grad_norm": nan, "outer_divergence": nan,
                                               "outer_fragment": nan})

    def _per_replica(self, metrics):
        return jax.tree.map(lambda m: jnp.broadcast_to(m, (self.replicas,)), metrics)

    # --- metrics --------------------------------------------------------------------------------------

    def metrics_sharding(self) -> NamedSharding:
        """Each metric is [R], one value per replica on its own devices: averaging them on the devices would
        be a collective over `replica` at every step; the host averages them (`fetch_metrics`)."""
        return NamedSharding(self.mesh, P(REPLICA))

    def fetch_metrics(self, metrics: dict) -> dict:
        """Means over the replicas (`all` of the flags). With replicas in several processes each holds its
        own replicas' values: one small host-level gather (outside the step program) gives every process all
        of them, so every process logs and checks the same numbers."""
        if any(not m.is_fully_addressable for m in jax.tree.leaves(metrics)):
            from jax.experimental import multihost_utils

            metrics = multihost_utils.process_allgather(metrics, tiled=True)
        metrics = jax.device_get(metrics)
        return jax.tree.map(lambda m: np.all(m) if m.dtype == bool else np.mean(m), metrics)

    # --- resuming -------------------------------------------------------------------------------------

    @classmethod
    def check_resume(cls, saved: dict, now: dict) -> None:
        """A DiLoCo checkpoint holds each replica's state: it resumes with the same replica count and the
        same `diloco.*` settings (the momentum and rounding errors it holds, and the outer trajectory)."""
        was, r = int(saved.get("mesh.replica", 1)), int(now.get("mesh.replica", 1))
        if was != r:
            if was > 1:
                raise ConfigError(f"config.mesh.replica={r}: the checkpoint in this workdir holds {was} DiLoCo "
                                  f"replicas' states; resume with mesh.replica={was} (its global parameters alone "
                                  f"load with parallax.sample.load_workdir, e.g. launch/hf_export.py)")
            raise ConfigError(f"config.mesh.replica={r}: the checkpoint in this workdir is of a run without DiLoCo "
                              f"replicas; resume with mesh.replica=1, or start a new workdir")
        if r > 1:  # the outer optimizer's settings shape its state and its trajectory, as optim.* do
            for key in sorted(k for k in now if k.startswith("diloco.")):
                if saved.get(key, now[key]) != now[key]:
                    raise ConfigError(f"config.{key}={now[key]!r}: the checkpoint in this workdir was saved by a "
                                      f"DiLoCo run with {key}={saved[key]!r}; resume with {key}={saved[key]!r}")
