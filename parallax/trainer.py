"""The train state and the jitted steps: shardings, the optimizer, `train_step` and `eval_step`.

`train_step(state, batch) -> (state, metrics)` is a pure function jitted with explicit in/out shardings
and donated state: once, or once per kind of step for a path whose steps differ (`train_step_at`). The state is a dict of pure pytrees: `{'step', 'params', 'opt_state'}`, plus
the entries the step path adds (`StepPath.state_keys`, e.g. a pipeline's microbatches in flight); the
data position is the step, since a batch is a function of (seed, step). How a step computes its loss and
gradients is the step path's (`parallax.steps`): dense, manual or pipelined; the trainer applies
them (`update`). The loss is the weighted token mean over the *global* batch. Eval runs the same loss path
as training, forward only.
"""

from __future__ import annotations

import functools

from absl import logging
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax import data as data_lib
from parallax import optim, sharding
from parallax.errors import ConfigError
from parallax.steps import make_path
from parallax.plan import Plan, make_plan


# The running statistics of `train.spike_policy` (`state['spike']`): exponential moving mean and variance of
# the loss and of the gradient norm over the applied steps, and how many steps were applied.
SPIKE_STATS = ("loss_mean", "loss_var", "grad_mean", "grad_var", "count")


def spike_test(stats, loss, grad_norm, train, applies=None):
    """(spike, new stats): whether this step is a spike -- non-finite, or once `train.spike_window` steps
    were applied, loss or gradient norm above its running mean by more than `train.spike_zscore` running
    standard deviations (upward only: a sudden drop is no trouble) -- and the statistics with this step in
    them if it is applied (`applies`: the other reasons it may not be, e.g. a pipeline step that completed
    no batch). The moving statistics are the usual exponentially weighted mean and variance with weight
    2 / (window + 1), started at the first value."""
    alpha = 2.0 / (train.spike_window + 1.0)
    count = stats["count"]
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def z(x, mean, var):
        return (x - mean) / jnp.sqrt(jnp.maximum(var, 1e-12))
    warm = count >= train.spike_window
    spike = ~finite | (warm & ((z(loss, stats["loss_mean"], stats["loss_var"]) > train.spike_zscore)
                               | (z(grad_norm, stats["grad_mean"], stats["grad_var"]) > train.spike_zscore)))
    applied = ~spike if applies is None else applies & ~spike

    def moved(x, mean, var):
        first = count == 0
        delta = x - mean
        new_mean = jnp.where(first, x, mean + alpha * delta)
        new_var = jnp.where(first, 0.0, (1 - alpha) * (var + alpha * delta * delta))
        return new_mean, new_var
    loss_mean, loss_var = moved(loss.astype(jnp.float32), stats["loss_mean"], stats["loss_var"])
    grad_mean, grad_var = moved(grad_norm.astype(jnp.float32), stats["grad_mean"], stats["grad_var"])
    new = {"loss_mean": loss_mean, "loss_var": loss_var, "grad_mean": grad_mean, "grad_var": grad_var,
           "count": count + 1}
    return spike, jax.tree.map(lambda a, b: jnp.where(applied, a, b), new, dict(stats))


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
            concrete = mesh.devices.flat[0].platform if isinstance(mesh, jax.sharding.Mesh) else None
            plan = make_plan(config_or_plan, len(devices) if mesh is None else mesh.size,
                             devices[0].platform if mesh is None else concrete)
        self.plan, self.config = plan, plan.config  # the config: for what saves and prints a run
        self.mesh = plan.make_mesh(devices) if mesh is None else mesh
        actual = self.mesh.devices.flat[0].platform if isinstance(self.mesh, jax.sharding.Mesh) else None
        if actual is not None and actual != plan.platform:
            logging.warning("parallax: a plan made for %s runs on %s devices: its backend choices (kernels, "
                            "collective dtypes) are %s's", plan.platform, actual, plan.platform)
        self.path = make_path(plan, self.mesh)
        self.abstract_params, self.logical = plan.abstract_params, plan.logical
        self.param_shardings = sharding.param_shardings(self.abstract_params, self.logical, self.mesh, plan.rules)
        self.lr_schedule = optim.lr_schedule(plan.optim, plan.train.steps)
        self.tx = optim.make_optimizer(plan.optim, plan.train.steps, self.logical, self.mesh, plan.trainable)
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        replicated = NamedSharding(self.mesh, P())
        # optim.offload_state: the state lives in host memory between steps ('pinned_host'); each step brings
        # it to the chips (`_train_step`), where XLA can start the copies late (the update comes after the
        # backward), and the step's outputs return it to the host.
        self._opt_on_device = self.path.opt_state_shardings(
            _opt_state_shardings(abstract_opt, self.param_shardings, self.mesh))
        offload = plan.optim.offload_state and isinstance(self.mesh, jax.sharding.Mesh)
        self.state_shardings = {
            "step": replicated,
            "params": self.param_shardings,
            "opt_state": jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), self._opt_on_device)
            if offload else self._opt_on_device,
            **self.path.extra_shardings(self.param_shardings),
        }
        if plan.train.spikes:
            from parallax.steps.base import StepPath
            if type(self.path).train_step is not StepPath.train_step:
                raise ConfigError(f"config.train.spike_policy={plan.train.spike_policy!r}: "
                                  f"{type(self.path).__name__}'s step applies other gradients than the batch's at "
                                  "the current weights (2bw's delayed step, DiLoCo's replicas), which the spike "
                                  "test does not cover; set spike_policy=off")
            self.state_shardings["spike"] = {k: replicated for k in SPIKE_STATS}
        self.batch_sharding = self.path.rows_sharding()  # rows: what each host loads
        # Per batch key: the rows' sharding, and with a pipeline the inputs only one stage reads also split
        # over `pipe`, so that only that rank receives them whole.
        self.batch_shardings = self.path.batch_shardings()
        self.num_params = plan.num_params

        self._init = jax.jit(self._init_state, static_argnums=0, out_shardings=self.state_shardings)
        self.loss_and_grads = jax.jit(self._loss_and_grads, out_shardings=(replicated, self.param_shardings))
        self.train_step = self._jit_step(None)
        self._steps_by_kind, self._ran = {None: self.train_step}, set()
        self.eval_step = jax.jit(self._eval_step, out_shardings=replicated)

    @property
    def pipeline(self):
        """The pipeline schedule, or None."""
        return self.plan.schedule

    @property
    def graphdef(self):
        return self.plan.graphdef

    # --- pure functions -------------------------------------------------------------------------------

    def init_params(self, seed: int | None = None) -> dict:
        """The parameters at init (a pure dict; traced, or run eagerly: call it under `jax.jit`)."""
        return nnx.to_pure_dict(nnx.state(self.plan.new_model(self.plan.train.seed if seed is None else seed)))

    def _init_state(self, seed: int):
        params = self.init_params(seed)
        state = {"step": jnp.zeros((), jnp.int32), "params": params,
                 "opt_state": self.path.init_opt_state(self.tx, params), **self.path.init_extra(params)}
        if self.plan.train.spikes:
            state["spike"] = {k: jnp.zeros((), jnp.int32 if k == "count" else jnp.float32) for k in SPIKE_STATS}
        return state

    def _loss_and_grads(self, params, batch):
        """Mean token loss over the global batch and its gradients, accumulated over microbatches in fp32."""
        return self.path.loss_grads_aux(params, batch)[:2]

    def _jit_step(self, kind):
        return jax.jit(functools.partial(self._train_step, kind=kind), donate_argnums=0,
                       in_shardings=(self.state_shardings, self.batch_shardings),
                       out_shardings=(self.state_shardings, self.path.metrics_sharding()))

    def compiled_for(self, step: int) -> bool:
        """Whether the program `train_step_at(step)` returns has run before (else its first call compiles)."""
        return self.path.step_kind(step) in self._ran

    def train_step_at(self, step: int):
        """The jitted train step for the step that starts at `step` (an int on the host): `train_step`, or,
        for a path whose steps differ in kind (`StepPath.step_kind`), that kind's own program (compiled on
        its first use)."""
        kind = self.path.step_kind(step)
        self._ran.add(kind)
        return self.step_program(kind)

    def step_program(self, kind):
        """The jitted train step of `kind` (`StepPath.step_kinds`; None: `train_step`)."""
        if kind not in self._steps_by_kind:
            self._steps_by_kind[kind] = self._jit_step(kind)
        return self._steps_by_kind[kind]

    def _train_step(self, state, batch, kind=None, update=None):
        if self.state_shardings["opt_state"] is not self._opt_on_device:  # optim.offload_state
            state = {**state, "opt_state": jax.device_put(state["opt_state"], self._opt_on_device)}
        return self.path.train_step(update or self.update, state, batch, kind)

    def train_step_with_grads(self):
        """`train_step` that also returns the mean loss and the gradients the optimizer applied:
        `(state, metrics, loss, grads)`. One program to check a step's loss and every gradient leaf and then
        its training steps (the parity tests: a second program for `loss_and_grads` would cost a second
        trace and compile), or to inspect a step's gradients. Paths whose step is the batch's gradient at the
        current weights only (not 2bw's delayed step, not DiLoCo's)."""
        from parallax.steps.base import StepPath

        if type(self.path).train_step is not StepPath.train_step:
            raise ValueError(f"{type(self.path).__name__}: its step applies other gradients than the batch's "
                             "at the current weights; use loss_and_grads")

        def step(state, batch):
            seen = {}

            def update(state, batch, loss, grads, aux, completed=True):
                seen.update(loss=loss, grads=grads)
                return self.update(state, batch, loss, grads, aux, completed)
            state, metrics = self._train_step(state, batch, update=update)
            return state, metrics, seen["loss"], seen["grads"]
        replicated = NamedSharding(self.mesh, P())
        return jax.jit(step, donate_argnums=0, in_shardings=(self.state_shardings, self.batch_shardings),
                       out_shardings=(self.state_shardings, self.path.metrics_sharding(), replicated,
                                      self.param_shardings))

    def update(self, state, batch, loss, grads, aux, completed=True):
        """The step after applying `grads` (of `batch`, mean `loss`) with the optimizer: (state of
        `step, params, opt_state`, metrics). `completed=False` (a traced bool) is a step that completed no
        batch: it applies nothing, and its metrics say so (`completed`; its loss is not a batch's)."""
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        if aux:  # e.g. a router's balancing bias, updated outside the optimizer (`Model.after_step`)
            params = self.plan.model_class.after_step(self.plan.model_config, params, aux)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # The batch is consumed (the step advances) and nothing applied where `apply` is False: the
        # optimizer's counts stay.
        apply = finite if self.plan.train.skip_nonfinite else None
        if completed is not True:
            apply = completed if apply is None else completed & apply
        spike_out = {}
        if self.plan.train.spikes:
            spike, stats = spike_test(state["spike"], loss, grad_norm, self.plan.train, applies=apply)
            apply = ~spike if apply is None else apply & ~spike
            spike_out = {"spike": stats}
        kept = {"params": params, "opt_state": opt_state}
        if apply is not None:
            kept = jax.tree.map(lambda a, b: jnp.where(apply, a, b), kept,
                                {"params": state["params"], "opt_state": state["opt_state"]})
        # The lr this update used: the schedule at the optimizer's count (updates applied so far), which lags
        # the step under grad_delay and after skipped steps, exactly as Adam's bias correction does.
        completed = jnp.asarray(completed)
        metrics = {"loss": jnp.where(completed, loss, jnp.nan), "grad_norm": jnp.where(completed, grad_norm, jnp.nan),
                   "lr": self.lr_schedule(optim.schedule_count(state["opt_state"])), "finite": finite | ~completed,
                   "completed": completed}
        if aux:
            weight_total = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
            model_metrics = self.plan.model_class.aux_metrics(self.plan.model_config, aux, weight_total)
            metrics["model"] = {k: jnp.asarray(v, jnp.float32) for k, v in model_metrics.items()}
        if spike_out:
            metrics["spike"] = spike
        return {"step": state["step"] + 1, **kept, **spike_out}, metrics

    def _eval_step(self, params, batch):
        """[weighted loss sum, weight total] of one batch, by the training loss path (forward only)."""
        return self.path.eval_sums(params, batch)

    # --- host side -----------------------------------------------------------------------------------

    def abstract_state(self):
        """ShapeDtypeStructs of the state with its shardings: the restore target."""
        shapes = jax.eval_shape(lambda: self._init_state(0))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                            self.state_shardings)

    def init_state(self, seed: int | None = None):
        """Creates the state directly sharded (nothing is materialised whole on one device)."""
        return self._init(self.plan.train.seed if seed is None else int(seed))

    def device_batch(self, batch: dict) -> dict:
        """A host batch (this host's rows, see `host_rows`) -> global arrays with the batch sharding."""
        return data_lib.to_global(batch, self.batch_shardings, self.plan.train.global_batch_size)

    def host_rows(self) -> tuple[int, int]:
        """The rows of the global batch this host must load."""
        t = self.plan.train
        return data_lib.host_rows(self.batch_sharding, (t.global_batch_size, t.seq_len))


def shape_check(config, num_devices: int) -> dict:
    """Checks a config for `num_devices` devices by shape inference only (nothing is allocated).

    Makes the plan (every config check), derives every parameter's sharding on an abstract mesh and traces
    the training loss and gradients and the eval loss with `jax.eval_shape`, on the same path a real run
    takes (dense, manual or pipelined; with DiLoCo replicas, their inner path's synchronous gradient).
    Returns parameter and token counts.
    """
    plan = make_plan(config, num_devices)
    trainer = Trainer(plan, mesh=plan.abstract_mesh())
    batch = plan.abstract_batch()
    loss, grads = jax.eval_shape(trainer._loss_and_grads, trainer.abstract_params, batch)
    assert jax.tree.structure(grads) == jax.tree.structure(trainer.abstract_params)
    eval_out = jax.eval_shape(trainer._eval_step, trainer.abstract_params, batch)
    return {"params": trainer.num_params, "loss_shape": loss.shape, "eval_shape": eval_out.shape,
            "tokens_per_step": config.train.global_batch_size * config.train.seq_len}
