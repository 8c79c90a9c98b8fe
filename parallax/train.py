"""The trainer: config checks, sharded state, the pure train step, the loop, eval, metrics, checkpoints.

`train_step(state, batch) -> (state, metrics)` is a pure function jitted once with explicit in/out
shardings and donated state. The state is a dict of pure pytrees: `{'step', 'params', 'opt_state'}`; the
data position is the step, since a batch is a function of (seed, step). The loss is the weighted token
mean over the *global* batch: with `train.microbatches = M` each microbatch contributes its weighted loss
sum divided by the global weight total, so accumulation is exact, not an average of averages.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.llama import Llama, LlamaConfig, apply_layers, local_loss_sum, loss_sum
from parallax import checkpoint as ckpt_lib
from parallax import data as data_lib
from parallax import mesh as mesh_lib
from parallax import optim, sharding
from parallax.config import ConfigError
from parallax.pipeline.executor import from_pipeline_layout, pipeline_value_and_grad, to_pipeline_layout
from parallax.pipeline.schedule import Schedule, ScheduleError, make_schedule, validate
from parallax.parallel.manual import Parallelism, shard_loss
from parallax.parallel.sequence import check_sequence_parallel

_DTYPES = ("float32", "bfloat16")


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. a non-finite loss); the message says what to change."""


def check_config(config, num_devices: int) -> dict[str, int]:
    """Raises ConfigError (one line: key, value, fix) for anything that would fail later. Returns axis sizes."""
    sizes = mesh_lib.resolve_axis_sizes(config.mesh, num_devices)
    m, t = config.model, config.train
    for key in ("num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size"):
        if int(m[key]) <= 0:
            raise ConfigError(f"config.model.{key}={m[key]}: must be positive")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"config.model.num_heads={m.num_heads}: not divisible by num_kv_heads={m.num_kv_heads}; "
                          f"make num_heads a multiple of num_kv_heads")
    if not m.head_dim and m.d_model % m.num_heads:
        raise ConfigError(f"config.model.d_model={m.d_model}: not divisible by num_heads={m.num_heads}; "
                          f"change one, or set model.head_dim explicitly")
    if (m.head_dim or m.d_model // m.num_heads) % 2:
        raise ConfigError(f"config.model.head_dim={m.head_dim or m.d_model // m.num_heads}: RoPE needs an even head_dim")
    tp, sp = sizes["tensor"], sizes["seq"]
    for key in ("num_heads", "num_kv_heads", "vocab_size", "d_ff"):  # as parallel.tensor.check_tensor_parallel
        if m[key] % tp:
            raise ConfigError(f"config.model.{key}={m[key]}: not divisible by mesh.tensor={tp}; "
                              f"use a tensor size that divides it")
    if m.d_model % sizes["fsdp"]:
        raise ConfigError(f"config.model.d_model={m.d_model}: not divisible by mesh.fsdp={sizes['fsdp']}")
    if m.dtype not in _DTYPES:
        raise ConfigError(f"config.model.dtype={m.dtype!r}: expected one of {', '.join(_DTYPES)}")
    if m.remat not in ("none", "full", "dots"):
        raise ConfigError(f"config.model.remat={m.remat!r}: expected one of none, full, dots")
    for key in ("steps", "global_batch_size", "seq_len", "log_every", "keep_checkpoints"):
        if int(t[key]) <= 0:
            raise ConfigError(f"config.train.{key}={t[key]}: must be >= 1")
    for key in ("eval_every", "checkpoint_every"):
        if int(t[key]) < 0:
            raise ConfigError(f"config.train.{key}={t[key]}: must be >= 0 (0 turns it off)")
    if t.eval_every and t.eval_batches <= 0:
        raise ConfigError(f"config.train.eval_batches={t.eval_batches}: must be >= 1 when eval_every > 0")
    o = config.optim
    if o.lr < 0 or o.warmup_steps < 0 or o.decay_steps < 0 or o.weight_decay < 0 or o.clip_norm < 0:
        raise ConfigError(f"config.optim: lr={o.lr}, warmup_steps={o.warmup_steps}, decay_steps={o.decay_steps}, "
                          f"weight_decay={o.weight_decay}, clip_norm={o.clip_norm} must all be >= 0")
    rules = sharding.make_rules(_rule_overrides(config))
    dp = _batch_ways(sizes, rules)
    if t.microbatches <= 0:
        raise ConfigError(f"config.train.microbatches={t.microbatches}: must be >= 1")
    if t.global_batch_size % (dp * t.microbatches):
        raise ConfigError(
            f"config.train.global_batch_size={t.global_batch_size}: must be divisible by data-parallel size {dp} "
            f"x microbatches {t.microbatches} = {dp * t.microbatches}")
    if t.seq_len % (sp * tp):
        raise ConfigError(f"config.train.seq_len={t.seq_len}: not divisible by mesh.seq*mesh.tensor={sp * tp} "
                          f"(the residual stream is split over both); use a multiple of {sp * tp}")
    if m.attention not in ("dense", "ulysses", "ring"):
        raise ConfigError(f"config.model.attention={m.attention!r}: expected one of dense, ulysses, ring")
    try:
        check_sequence_parallel(m.attention, sp, m.num_heads // tp, m.num_kv_heads // tp, t.seq_len)
    except ValueError as e:
        raise ConfigError(f"config.model.attention={m.attention!r}, mesh.seq={sp} (per tensor rank: "
                          f"{m.num_heads // tp} heads, {m.num_kv_heads // tp} kv heads): {e}") from None
    for name, axis in (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
                       ("length", "seq")):
        if sizes[axis] > 1 and rules[name] != axis:
            raise ConfigError(f"config.sharding.rules.{name}={rules[name]!r}: mesh.{axis}={sizes[axis]} runs "
                              f"explicit {axis} parallelism, which needs {name} -> {axis!r}; restore that rule")
    if sizes["pipe"] > 1:
        _check_pipeline(config, sizes, dp)
    if t.nan_policy not in ("stop", "skip"):
        raise ConfigError(f"config.train.nan_policy={t.nan_policy!r}: expected stop or skip")
    if config.data.source == "text" and m.vocab_size < 256:
        raise ConfigError(f"config.model.vocab_size={m.vocab_size}: byte-level text needs vocab_size >= 256")
    return sizes


def make_pipeline_schedule(config, num_ranks: int) -> Schedule:
    """The validated pipeline schedule of `config.pipeline` for `num_ranks` ranks (ConfigError if it cannot be)."""
    pc = config.pipeline
    try:
        schedule = make_schedule(pc.schedule, num_ranks, pc.microbatches, pc.virtual_stages)
        validate(schedule)
    except ScheduleError as e:
        raise ConfigError(f"config.pipeline (schedule={pc.schedule!r}, microbatches={pc.microbatches}, "
                          f"virtual_stages={pc.virtual_stages}, mesh.pipe={num_ranks}): {e}") from None
    return schedule


def _check_pipeline(config, sizes, dp):
    p, pc, m, t = sizes["pipe"], config.pipeline, config.model, config.train
    if sizes["seq"] > 1 and m.attention == "ring":
        raise ConfigError(f"config.model.attention='ring' with mesh.pipe={p}, mesh.seq={sizes['seq']}: ring "
                          f"attention cannot run inside pipeline stages (an XLA collective-permute has no replica "
                          f"groups, so every device joins each one, while pipeline ranks run different stages); "
                          f"use attention='ulysses' with pipe > 1")
    if t.microbatches != 1:
        raise ConfigError(f"config.train.microbatches={t.microbatches}: with mesh.pipe={p} the pipeline "
                          f"microbatches the batch itself; set train.microbatches=1 and use pipeline.microbatches")
    if pc.microbatches < 1 or t.global_batch_size % (dp * pc.microbatches):
        raise ConfigError(
            f"config.pipeline.microbatches={pc.microbatches}: global_batch_size={t.global_batch_size} must be "
            f"divisible by data-parallel size {dp} x pipeline.microbatches; choose a divisor of "
            f"{t.global_batch_size // dp}")
    schedule = make_pipeline_schedule(config, p)
    if m.num_layers % schedule.num_stages:
        raise ConfigError(
            f"config.model.num_layers={m.num_layers}: not divisible into {schedule.num_stages} pipeline stages "
            f"(mesh.pipe={p} x {schedule.num_chunks} chunks per rank); use a multiple of {schedule.num_stages}")


def _rule_overrides(config) -> dict:
    return dict(config.sharding.rules)


def _batch_ways(sizes, rules) -> int:
    """How many ways the batch is split (mesh axes of the `batch` rule), from axis sizes alone."""
    return math.prod(sizes[a] for a in sharding.spec_axes(rules["batch"]))


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
    """Everything derived from a config and a mesh: shapes, shardings, optimizer, and the jitted steps."""

    def __init__(self, config, devices=None, mesh=None):
        """`devices` default to all; `mesh` (e.g. an AbstractMesh, for shape checks) overrides them."""
        if mesh is None:
            devices = list(jax.devices() if devices is None else devices)
            check_config(config, len(devices))
            mesh = mesh_lib.make_mesh(config.mesh, devices)
        else:
            check_config(config, mesh.size)
        self.config = config
        self.mesh = mesh
        self.rules = sharding.make_rules(_rule_overrides(config))
        self.model_cfg = LlamaConfig.from_config(config.model)
        self.microbatches = int(config.train.microbatches)

        abstract_model = nnx.eval_shape(lambda: Llama(self.model_cfg, nnx.Rngs(0)))
        self.graphdef, abstract_state = nnx.split(abstract_model)
        self.logical = sharding.param_logical_names(abstract_state)
        self.abstract_params = nnx.to_pure_dict(abstract_state)
        self.param_shardings = sharding.param_shardings(self.abstract_params, self.logical, self.mesh, self.rules)
        self.parallelism = Parallelism.from_mesh(self.mesh, self.rules, config.model.attention)
        self.lr_schedule = optim.lr_schedule(config.optim, config.train.steps)
        self.pipeline = make_pipeline_schedule(config, self.mesh.shape["pipe"]) if self.mesh.shape["pipe"] > 1 else None
        self.tx = optim.make_optimizer(config.optim, config.train.steps, self.logical)
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        replicated = NamedSharding(self.mesh, P())
        self.state_shardings = {
            "step": replicated,
            "params": self.param_shardings,
            "opt_state": _opt_state_shardings(abstract_opt, self.param_shardings, self.mesh),
        }
        self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params))

        self._init = jax.jit(self._init_state, static_argnums=0, out_shardings=self.state_shardings)
        self.loss_and_grads = jax.jit(self._loss_and_grads, out_shardings=(replicated, self.param_shardings))
        self.train_step = jax.jit(self._train_step, donate_argnums=0,
                                  in_shardings=(self.state_shardings, self.batch_sharding),
                                  out_shardings=(self.state_shardings, replicated))
        self.eval_step = jax.jit(self._eval_step, out_shardings=replicated)

    # --- pure functions -------------------------------------------------------------------------------

    def _init_state(self, seed: int):
        params = nnx.to_pure_dict(nnx.state(Llama(self.model_cfg, nnx.Rngs(seed))))
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.tx.init(params)}

    def _model_loss_sum(self, params, batch):
        """Weighted loss sum. Tensor / sequence parallelism run the model per rank inside `shard_loss`."""
        par = self.parallelism
        if par.manual:
            def per_rank(p, b):
                return loss_sum(nnx.merge(self.graphdef, p), b, par)
            return shard_loss(per_rank, par, self.mesh, self.logical)(params, batch)
        with sharding.activation_sharding(self.mesh, self.rules):
            return loss_sum(nnx.merge(self.graphdef, params), batch)

    def _split_microbatches(self, batch, m: int):
        """(B, T) arrays -> (M, B/M, T); microbatch i takes rows i, i+M, ... so each batch shard stays local."""
        spec = sharding.logical_to_spec((None, "batch", "length"), self.rules, self.mesh)

        def split(x):
            x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
        return jax.tree.map(split, batch)

    def _pipeline_loss_and_grads(self, params, batch):
        """Weighted loss sum and its gradients, running `self.pipeline`'s schedule over the `pipe` axis.

        The embedding (first stage) and final norm + head + loss (last stage) use the non-layer
        parameters; the stacked layers go to the executor in its [p, v, L/(p*v), ...] layout. With
        tensor / sequence parallelism every stage runs per rank as in `shard_loss`: weights split over
        `tensor`, microbatch arrays [rows, T/s] (Ulysses; `_check_pipeline` rejects ring), residual
        stream [rows, T/(s*t), D] -- also between pipeline ranks. The weights enter whole over FSDP, as
        without tensor / sequence parallelism (the compiler gathers them once per step, outside the loop).
        """
        schedule, cfg = self.pipeline, self.model_cfg
        par = self.parallelism.model_axes_only()
        rest = {k: v for k, v in params.items() if k != "blocks"}
        no_blocks = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.abstract_params["blocks"])
        block_graphdef = nnx.split(nnx.merge(self.graphdef, self.abstract_params).blocks)[0]

        def model(rest_params):  # the embedding / head half of the model; its layers are never called
            return nnx.merge(self.graphdef, {**rest_params, "blocks": no_blocks})

        def first_fn(rest_params, mb):
            return model(rest_params).embed_tokens(mb["inputs"], par)

        def stage_fn(chunk, x, mb):
            return apply_layers(block_graphdef, chunk, x, mb["segment_ids"], mb["positions"], cfg.remat, par)

        def last_fn(rest_params, x, mb):  # this rank's tokens; the executor sums over the batch axes and seq
            return local_loss_sum(model(rest_params).logits(x, par), mb, par)

        rest_specs = par.param_specs({k: v for k, v in self.logical.items() if k != "blocks"})
        # Stage weights: the dims after the executor's [p, v], i.e. [Lc, ...] with the layers dim whole.
        stage_specs = jax.tree.map(lambda s: P(None, *s[1:]), par.param_specs(self.logical["blocks"]))
        batch_spec = sharding.logical_to_spec(("batch",), self.rules, self.mesh)
        batch_axes = sharding.spec_axes(batch_spec[0]) if len(batch_spec) else ()
        loss, grads = pipeline_value_and_grad(
            schedule, first_fn=first_fn, stage_fn=stage_fn, last_fn=last_fn,
            params={"first": rest, "stages": to_pipeline_layout(params["blocks"], schedule), "last": rest},
            inputs=self._split_microbatches(batch, schedule.num_microbatches), mesh=self.mesh,
            remat=bool(self.config.pipeline.remat), batch_axes=batch_axes,
            param_specs={"first": rest_specs, "stages": stage_specs, "last": rest_specs},
            input_spec=P("seq") if par.seq > 1 else P())
        rest_grads = jax.tree.map(jnp.add, grads["first"], grads["last"])
        return loss, {**rest_grads, "blocks": from_pipeline_layout(grads["stages"], schedule)}

    def _loss_and_grads(self, params, batch):
        """Mean token loss over the global batch and its gradients (fp32), accumulated over microbatches."""
        total = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
        if self.pipeline is not None:
            loss, grads = self._pipeline_loss_and_grads(params, batch)
            return loss / total, jax.tree.map(lambda g: g / total, grads)
        grad_fn = jax.value_and_grad(lambda p, mb: self._model_loss_sum(p, mb) / total)
        m = self.microbatches
        if m == 1:
            return grad_fn(params, batch)

        def body(carry, mb):
            loss_acc, grad_acc = carry
            loss, grads = grad_fn(params, mb)
            grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
            return (loss_acc + loss, grad_acc), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), self._split_microbatches(batch, m))
        return loss, grads

    def _train_step(self, state, batch):
        loss, grads = self._loss_and_grads(state["params"], batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
               "opt_state": opt_state}
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if self.config.train.nan_policy == "skip":  # keep the old weights, still advance the step
            new = {"step": new["step"], **jax.tree.map(lambda a, b: jnp.where(finite, a, b),
                                                        {k: new[k] for k in ("params", "opt_state")},
                                                        {k: state[k] for k in ("params", "opt_state")})}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.lr_schedule(state["step"]),
                   "finite": finite}
        return new, metrics

    def _eval_step(self, params, batch):
        return jnp.stack([self._model_loss_sum(params, batch), jnp.sum(batch["weights"])])

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
        return data_lib.to_global(batch, self.batch_sharding, self.config.train.global_batch_size)

    def host_rows(self) -> tuple[int, int]:
        """The rows of the global batch this host must load."""
        return data_lib.host_rows(self.batch_sharding, (self.config.train.global_batch_size, self.config.train.seq_len))


def shape_check(config, num_devices: int) -> dict:
    """Checks a config for `num_devices` devices by shape inference only (nothing is allocated).

    Runs the config checks, derives every parameter's sharding on an abstract mesh (so divisibility is
    checked) and traces the loss and gradients with `jax.eval_shape`. Returns parameter and token counts.
    """
    sizes = check_config(config, num_devices)
    auto = (jax.sharding.AxisType.Auto,) * len(mesh_lib.AXES)
    mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in mesh_lib.AXES), mesh_lib.AXES, axis_types=auto)
    trainer = Trainer(config, mesh=mesh)  # the same loss path a real run takes (dense, manual or pipelined)
    batch = {k: jax.ShapeDtypeStruct((config.train.global_batch_size, config.train.seq_len),
                                     jnp.float32 if k == "weights" else jnp.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "weights")}
    loss, grads = jax.eval_shape(trainer._loss_and_grads, trainer.abstract_params, batch)
    assert jax.tree.structure(grads) == jax.tree.structure(trainer.abstract_params)
    return {"params": trainer.num_params, "loss_shape": loss.shape}


@dataclasses.dataclass
class TrainResult:
    history: list  # one metrics dict per logged step
    eval_loss: float | None
    state: dict
    trainer: Trainer
    preempted: bool = False


def make_dataset(config) -> data_lib.Dataset:
    d, t = config.data, config.train
    try:
        dataset = data_lib.make_dataset(
            d.source, d.path, seq_len=t.seq_len, global_batch_size=t.global_batch_size, seed=t.seed,
            vocab_size=config.model.vocab_size, eval_fraction=d.eval_fraction,
            eos_id=None if d.eos_id < 0 else d.eos_id)
    except data_lib.DataError as e:
        raise ConfigError(f"config.data: {e}") from None
    if t.eval_every and dataset.streams["eval"] is None:
        raise ConfigError(f"config.data.eval_fraction={d.eval_fraction}: the corpus at {d.path or 'the default'} "
                          f"has no eval documents; raise eval_fraction or set train.eval_every=0")
    return dataset


def evaluate(trainer: Trainer, params, dataset, num_batches: int) -> float:
    """Mean token loss over the first `num_batches` batches of the eval split."""
    total = np.zeros(2)
    for i in range(num_batches):
        batch = trainer.device_batch(dataset.batch(i, "eval", rows=trainer.host_rows()))
        total += np.asarray(trainer.eval_step(params, batch))
    return float(total[0] / max(total[1], 1.0))


def _progress(step, steps, width=20):
    done = int(width * step / max(steps, 1))
    return "[" + "#" * done + "-" * (width - done) + f"] {100 * step / max(steps, 1):3.0f}%"


_MUST_MATCH_ON_RESUME = ("model", "data", "optim", "train.seed", "train.global_batch_size", "train.seq_len")


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
    return out


def check_resume(config, saved_json: str) -> None:
    """Raises ConfigError if `config` changes a key that an exact resume depends on (vs the saved config).

    The mesh, the pipeline and logging keys may change; the model, data, optimizer, seed, batch and
    sequence length may not. `train.steps` may grow only when `optim.decay_steps` fixes the LR schedule.
    """
    saved = _flatten(json.loads(saved_json))
    now = _flatten(json.loads(config.to_json_best_effort()))
    keys = [k for k in now if k.startswith(tuple(p + "." for p in ("model", "data", "optim")))
            or k in _MUST_MATCH_ON_RESUME]
    if not config.optim.decay_steps:
        keys.append("train.steps")
    for key in keys:
        if key in saved and saved[key] != now[key]:
            hint = (f"; set optim.decay_steps={saved[key]} to extend the run with the same LR schedule"
                    if key == "train.steps" else "; use a new --workdir to start a different run")
            raise ConfigError(f"config.{key}={now[key]!r}: the checkpoint in this workdir was trained with "
                              f"{saved[key]!r}, so resuming would not continue the same run{hint}")


def _stop_requested(flag: bool) -> bool:
    """True on every host if any host received SIGTERM (hosts must stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(multihost_utils.process_allgather(np.int32(flag)).max())


def train_and_evaluate(config, workdir: str, devices=None, log=print) -> TrainResult:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; the library entry point.

    Only process 0 writes `config.json` / `metrics.jsonl` and logs. On SIGTERM every host saves the same
    step and returns with `preempted=True`; rerunning the same command continues exactly.
    """
    trainer = Trainer(config, devices)
    dataset = make_dataset(config)
    t = config.train
    lead = jax.process_index() == 0
    log = log if lead else (lambda *_: None)
    workdir = epath.Path(workdir)
    checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", t.checkpoint_every, t.keep_checkpoints,
                                         async_save=t.async_checkpoint)
    start = checkpointer.latest_step()
    config_path = workdir / "config.json"
    if start is not None and config_path.exists():
        check_resume(config, config_path.read_text())
    if lead:
        workdir.mkdir(parents=True, exist_ok=True)
        if start is None:
            config_path.write_text(config.to_json_best_effort(indent=2))
    log(f"parallax: {mesh_lib.describe(trainer.mesh)}; model {trainer.num_params / 1e6:.2f}M params; "
        f"{dataset.describe()}")
    if start is None:
        state = trainer.init_state()
    else:  # restore straight onto the mesh's shardings: no throwaway initialisation
        state = checkpointer.restore(trainer.abstract_state(), start)
        log(f"resumed from {checkpointer.directory} at step {start}")
    step = first_step = int(state["step"])

    stop = {"signal": None}
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))
    history, eval_loss, preempted, tokens_per_step = [], None, False, t.global_batch_size * t.seq_len
    rows = trainer.host_rows()
    run_start = last = time.perf_counter()
    try:
        batch = trainer.device_batch(dataset.batch(step, rows=rows)) if step < t.steps else None
        while step < t.steps:
            state, metrics = trainer.train_step(state, batch)  # dispatched asynchronously
            step += 1
            batch = trainer.device_batch(dataset.batch(step, rows=rows)) if step < t.steps else None
            metrics = jax.device_get(metrics)  # the next batch was built while the device ran this step
            now = time.perf_counter()
            dt, last = now - last, now
            if not metrics["finite"]:
                if t.nan_policy == "stop":
                    raise TrainingError(
                        f"step {step}: non-finite loss or gradient (loss {float(metrics['loss'])}, grad_norm "
                        f"{float(metrics['grad_norm'])}); stopped without saving this step. Lower optim.lr, "
                        f"check the data, or set train.nan_policy=skip")
                log(f"step {step}: non-finite loss, update skipped (train.nan_policy=skip)")
            record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                      "lr": float(metrics["lr"]), "tokens_per_sec": tokens_per_step / dt, "step_time_s": dt}
            if step == first_step + 1:
                record["includes_compile"] = True
            if t.eval_every > 0 and (step % t.eval_every == 0 or step == t.steps):
                eval_loss = evaluate(trainer, state["params"], dataset, t.eval_batches)
                record["eval_loss"] = eval_loss
                last = time.perf_counter()  # eval time is not step time
            if step % t.log_every == 0 or step == t.steps or "eval_loss" in record:
                history.append(record)
                if lead:
                    with (workdir / "metrics.jsonl").open("a") as f:
                        f.write(json.dumps(record) + "\n")
                eta = (time.perf_counter() - run_start) / (step - first_step) * (t.steps - step)
                line = (f"{_progress(step, t.steps)} step {step}/{t.steps} loss {record['loss']:.4f} "
                        f"grad_norm {record['grad_norm']:.3f} lr {record['lr']:.2e} "
                        f"{record['tokens_per_sec']:,.0f} tok/s {dt:.3f} s/step eta {eta:.0f}s")
                if "eval_loss" in record:
                    line += f" eval_loss {eval_loss:.4f}"
                if record.get("includes_compile"):
                    line += " (first step: includes compilation)"
                log(line)
            preempted = _stop_requested(stop["signal"] is not None)
            checkpointer.maybe_save(step, state, force=step == t.steps or preempted)
            if preempted:
                log(f"received SIGTERM: saved step {step}; rerun the same command to continue")
                break
    finally:
        signal.signal(signal.SIGTERM, previous)
        checkpointer.close()
    return TrainResult(history=history, eval_loss=eval_loss, state=state, trainer=trainer, preempted=preempted)
