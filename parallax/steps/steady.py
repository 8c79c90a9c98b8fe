"""The steady pipeline path: PipeDream-2BW (`pipeline.schedule=2bw`), a pipeline with no flush.

A batch's forwards run with the current weights in its own step and its last backwards in the next step,
with the same weights, kept as `previous` (the second weight version); so the update of step t applies
the gradient of batch t-1 computed at the weights of step t-1: `optim.grad_delay=1` exactly while every
step is finite (with `nan_policy=skip`, a non-finite completed gradient is dropped and the batch in flight
still finishes; grad_delay drops the fresh one). The train state gains `'pipeline'`: `previous`, the
gradient and loss sums of the current batch's part run so far (`grads`, `loss`), the current batch (its
last microbatches run in the next step) and the executor's activation slots and inbox (`inflight`).
Checkpoints save all of it, so resume is exact, on the same mesh and pipeline only.

A step's `loss` metric is the loss of the batch whose gradient it applies (step k logs batch k-1's); the
first step completes no batch: it applies nothing and its metrics say `completed=False` (no loss is
logged for it). `sum` and `sum_and_grads` run the 1F1B schedule of the same shape: evaluation, and a
synchronous gradient for the tools.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax import mesh as mesh_lib
from parallax.errors import ConfigError
from parallax.steps.pipeline import PipelinePath
from parallax.pipeline import executor
from parallax.pipeline.layout import manual_axes
from parallax.pipeline.schedule import KINDS, make_schedule

# What a steady checkpoint's in-flight microbatches are laid out for, besides the mesh and the pipeline:
# the layers' residuals.
_LAYOUT_KEYS = ("model.attention", "model.attention_block", "model.loss_chunk")


class SteadyPipelinePath(PipelinePath):
    """2bw: one window of an endless pipeline per step, two weight versions, microbatches in flight."""

    state_keys = ("pipeline",)
    state_label = "2bw in-flight state"

    @classmethod
    def runs(cls, plan) -> bool:
        return plan.schedule is not None and plan.schedule.steady

    def __init__(self, plan, mesh):
        super().__init__(plan, mesh)
        self.steady = plan.schedule
        self.schedule = make_schedule(KINDS[self.steady.name].flushing_twin, plan.schedule.num_ranks,
                                      plan.schedule.num_microbatches)
        # The mesh axes the in-flight leaves are split over (their leading dim): the executor's manual axes.
        self.inflight_axes = None if mesh is None else manual_axes(mesh, plan.batch_axes, self.param_specs,
                                                                   self.input_spec)
        self.abstract = None if mesh is None else self._abstract()

    def window(self, previous, params, previous_batch, batch, inflight):
        """One step's window: `((loss sum, grads) of the previous batch's part run in it, (loss sum, grads)
        of this batch's part, inflight)`; `previous` are the weights the previous batch's forwards used.
        Gradients are fp32, in the layout of `params`."""
        schedule = self.steady
        (prev, prev_inputs), (cur, cur_inputs) = (self.executor_inputs(previous, previous_batch, schedule),
                                                  self.executor_inputs(params, batch, schedule))
        inputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), prev_inputs, cur_inputs)
        done, started, inflight = executor.pipeline_steady_step(schedule, self.stage_call(), cur, prev, inputs,
                                                                inflight)
        return ((done[0], self.unstage(params, done[1], schedule)),
                (started[0], self.unstage(params, started[1], schedule)), inflight)

    # --- the state ------------------------------------------------------------------------------------

    def abstract_extra(self) -> dict:
        return self.abstract

    def _abstract(self) -> dict:
        """Shapes of `'pipeline'`; its in-flight leaves from tracing the window."""
        plan = self.plan
        batch = plan.abstract_batch()
        params = plan.abstract_params
        inflight = jax.eval_shape(lambda p, b: self.window(p, p, b, b, None)[2], params, batch)
        f32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), params)
        return {"pipeline": {"previous": params, "grads": f32, "loss": jax.ShapeDtypeStruct((), jnp.float32),
                             "batch": batch, "inflight": inflight}}

    def extra_shardings(self, param_shardings) -> dict:
        manual = NamedSharding(self.mesh, P(self.inflight_axes))
        return {"pipeline": {"previous": param_shardings, "grads": param_shardings,
                             "loss": NamedSharding(self.mesh, P()), "batch": self.batch_shardings(),
                             "inflight": jax.tree.map(lambda _: manual, self.abstract_extra()["pipeline"]["inflight"])}}

    def init_extra(self, params) -> dict:
        """An empty pipeline: `previous` = `params`, the rest zeros (a batch of zero weights, so the first
        step's previous-batch part adds nothing)."""
        abstract = self.abstract_extra()["pipeline"]
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                             {k: abstract[k] for k in ("grads", "loss", "batch", "inflight")})
        return {"pipeline": {"previous": params, **zeros}}

    def train_step(self, update, state, batch, kind=None):
        pipe = state["pipeline"]
        (loss_prev, grads_prev), (loss_cur, grads_cur), inflight = self.window(
            pipe["previous"], state["params"], pipe["batch"], batch, pipe["inflight"])
        total = jnp.maximum(jnp.sum(pipe["batch"]["weights"]), 1.0)  # the previous batch's: it completes now
        loss = (pipe["loss"] + loss_prev) / total
        grads = jax.tree.map(lambda a, g: (a + g) / total, pipe["grads"], grads_prev)
        # The first step completes no batch: it applies nothing.
        new, metrics = update(state, pipe["batch"], loss, grads, {}, completed=state["step"] > 0)
        new["pipeline"] = {"previous": state["params"], "grads": grads_cur, "loss": loss_cur, "batch": batch,
                           "inflight": inflight}
        return new, metrics

    # --- resuming -------------------------------------------------------------------------------------

    @classmethod
    def check_resume(cls, saved: dict, now: dict) -> None:
        """A run cannot switch to or from a steady schedule (its gradients are one step late and its state
        holds microbatches in flight), and a steady run keeps its mesh, pipeline and layer layout (the
        in-flight microbatches sit in the executor's per-device slots, laid out for them)."""
        was, schedule = saved.get("pipeline.schedule"), now.get("pipeline.schedule")
        steady = [s for s in (was, schedule) if s in KINDS and KINDS[s].steady]
        if steady and was != schedule:
            raise ConfigError(f"config.pipeline.schedule={schedule!r}: the checkpoint in this workdir was trained "
                              f"with pipeline.schedule={was!r}, and a run cannot switch to or from {steady[0]} (its "
                              f"gradients are one step late and its state holds microbatches in flight); resume "
                              f"with pipeline.schedule={was!r}")
        if schedule not in KINDS or not KINDS[schedule].steady:
            return
        for key in [k for k in now if k.startswith(("mesh.", "pipeline."))] + list(_LAYOUT_KEYS):
            if key in now and saved.get(key, now[key]) != now[key]:
                raise ConfigError(f"config.{key}={now[key]!r}: the checkpoint in this workdir holds a {schedule} "
                                  f"pipeline's in-flight microbatches, laid out for {key}={saved[key]!r}; resume with "
                                  f"{key}={saved[key]!r} (a {schedule} run keeps its mesh and pipeline)")

    def check_restore(self, saved_tree: dict, abstract_state: dict) -> None:
        """The in-flight state must have this mesh's per-device layout (the device count and the sharding
        rules decide it, besides the config keys `check_resume` compares)."""
        want = [a.shape for a in jax.tree.leaves(abstract_state["pipeline"]["inflight"])]
        got = [tuple(a.shape) for a in jax.tree.leaves(saved_tree.get("pipeline", {}).get("inflight", {}))]
        if got != want:
            raise ConfigError(f"this checkpoint's {self.steady.name} in-flight microbatches were laid out for "
                              f"another mesh (their shapes {got[:2]}..., this mesh's {want[:2]}...; now "
                              f"{mesh_lib.describe(self.mesh)}); resume on the devices and with the sharding rules it "
                              f"was saved with")
