"""The train state and the jitted steps: shardings, the optimizer, `train_step` and `eval_step`.

`train_step(state, batch) -> (state, metrics)` is a pure function jitted once with explicit in/out
shardings and donated state. The state is a dict of pure pytrees: `{'step', 'params', 'opt_state'}`; the
data position is the step, since a batch is a function of (seed, step). The loss is the weighted token
mean over the *global* batch: with `train.microbatches = M` each microbatch contributes its weighted loss
sum divided by the global weight total, so accumulation is exact, not an average of averages. Eval runs
the same loss path as training, forward only (`parallax.loss`).

With the steady pipeline schedule `2bw` (PipeDream-2BW) the state also holds `'pipeline'`: what is in
flight between steps. A batch's forwards run with the current weights in its own step and its last
backwards in the next step, with the same weights, kept as `previous` (the second weight version); so the
update of step t applies the gradient of batch t-1 computed at the weights of step t-1: `optim.grad_delay=1`
exactly while every step is finite (with `nan_policy=skip`, 2bw drops a non-finite completed gradient and
still finishes the batch in flight; grad_delay drops the fresh one). `'pipeline'` holds `previous`, the
gradient and loss sums of the current batch's part run so far (`grads`, `loss`), the current batch (its
last microbatches run in the next step) and the executor's activation slots and inbox (`inflight`).
Checkpoints save all of it, so resume is exact. The step's `loss` metric is the previous batch's (the one
whose gradient it applies): NaN at the first step, which applies nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax import data as data_lib
from parallax import optim, sharding
from parallax.errors import ConfigError
from parallax.loss import LossPath
from parallax.plan import Plan, abstract_batch, make_plan


def _opt_state_shardings(abstract_opt_state, param_shardings, mesh):
    """Optimizer leaves mirroring a parameter get its sharding; everything else is replicated."""
    by_path = {}
    for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]:
        by_path[tuple(k.key for k in path)] = s
    replicated = NamedSharding(mesh, P())

    def one(path, leaf):
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        for start in range(len(keys)):
            s = by_path.get(keys[start:])
            if s is not None and len(s.spec) <= leaf.ndim:
                return s
        return replicated
    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


class Trainer:
    """Everything derived from a plan and a mesh: shardings, optimizer, and the jitted steps."""

    def __init__(self, config_or_plan, devices=None, mesh=None):
        """Takes a config (checked here) or a `Plan`. `devices` default to all; `mesh` (e.g. an
        AbstractMesh, for shape checks) overrides them."""
        if mesh is None:
            devices = list(jax.devices() if devices is None else devices)
        plan = config_or_plan
        if not isinstance(plan, Plan):
            plan = make_plan(config_or_plan, len(devices) if mesh is None else mesh.size)
        self.plan, self.config = plan, plan.config
        self.mesh = plan.make_mesh(devices) if mesh is None else mesh
        self.loss = LossPath(plan, self.mesh)
        self.abstract_params, self.logical = plan.abstract_params, plan.logical
        self.param_shardings = sharding.param_shardings(self.abstract_params, self.logical, self.mesh, plan.rules)
        self.lr_schedule = optim.lr_schedule(self.config.optim, self.config.train.steps)
        steady = plan.schedule is not None and plan.schedule.steady  # 2bw: gradients arrive one step stale
        self.tx = optim.make_optimizer(self.config.optim, self.config.train.steps, self.logical, self.mesh,
                                       stale_gradients=steady)
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        replicated = NamedSharding(self.mesh, P())
        self.state_shardings = {
            "step": replicated,
            "params": self.param_shardings,
            "opt_state": _opt_state_shardings(abstract_opt, self.param_shardings, self.mesh),
        }
        self.batch_sharding = sharding.batch_sharding(self.mesh, plan.rules)  # rows: what each host loads
        # Per batch key: the rows' sharding, and with a pipeline the inputs only one stage reads also split
        # over `pipe` (`LossPath.routed_inputs`), so that only that rank receives them whole.
        self.batch_shardings = {k: NamedSharding(self.mesh, self.loss.batch_spec(k)) for k in abstract_batch(self.config)}
        self.steady = steady
        if self.steady:
            self._check_steady()
            self.state_shardings["pipeline"] = self._steady_shardings()
        self.num_params = plan.num_params

        self._init = jax.jit(self._init_state, static_argnums=0, out_shardings=self.state_shardings)
        self.loss_and_grads = jax.jit(self._loss_and_grads, out_shardings=(replicated, self.param_shardings))
        self.train_step = jax.jit(self._train_step, donate_argnums=0,
                                  in_shardings=(self.state_shardings, self.batch_shardings),
                                  out_shardings=(self.state_shardings, replicated))
        self.eval_step = jax.jit(self._eval_step, out_shardings=replicated)

    @property
    def pipeline(self):
        """The pipeline schedule, or None."""
        return self.plan.schedule

    @property
    def graphdef(self):
        return self.plan.graphdef

    # --- pure functions -------------------------------------------------------------------------------

    def _init_state(self, seed: int):
        params = nnx.to_pure_dict(nnx.state(self.plan.new_model(seed)))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.tx.init(params)}
        if self.steady:
            state["pipeline"] = self.empty_pipeline(params)
        return state

    # --- the steady schedule (2bw) ---------------------------------------------------------------------

    def _check_steady(self):
        if self.loss._stage_aux():
            raise ConfigError("config.pipeline.schedule='2bw' does not run layers with aux values (this model's "
                              "MoE layers) yet; use pipeline.schedule=1f1b, zb_h1 or zbv")

    def _steady_abstract(self):
        """Shapes of the state's `'pipeline'` part; its in-flight leaves from tracing the executor."""
        batch = abstract_batch(self.config)
        inflight = jax.eval_shape(lambda p, b: self.loss.steady_step(p, p, b, b, None)[2], self.abstract_params, batch)
        f32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), self.abstract_params)
        scalar = jax.ShapeDtypeStruct((), jnp.float32)
        return {"previous": self.abstract_params, "grads": f32, "loss": scalar, "batch": batch, "inflight": inflight}

    def _steady_shardings(self):
        replicated = NamedSharding(self.mesh, P())
        abstract = self._steady_abstract()
        manual = NamedSharding(self.mesh, P(self.loss.steady_manual_axes()))
        return {"previous": self.param_shardings, "grads": self.param_shardings, "loss": replicated,
                "batch": dict(self.batch_shardings),
                "inflight": jax.tree.map(lambda _: manual, abstract["inflight"])}

    def empty_pipeline(self, params):
        """The `'pipeline'` state of an empty pipeline (before the first step): `previous` = `params`, the
        rest zeros (a batch of zero weights, so the first step's previous-batch part adds nothing)."""
        abstract = self._steady_abstract()
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), {k: abstract[k] for k in
                                                                      ("grads", "loss", "batch", "inflight")})
        return {"previous": params, **zeros}

    def _train_step_steady(self, state, batch):
        pipe = state["pipeline"]
        (loss_prev, grads_prev), (loss_cur, grads_cur), inflight = self.loss.steady_step(
            pipe["previous"], state["params"], pipe["batch"], batch, pipe["inflight"])
        total = jnp.maximum(jnp.sum(pipe["batch"]["weights"]), 1.0)  # the previous batch's: it completes now
        loss = (pipe["loss"] + loss_prev) / total
        grads = jax.tree.map(lambda a, g: (a + g) / total, pipe["grads"], grads_prev)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        started = state["step"] > 0  # the first step completes no batch: it applies nothing
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        apply = started & (finite if self.config.train.nan_policy == "skip" else True)
        kept = jax.tree.map(lambda a, b: jnp.where(apply, a, b), {"params": params, "opt_state": opt_state},
                            {"params": state["params"], "opt_state": state["opt_state"]})
        new = {"step": state["step"] + 1, **kept,
               "pipeline": {"previous": state["params"], "grads": grads_cur, "loss": loss_cur, "batch": batch,
                            "inflight": inflight}}
        metrics = {"loss": jnp.where(started, loss, jnp.nan), "grad_norm": grad_norm,
                   "lr": self.lr_schedule(optim.schedule_count(state["opt_state"])), "finite": finite | ~started}
        return new, metrics

    def _loss_and_grads(self, params, batch):
        """Mean token loss over the global batch and its gradients, accumulated over microbatches in fp32."""
        return self._loss_grads_aux(params, batch)[:2]

    def _loss_grads_aux(self, params, batch):
        """(mean loss, gradients, aux): `_loss_and_grads` and the layers' global aux sums (summed over
        microbatches; {} for a model without aux values). The loss includes the aux losses."""
        total = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
        m = int(self.config.train.microbatches)
        if m == 1:
            loss, grads, aux = self.loss.sum_and_grads(params, batch)
            return loss / total, jax.tree.map(lambda g: g / total, grads), aux

        def body(carry, mb):
            loss_acc, grad_acc, aux_acc = carry
            loss, grads, aux = self.loss.sum_and_grads(params, mb)
            grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32) / total, grad_acc, grads)
            return (loss_acc + loss / total, grad_acc, jax.tree.map(jnp.add, aux_acc, aux)), None

        mbs = self.loss.split_microbatches(batch, m)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        aux_shapes = jax.eval_shape(lambda: self.loss.sum_and_grads(params, jax.tree.map(lambda a: a[0], mbs))[2])
        aux_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shapes)
        (loss, grads, aux), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros, aux_zeros), mbs)
        return loss, grads, aux

    def _train_step(self, state, batch):
        if self.steady:
            return self._train_step_steady(state, batch)
        loss, grads, aux = self._loss_grads_aux(state["params"], batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        if aux:  # e.g. a router's balancing bias, updated outside the optimizer (`Model.after_step`)
            params = self.plan.model_class.after_step(self.plan.model_config, params, aux)
        new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if self.config.train.nan_policy == "skip":  # the batch is consumed (step advances), nothing applied:
            new = {"step": new["step"], **jax.tree.map(lambda a, b: jnp.where(finite, a, b),  # the optimizer's
                                                        {k: new[k] for k in ("params", "opt_state")},  # counts stay
                                                        {k: state[k] for k in ("params", "opt_state")})}
        # The lr this update used: the schedule at the optimizer's count (updates applied so far), which lags
        # the step under grad_delay and after skipped steps, exactly as Adam's bias correction does.
        metrics = {"loss": loss, "grad_norm": grad_norm,
                   "lr": self.lr_schedule(optim.schedule_count(state["opt_state"])), "finite": finite}
        if aux:
            weight_total = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
            model_metrics = self.plan.model_class.aux_metrics(self.plan.model_config, aux, weight_total)
            metrics["model"] = {k: jnp.asarray(v, jnp.float32) for k, v in model_metrics.items()}
        return new, metrics

    def _eval_step(self, params, batch):
        """[weighted loss sum, weight total] of one batch, by the training loss path (forward only), in
        `train.microbatches` pieces as training does (so eval fits wherever a training step fits)."""
        m = int(self.config.train.microbatches)
        if m == 1:
            loss = self.loss.sum(params, batch)
        else:
            sums, _ = jax.lax.scan(lambda acc, mb: (acc + self.loss.sum(params, mb), None),
                                   jnp.zeros((), jnp.float32), self.loss.split_microbatches(batch, m))
            loss = sums
        return jnp.stack([loss, jnp.sum(batch["weights"])])

    # --- host side -----------------------------------------------------------------------------------

    def abstract_state(self):
        """ShapeDtypeStructs of the state with its shardings: the restore target."""
        shapes = jax.eval_shape(lambda: self._init_state(0))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                            self.state_shardings)

    def init_state(self, seed: int | None = None):
        """Creates the state directly sharded (nothing is materialised whole on one device)."""
        return self._init(int(self.config.train.seed if seed is None else seed))

    def device_batch(self, batch: dict) -> dict:
        """A host batch (this host's rows, see `host_rows`) -> global arrays with the batch sharding."""
        return data_lib.to_global(batch, self.batch_shardings, self.config.train.global_batch_size)

    def host_rows(self) -> tuple[int, int]:
        """The rows of the global batch this host must load."""
        return data_lib.host_rows(self.batch_sharding, (self.config.train.global_batch_size, self.config.train.seq_len))


def shape_check(config, num_devices: int) -> dict:
    """Checks a config for `num_devices` devices by shape inference only (nothing is allocated).

    Makes the plan (every config check), derives every parameter's sharding on an abstract mesh and traces
    the training loss and gradients and the eval loss with `jax.eval_shape`, on the same path a real run
    takes (dense, manual or pipelined). Returns parameter and token counts.
    """
    plan = make_plan(config, num_devices)
    trainer = Trainer(plan, mesh=plan.abstract_mesh())
    batch = abstract_batch(config)
    loss, grads = jax.eval_shape(trainer._loss_and_grads, trainer.abstract_params, batch)
    assert jax.tree.structure(grads) == jax.tree.structure(trainer.abstract_params)
    eval_out = jax.eval_shape(trainer._eval_step, trainer.abstract_params, batch)
    return {"params": trainer.num_params, "loss_shape": loss.shape, "eval_shape": eval_out.shape,
            "tokens_per_step": config.train.global_batch_size * config.train.seq_len}
