"""The step-path interface, and the two paths without a pipeline: dense and manual.

A step path is how one train / eval step runs the model on a mesh. It owns what the trainer needs and
nothing else: the specs of the batch arrays, the weighted loss *sum* of a batch (`sum`, forward only:
eval) and the sum with its gradients (`sum_and_grads`), the train-state entries it adds to
`{'step', 'params', 'opt_state'}` with their shardings, the body of the train step, and its own rules
for resuming. The trainer keeps one train step and one optimizer update (`Trainer.update`); a path that
needs another kind of step (2bw's window, DiLoCo's outer step) overrides `train_step` and brings its
state along.

- `DensePath`: `tensor == seq == pipe == 1` (and `expert == 1` for a model declaring it). The model's plain
  code under `activation_sharding`; GSPMD shards it over the data / FSDP axes from the logical names.
- `ManualPath`: `tensor > 1`, `seq > 1` or (a model declaring it) `expert > 1`, without a pipeline. The
  model runs per rank inside `parallax.parallel.manual.shard_loss` and adds its collectives through
  `plan.parallelism`.

Layers with aux values (`parallax.model`, e.g. MoE): training differentiates the loss plus their aux losses
and returns the global aux sums for metrics; eval reports the model's loss alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax import lora
from parallax import model as model_lib
from parallax import sharding
from parallax.parallel.manual import shard_loss
from parallax.parallel.region import SINGLE, Region


def accumulate(fn, microbatches):
    """The sum over microbatches (leading dim of every leaf of `microbatches`) of `fn(microbatch)`, a
    pytree, in one `lax.scan` from zeros of `fn`'s output type: gradient accumulation, eval's sums."""
    shapes = jax.eval_shape(fn, jax.tree.map(lambda a: a[0], microbatches))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    out, _ = jax.lax.scan(lambda acc, mb: (jax.tree.map(jnp.add, acc, fn(mb)), None), zeros, microbatches)
    return out


class StepPath:
    """The interface (and the synchronous defaults) of a step path for `plan` on `mesh`."""

    # Top-level train-state entries this path adds (their shapes: `abstract_state`); a checkpoint written by
    # a path with other entries cannot be resumed by this one.
    state_keys: tuple = ()
    # What the entries `state_keys` hold, in a memory report's words.
    state_label = ""

    def __init__(self, plan, mesh):
        self.plan, self.mesh = plan, mesh

    @classmethod
    def runs(cls, plan) -> bool:
        """Whether this is the path `plan` needs (`parallax.steps.make_path` asks each in turn)."""
        raise NotImplementedError

    # --- the batch ------------------------------------------------------------------------------------

    def batch_spec(self, key: str) -> P:
        """The spec of the [B, T] batch array `key`: rows over the batch axes."""
        return sharding.logical_to_spec(("batch", "length"), self.plan.rules, self.mesh)

    def rows_sharding(self) -> NamedSharding:
        """The sharding of a [B, T] batch's rows: which rows each host loads (`Trainer.host_rows`)."""
        return sharding.batch_sharding(self.mesh, self.plan.rules)

    def batch_shardings(self) -> dict:
        return {k: NamedSharding(self.mesh, self.batch_spec(k)) for k in self.plan.abstract_batch()}

    def split_microbatches(self, batch, m: int, region: Region = SINGLE):
        """(B, T) arrays -> (M, B/M, T); microbatch i takes rows i, i+M, ... so each batch shard stays local
        (`region` with copies: rows split over DiLoCo's `replica` axis first)."""
        def split(key, x):
            x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
            spec = region.rows_spec(self.batch_spec(key))
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(None, *spec)))
        return {k: split(k, x) for k, x in batch.items()}

    # --- the loss -------------------------------------------------------------------------------------

    def sum(self, params, batch):
        """Weighted loss sum over the global batch (forward only), without the layers' aux losses."""
        raise NotImplementedError

    def sum_and_grads(self, params, batch):
        """(weighted loss sum, gradients, aux) over the global batch. The sum and gradients include the
        layers' aux losses; `aux` is the global aux sums (stacked over layers; {} without aux values)."""
        raise NotImplementedError

    def loss_grads_aux(self, params, batch):
        """(mean loss, gradients, aux) of a batch: the weighted token mean over the *global* batch, in
        `train.microbatches` pieces accumulated in fp32 (each contributes its sum over the global weight
        total, so accumulation is exact); aux summed over the pieces. The loss includes the aux losses."""
        if self.plan.dpo is not None:  # preference pairs: DPO's loss, by two passes of this path
            from parallax.steps import dpo
            return dpo.loss_grads_metrics(self, params, batch)[:3]
        total = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
        m = self.plan.train.microbatches
        if m == 1:
            loss, grads, aux = self.sum_and_grads(params, batch)
            return loss / total, jax.tree.map(lambda g: g / total, grads), aux

        trainable = self.plan.trainable or jax.tree.map(lambda _: True, params)

        def piece(mb):  # frozen leaves (LoRA's base) get no accumulator: their gradients are zeros
            loss, grads, aux = self.sum_and_grads(params, mb)
            grads = jax.tree.map(lambda g, t: g.astype(jnp.float32) / total if t else None, grads, trainable)
            return loss / total, grads, aux
        loss, grads, aux = accumulate(piece, self.split_microbatches(batch, m))
        grads = jax.tree.map(lambda g, p, t: g if t else jnp.zeros(p.shape, jnp.float32), grads, params, trainable,
                             is_leaf=lambda x: x is None)
        return loss, grads, aux

    def eval_sums(self, params, batch):
        """[weighted loss sum, weight total] of one batch, forward only, in `train.microbatches` pieces as
        training does (so eval fits wherever a training step fits). With DPO: [sum of the pairs' losses,
        number of pairs]."""
        if self.plan.dpo is not None:
            from parallax.steps import dpo
            return dpo.eval_sums(self, params, batch)
        m = self.plan.train.microbatches
        if m == 1:
            loss = self.sum(params, batch)
        else:
            loss = accumulate(lambda mb: self.sum(params, mb), self.split_microbatches(batch, m))
        return jnp.stack([loss, jnp.sum(batch["weights"])])

    # --- the step and its state -----------------------------------------------------------------------

    def abstract_extra(self) -> dict:
        """Shapes of the train-state entries `state_keys` (none by default)."""
        return {}

    def extra_shardings(self, param_shardings) -> dict:
        """Shardings of the entries `state_keys`, given the parameters'."""
        return {}

    def init_extra(self, params) -> dict:
        """The entries `state_keys` at the start of a run from `params`."""
        return {}

    def metrics_sharding(self) -> NamedSharding:
        """The sharding of the train step's metrics (each a scalar here: replicated)."""
        return NamedSharding(self.mesh, P())

    def fetch_metrics(self, metrics: dict) -> dict:
        """The train step's metrics on the host, as the loop logs them (scalars)."""
        return jax.device_get(metrics)

    def init_opt_state(self, tx, params):
        """The train state's `opt_state` at the start of a run: the optimizer's, for `params`."""
        return tx.init(params)

    def opt_state_shardings(self, shardings):
        """The shardings of `init_opt_state`'s leaves, given those of `tx.init(params)`."""
        return shardings

    def step_kind(self, step: int):
        """Which program runs the step that starts at `step` (a hashable; None: the one program, which
        decides from the state's step on the device). A path whose steps differ in kind (DiLoCo's sync
        steps) names them, and the training loop runs each kind's own compiled program
        (`Trainer.train_step_at`), so nothing sits in a conditional on the device."""
        return None

    def step_kinds(self) -> tuple:
        """Every value `step_kind` takes (what `launch/plan.py` compiles: the largest peak is the report)."""
        return (None,)

    def train_step(self, update, state, batch, kind=None):
        """(state, metrics) after one step; `update(state, batch, loss, grads, aux)` is the trainer's
        optimizer update; `kind`: `step_kind` of this step, or None. Synchronous: the gradient of this
        batch at this step's weights. With DPO, TRL's metrics ride along (`metrics['path']`)."""
        if self.plan.dpo is not None:
            from parallax.steps import dpo
            loss, grads, aux, extra = dpo.loss_grads_metrics(self, state["params"], batch)
            state, metrics = update(state, batch, loss, grads, aux)
            return state, {**metrics, "path": extra}
        loss, grads, aux = self.loss_grads_aux(state["params"], batch)
        return update(state, batch, loss, grads, aux)

    # --- resuming -------------------------------------------------------------------------------------

    @classmethod
    def check_resume(cls, saved: dict, now: dict) -> None:
        """Raises ConfigError if resuming a run of flat config `saved` with `now` breaks this path's state
        (both flattened `{'a.b': value}`); `parallax.steps.check_resume` asks every path."""

    def check_restore(self, saved_tree: dict, abstract_state: dict) -> None:
        """Raises ConfigError if the checkpoint's tree (Orbax metadata) cannot be restored onto this mesh."""


class DensePath(StepPath):
    """The model's plain code; the compiler shards it over the data / FSDP axes."""

    @classmethod
    def runs(cls, plan) -> bool:
        return plan.schedule is None and not plan.parallelism.manual

    def terms(self, params, batch):
        """(the model's loss sum, the layers' aux sums) of `model_lib.loss_terms`."""
        plan = self.plan
        with sharding.activation_sharding(self.mesh, plan.rules):
            return model_lib.loss_terms(nnx.merge(plan.graphdef, params), batch, plan.remat, plan.parallelism)

    def sum(self, params, batch):
        return self.terms(params, batch)[0]

    def sum_and_grads(self, params, batch):
        def objective(p, b):  # frozen leaves (LoRA's base) under stop_gradient: no gradient computed for them
            lm, aux = self.terms(lora.freeze(p, self.plan.trainable), b)
            return lm + model_lib.aux_loss(aux), aux
        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, batch)
        return loss, grads, jax.lax.stop_gradient(aux)


class ManualPath(DensePath):
    """Tensor / sequence / expert parallelism: the loss per rank inside one shard_map manual over every axis."""

    @classmethod
    def runs(cls, plan) -> bool:
        return plan.schedule is None and plan.parallelism.manual

    def terms(self, params, batch):
        plan = self.plan

        def per_rank(p, b):
            return model_lib.loss_terms(nnx.merge(plan.graphdef, p), b, plan.remat, plan.parallelism)
        return shard_loss(per_rank, plan.parallelism, self.mesh, plan.logical)(params, batch)
