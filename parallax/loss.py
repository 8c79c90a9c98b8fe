"""The three loss paths behind one object: dense (compiler-sharded), manual (tensor / sequence parallel
in one shard_map), and pipelined (the schedule executor). Training and eval take the same path.

`LossPath(plan, mesh)` gives the weighted loss *sum* of a batch (`sum`, forward only: eval) and the sum
with its gradients (`sum_and_grads`: training). The caller divides by the weight total.

- dense: `tensor == seq == pipe == 1`. The model's plain code under `activation_sharding`; GSPMD
  shards it over the data / FSDP axes from the parameters' and activations' logical names.
- manual: `tensor > 1` or `seq > 1` without a pipeline. The model runs per rank inside
  `parallax.parallel.manual.shard_loss` and adds its collectives through `plan.parallelism`.
- pipelined: `pipe > 1`. The embedding (first stage) and head + loss (last stage) use the parameters
  outside `blocks`; the stacked blocks go to the executor in its [p, v, L/(p*v), ...] layout. Eval runs
  the executor's F ticks only (`pipeline_loss`), so it works on every mesh training works on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax import model as model_lib
from parallax import sharding
from parallax.parallel.manual import shard_loss
from parallax.pipeline import executor


class LossPath:
    """The weighted loss sum (and its gradients) of a batch on `mesh`, by the path `plan` needs."""

    def __init__(self, plan, mesh):
        self.plan, self.mesh = plan, mesh
        if plan.schedule is not None:
            self.kind = "pipelined"
        elif plan.parallelism.manual:
            self.kind = "manual"
        else:
            self.kind = "dense"

    def sum(self, params, batch):
        """Weighted loss sum over the global batch (forward only)."""
        if self.kind == "pipelined":
            return executor.pipeline_loss(self.plan.schedule, **self._pipeline_args(params, batch))
        return self._unpipelined_sum(params, batch)

    def sum_and_grads(self, params, batch):
        """(weighted loss sum, gradients) over the global batch; pipelined gradients are fp32."""
        if self.kind == "pipelined":
            return self._pipeline_sum_and_grads(params, batch)
        return jax.value_and_grad(self._unpipelined_sum)(params, batch)

    def split_microbatches(self, batch, m: int):
        """(B, T) arrays -> (M, B/M, T); microbatch i takes rows i, i+M, ... so each batch shard stays local."""
        spec = sharding.logical_to_spec((None, "batch", "length"), self.plan.rules, self.mesh)

        def split(x):
            x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
        return jax.tree.map(split, batch)

    # --- dense and manual -----------------------------------------------------------------------------

    def _unpipelined_sum(self, params, batch):
        plan = self.plan
        if self.kind == "manual":
            def per_rank(p, b):
                return model_lib.loss_sum(nnx.merge(plan.graphdef, p), b, plan.remat, plan.parallelism)
            return shard_loss(per_rank, plan.parallelism, self.mesh, plan.logical)(params, batch)
        with sharding.activation_sharding(self.mesh, plan.rules):
            return model_lib.loss_sum(nnx.merge(plan.graphdef, params), batch, plan.remat)

    # --- pipelined ------------------------------------------------------------------------------------

    def _pipeline_args(self, params, batch) -> dict:
        """The executor's functions, parameters, inputs and specs for the model.

        With tensor / sequence parallelism every stage runs per rank as in `shard_loss`: weights split over
        `tensor`, microbatch arrays [rows, T/s] (Ulysses; the plan rejects ring), residual stream
        [rows, T/(s*t), D] -- also between pipeline ranks. The weights enter whole over FSDP (the compiler
        gathers them once per step, outside the loop).
        """
        plan, schedule = self.plan, self.plan.schedule
        par = plan.parallelism.model_axes_only()
        rest = {k: v for k, v in params.items() if k != "blocks"}
        no_blocks = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), plan.abstract_params["blocks"])
        blocks_graphdef = nnx.split(nnx.merge(plan.graphdef, plan.abstract_params).blocks)[0]

        def model(rest_params):  # the embedding / head parts of the model; its blocks are never called
            return nnx.merge(plan.graphdef, {**rest_params, "blocks": no_blocks})

        def first_fn(rest_params, mb):
            return model(rest_params).embed(mb, par)

        def stage_fn(chunk, x, mb):
            return model_lib.apply_blocks(blocks_graphdef, chunk, x, mb, plan.remat, par)

        def last_fn(rest_params, x, mb):  # this rank's tokens; the executor sums over the batch axes and seq
            return model(rest_params).loss(x, mb, par)

        rest_specs = par.param_specs({k: v for k, v in plan.logical.items() if k != "blocks"})
        # Stage weights: the dims after the executor's [p, v], i.e. [Lc, ...] with the layers dim whole.
        stage_specs = jax.tree.map(lambda s: P(None, *s[1:]), par.param_specs(plan.logical["blocks"]))
        return dict(
            first_fn=first_fn, stage_fn=stage_fn, last_fn=last_fn,
            params={"first": rest, "stages": executor.to_pipeline_layout(params["blocks"], schedule),
                    "last": rest},
            inputs=self.split_microbatches(batch, schedule.num_microbatches), mesh=self.mesh,
            batch_axes=plan.batch_axes, param_specs={"first": rest_specs, "stages": stage_specs, "last": rest_specs},
            input_spec=P("seq") if par.seq > 1 else P())

    def _pipeline_sum_and_grads(self, params, batch):
        schedule = self.plan.schedule
        loss, grads = executor.pipeline_value_and_grad(
            schedule, remat=bool(self.plan.config.pipeline.remat), **self._pipeline_args(params, batch))
        rest_grads = jax.tree.map(jnp.add, grads["first"], grads["last"])
        return loss, {**rest_grads, "blocks": executor.from_pipeline_layout(grads["stages"], schedule)}
