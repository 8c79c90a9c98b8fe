"""The plan: a config resolved once, for a number of devices, into the typed settings later steps read.

`make_plan(config, num_devices)` asks each mechanism, in order, to check and type its own section (each
raises its own `ConfigError`s: one line naming the key, the value and the fix), before anything is
compiled, and returns a `Plan` of typed fields: the mesh axis sizes, the sharding rules, the axes the batch
is split over, the model class with its abstract parameters and logical names, the parallel surface the
model gets, and the settings of the train loop, the optimizer, the pipeline (its validated schedule), DiLoCo
and attention. The trainer, the step paths, eval, sampling and `shape_check` read the plan; none of them
reads the config again. The config stays on the plan only to be saved and printed.

Where each section's keys and checks live: docs/design.md ("Settings, one home per mechanism").
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import data as data_lib
from parallax import diloco_settings, dpo_settings, lora as lora_lib, optim, quant as quant_lib, sharding, train_settings
from parallax import mesh as mesh_lib
from parallax import model as model_lib
from parallax.errors import ConfigError
from parallax.parallel import attention as attention_lib
from parallax.parallel.manual import Parallelism
from parallax.pipeline import settings as pipeline_settings
from parallax.pipeline.parts import Parts
from parallax.pipeline.schedule import Schedule


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A checked config for a mesh of `sizes`. Build it with `make_plan`."""

    config: object  # the ConfigDict it was made from: for saving and printing only
    sizes: dict  # mesh axis -> size
    rules: dict  # logical name -> mesh axes
    batch_axes: tuple  # mesh axes (of size > 1) that split the batch
    model_class: type
    model_config: object  # FrozenConfigDict of config.model: what the model's __init__ gets
    graphdef: object  # nnx graph of the model
    abstract_params: dict  # pure dict of ShapeDtypeStructs
    logical: dict  # the same tree of logical-name tuples
    parallelism: Parallelism  # what the model's parallel points get; a region with tensor / seq / expert / pipe > 1
    train: train_settings.TrainSettings
    optim: optim.OptimSettings
    pipeline: pipeline_settings.PipelineSettings
    diloco: diloco_settings.DilocoSettings
    attention: attention_lib.AttentionSettings
    remat: str  # model.remat
    num_layers: int
    platform: str = "cpu"  # of the devices it is made for (`model.target_platform()` during the checks)
    parts: Parts | None = None  # with a pipeline: what the model's parts read (traced once)
    lora: lora_lib.LoraSettings = lora_lib.OFF  # adapters (in `blocks`, beside their weights) and the frozen rest
    dcn: dict = dataclasses.field(default_factory=dict)  # mesh axis -> slices it spans (config.dcn; {}: one slice)

    @property
    def trainable(self) -> dict | None:
        """Per parameter leaf, whether training updates it (LoRA: the adapters only); None: every one."""
        return lora_lib.trainable_mask(self.logical) if self.lora.enabled else None
    dpo: dpo_settings.DpoSettings | None = None  # preference pairs (data.source='preference'): DPO's loss

    @property
    def schedule(self) -> Schedule | None:
        """The pipeline schedule when sizes['pipe'] > 1 (its layout resolved)."""
        return self.pipeline.schedule

    @property
    def data_parallel(self) -> int:
        """How many ways the batch is split."""
        return math.prod(self.sizes[a] for a in self.batch_axes)

    @property
    def num_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params))

    @property
    def flops_per_token(self) -> float:
        """The model's training FLOPs per token (forward and backward, no recompute): `Model.flops_per_token`
        at the run's sequence length. Throughput's MFU, the memory report and the search read it here."""
        return float(self.model_class.flops_per_token(self.model_config, self.train.seq_len,
                                                      self.abstract_params, self.logical))

    def abstract_batch(self) -> dict:
        """ShapeDtypeStructs of one global batch (with DPO, its preference keys too)."""
        t = self.train
        extra = dpo_settings.batch_shapes(t.global_batch_size, t.seq_len) if self.dpo is not None else {}
        return {**t.abstract_batch(), **extra}

    def new_model(self, seed: int) -> model_lib.Model:
        return build_model(self.model_class, self.model_config, self.lora, seed)

    def make_mesh(self, devices) -> jax.sharding.Mesh:
        return mesh_lib.make_mesh(self.sizes, devices, self.dcn)

    def abstract_mesh(self) -> jax.sharding.AbstractMesh:
        auto = (jax.sharding.AxisType.Auto,) * len(mesh_lib.AXES)
        return jax.sharding.AbstractMesh(tuple(self.sizes[a] for a in mesh_lib.AXES), mesh_lib.AXES,
                                         axis_types=auto)


def make_plan(config, num_devices: int, platform: str | None = None) -> Plan:
    """Checks `config` for `num_devices` devices of `platform` ("cpu", "gpu", "tpu"; None: the host's
    backend) and resolves it; raises ConfigError naming the fix. Every backend-dependent choice reads
    `platform` (the models' checks through `model.target_platform()`, the region's collectives through
    `Parallelism.platform`), so a plan for a TPU topology compiled on a CPU host decides as on the TPU."""
    platform = platform or jax.default_backend()
    with model_lib.targeting(platform):
        return _make_plan(config, num_devices, platform)


def _make_plan(config, num_devices, platform):
    sizes = mesh_lib.resolve_axis_sizes(config.mesh, num_devices, platform)
    dcn = mesh_lib.resolve_dcn(config.get("dcn"), sizes)
    m = config.model
    cls = model_lib.model_class(m.name)
    model_lib.check_keys(m, cls)
    train = train_settings.resolve(config.train)
    attention_lib.check(m, sizes, train.seq_len)
    optimizer = optim.resolve(config.optim, pipeline_settings.stale_gradients(config.pipeline, sizes["pipe"]))
    data_lib.check_source(config.data, int(m.vocab_size))
    cls.check_config(m, sizes, config)
    model_lib.check_parallel_axes(m, cls, sizes)
    rules = sharding.model_rules(config.sharding.rules, cls.rules, m.name)
    if sizes["pipe"] > 1 and int(m.num_layers) % sizes["pipe"] and "pipe" in sharding.spec_axes(rules["layers"]):
        rules = {**rules, "layers": None}  # an uneven layout: the stack is stored whole over `pipe` (docs/pipeline.md)
    batch_axes = tuple(a for a in sharding.spec_axes(rules["batch"]) if sizes[a] > 1)
    diloco = diloco_settings.resolve(config.diloco, int(m.num_layers))
    dp = math.prod(sizes[a] for a in batch_axes) * sizes[mesh_lib.REPLICA]
    train_settings.check_batch(train, dp)
    pipeline = pipeline_settings.resolve(
        config.pipeline, sizes, num_layers=int(m.num_layers), vocab_size=int(m.vocab_size), data_parallel=dp,
        global_batch_size=train.global_batch_size, accumulation=train.microbatches, grad_delay=optimizer.grad_delay)
    model_config = model_lib.frozen(m)
    base_blocks = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: cls(model_config, nnx.Rngs(0))).blocks))
    lora = lora_lib.resolve(config.lora, cls, model_config, base_blocks)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: build_model(cls, model_config, lora, 0)))
    try:
        logical = sharding.param_logical_names(abstract_state)
    except ValueError as e:
        raise ConfigError(f"config.model.name={m.name!r}: {e}") from None
    abstract_params = nnx.to_pure_dict(abstract_state)
    sharding.check_params(m.name, int(m.num_layers), sizes, rules, abstract_params, logical)
    sharding.check_explicit_rules(sizes if "expert" in cls.parallel_axes else {**sizes, "expert": 1}, rules, logical)
    optim.check_exclude(config.optim, rules)
    if pipeline.vocab_parallel and "pipe" not in sharding.spec_axes(rules["vocab"]):
        # stored as the executor reads it: the embedding and head split over pipe (x tensor), pipe-major
        rules = {**rules, "vocab": ("pipe", *sharding.spec_axes(rules["vocab"]))}
    attention = attention_lib.resolve(m, sizes, train.seq_len, platform, cls.attention_features(model_config))
    dpo = None
    if config.data.source == "preference":
        dpo = dpo_settings.resolve(config.dpo, sizes, pipeline.schedule is not None and pipeline.schedule.steady)
    quant = quant_lib.resolve(config.quant)
    kernels = dict(attention_block=attention.block, loss_chunk=attention.loss_chunk, platform=platform,
                   attention_impl=attention.impl, quant=quant)
    par = Parallelism(**kernels)  # no region: the model's dense code under the compiler's sharding
    if quant is not None:
        batch = {k: jax.ShapeDtypeStruct((1, train.seq_len), jnp.float32 if k == "weights" else jnp.int32)
                 for k in ("inputs", "targets", "weights", "segment_ids", "positions")}
        quant_lib.check_used(lambda s, b: model_lib.forward(nnx.merge(graphdef, s), b, par=par), m.name,
                             abstract_state, batch)
    # `expert` is explicit only for a model that declares it; for others it is one more batch axis.
    expert = sizes["expert"] if "expert" in cls.parallel_axes else 1
    if sizes["tensor"] > 1 or sizes["seq"] > 1 or expert > 1 or pipeline.schedule is not None:
        par = Parallelism(tensor=sizes["tensor"], seq=sizes["seq"], expert=expert, attention_kind=attention.kind,
                          seq_layout=attention.seq_layout, ulysses=attention.ulysses,
                          mesh_shape=tuple(sizes.items()), rules=tuple(rules.items()), **kernels)
    plan = Plan(
        config=config, sizes=sizes, rules=rules, batch_axes=batch_axes, model_class=cls, model_config=model_config,
        graphdef=graphdef, abstract_params=abstract_params, logical=logical, parallelism=par, train=train,
        optim=optimizer, pipeline=pipeline, diloco=diloco, attention=attention, remat=str(m.remat),
        num_layers=int(m.num_layers), platform=platform, lora=lora, dcn=dcn)
    if pipeline.schedule is None:
        return dataclasses.replace(plan, dpo=dpo)
    parts = Parts.make(plan)  # what the model's parts read (of the language model's batch), traced once
    pipeline_settings.check_parts(pipeline, parts, logical)
    return _auto_layout(dataclasses.replace(plan, parts=parts, dpo=dpo))


def build_model(cls, model_config, lora: lora_lib.LoraSettings, seed: int) -> model_lib.Model:
    """Model `cls` initialised from `seed`, with the LoRA adapters of `lora` in its blocks."""
    rngs = nnx.Rngs(seed)
    return lora_lib.attach(cls(model_config, rngs), lora, rngs)


def _auto_layout(plan):
    """`plan` with `pipeline.layout='auto'` resolved: the layers per stage with the shortest simulated
    lockstep step at per-stage costs from the counted forward matmul FLOPs of a layer, the embedding
    (stage 0) and the head and loss (the last stage): `parallax.pipeline.simulate.best_layout`."""
    if not plan.pipeline.auto_layout:
        return plan
    from parallax.pipeline.simulate import best_layout
    flops = plan.parts.flops(plan.remat)
    layers = best_layout(plan.schedule, plan.num_layers, flops["layer"], flops["embed"], flops["loss"],
                         plan.pipeline.vocab_parallel)
    pipeline = dataclasses.replace(plan.pipeline, schedule=plan.schedule.with_layers(layers))
    return dataclasses.replace(plan, pipeline=pipeline)


def abstract_batch(config) -> dict:
    """ShapeDtypeStructs of one global batch of `config` (a plan has its own: `Plan.abstract_batch`)."""
    t = config.train
    extra = dpo_settings.batch_shapes(t.global_batch_size, t.seq_len) if config.data.source == "preference" else {}
    return {**train_settings.batch_shapes(t.global_batch_size, t.seq_len), **extra}
