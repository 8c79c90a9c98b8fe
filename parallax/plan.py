"""The plan: a config resolved once, for a number of devices, into everything later steps read.

`make_plan(config, num_devices)` runs every check (each a `ConfigError`: one line naming the key, the
value and the fix), before anything is compiled, and returns a `Plan`: the mesh axis sizes, the sharding
rules, the axes the batch is split over, the model class and its abstract parameters with their logical
names, the parallel surface the model gets, and the validated pipeline schedule. The trainer, the loss
paths, eval, sampling and `shape_check` read the plan; none of them looks at the config's checks again.
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import mesh as mesh_lib
from parallax import model as model_lib
from parallax import optim as optim_lib
from parallax import sharding
from parallax.errors import ConfigError
from parallax.parallel import splash as splash_lib
from parallax.parallel.sequence import usp_degree
from parallax.parallel.manual import Parallelism
from parallax.pipeline.schedule import Schedule, ScheduleError, balanced_layers, make_schedule
from parallax.pipeline.validate import validate

DTYPES = ("float32", "bfloat16")
ATTENTION = ("dense", "ulysses", "ring", "usp", "allgather")
# Logical names that explicit tensor / sequence / expert parallelism shards over its own axis.
_EXPLICIT_RULES = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
                   ("length", "seq"), ("experts", "expert"))


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A checked config for a mesh of `sizes`. Build it with `make_plan`."""

    config: object  # the ConfigDict it was made from
    sizes: dict  # mesh axis -> size
    rules: dict  # logical name -> mesh axes
    batch_axes: tuple  # mesh axes (of size > 1) that split the batch
    model_class: type
    model_config: object  # FrozenConfigDict of config.model: what the model's __init__ gets
    graphdef: object  # nnx graph of the model
    abstract_params: dict  # pure dict of ShapeDtypeStructs
    logical: dict  # the same tree of logical-name tuples
    parallelism: Parallelism  # what the model's parallel points get; a region with tensor / seq / expert / pipe > 1
    schedule: Schedule | None  # the pipeline schedule when sizes['pipe'] > 1
    platform: str = "cpu"  # of the devices it is made for (`model.target_platform()` during the checks)

    @property
    def data_parallel(self) -> int:
        """How many ways the batch is split."""
        return math.prod(self.sizes[a] for a in self.batch_axes)

    @property
    def num_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params))

    @property
    def remat(self) -> str:
        return self.config.model.remat

    def new_model(self, seed: int) -> model_lib.Model:
        return self.model_class(self.model_config, nnx.Rngs(seed))

    def make_mesh(self, devices) -> jax.sharding.Mesh:
        return mesh_lib.make_mesh(self.sizes, devices)

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
    cls = model_lib.model_class(config.model.name)
    _check_model_keys(config, cls)
    _check_generic(config, sizes)
    cls.check_config(config.model, sizes, config)
    for axis in model_lib.EXPLICIT_AXES:
        if sizes[axis] > 1 and axis not in cls.parallel_axes:
            raise ConfigError(f"config.mesh.{axis}={sizes[axis]}: model {config.model.name!r} does not implement "
                              f"{axis} parallelism (its parallel_axes: {cls.parallel_axes or 'none'}); set "
                              f"mesh.{axis}=1 and use data, fsdp or pipe")
    rules = _rules(config, cls)
    if sizes["pipe"] > 1 and int(config.model.num_layers) % sizes["pipe"] and "pipe" in sharding.spec_axes(
            rules["layers"]):  # an uneven layout: the stack is stored whole over `pipe` (docs/pipeline.md)
        rules = {**rules, "layers": None}
    batch_axes = tuple(a for a in sharding.spec_axes(rules["batch"]) if sizes[a] > 1)
    _check_diloco(config, sizes)
    _check_batch(config, math.prod(sizes[a] for a in batch_axes) * sizes[mesh_lib.REPLICA])
    schedule = _pipeline_schedule(config, sizes, math.prod(sizes[a] for a in batch_axes) * sizes[mesh_lib.REPLICA])
    model_config = model_lib.frozen(config.model)
    abstract_model = nnx.eval_shape(lambda: cls(model_config, nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract_model)
    try:
        logical = sharding.param_logical_names(abstract_state)
    except ValueError as e:
        raise ConfigError(f"config.model.name={config.model.name!r}: {e}") from None
    abstract_params = nnx.to_pure_dict(abstract_state)
    _check_params(config, sizes, rules, abstract_params, logical)
    _check_explicit_rules(sizes if "expert" in cls.parallel_axes else {**sizes, "expert": 1}, rules, logical)
    _check_muon_exclude(config, rules)
    if sizes["pipe"] > 1 and config.pipeline.vocab_parallel and "pipe" not in sharding.spec_axes(rules["vocab"]):
        # stored as the executor reads it: the embedding and head split over pipe (x tensor), pipe-major
        rules = {**rules, "vocab": ("pipe", *sharding.spec_axes(rules["vocab"]))}
    kernels = dict(attention_block=int(config.model.attention_block), loss_chunk=int(config.model.loss_chunk),
                   platform=platform, attention_impl=_attention_impl(config, sizes, platform))
    par = Parallelism(**kernels)  # no region: the model's dense code under the compiler's sharding
    # `expert` is explicit only for a model that declares it; for others it is one more batch axis.
    expert = sizes["expert"] if "expert" in cls.parallel_axes else 1
    if sizes["tensor"] > 1 or sizes["seq"] > 1 or expert > 1 or schedule is not None:
        par = Parallelism(tensor=sizes["tensor"], seq=sizes["seq"], expert=expert,
                          attention_kind=config.model.attention, seq_layout=config.model.seq_layout,
                          ulysses=_ulysses_degree(config, sizes),
                          mesh_shape=tuple(sizes.items()),
                          rules=tuple(rules.items()), **kernels)
    return _auto_layout(Plan(
        config=config, sizes=sizes, rules=rules, batch_axes=batch_axes, model_class=cls, model_config=model_config,
        graphdef=graphdef, abstract_params=abstract_params, logical=logical, parallelism=par, schedule=schedule,
        platform=platform))


ATTENTION_IMPLS = ("auto", "blockwise", "splash", "cudnn")


def _ulysses_degree(config, sizes) -> int:
    """usp's Ulysses degree: `model.ulysses_degree`, or for 0 the largest proper divisor of mesh.seq that
    the heads of one tensor rank allow (`sequence.usp_degree`); 0 for the other attentions."""
    m, sp, tp = config.model, sizes["seq"], sizes["tensor"]
    if m.attention != "usp" or sp == 1:
        return 0
    if int(m.ulysses_degree):
        return int(m.ulysses_degree)
    heads = m.get("num_heads")
    if not heads:
        raise ConfigError(f"config.model.ulysses_degree=0 (auto) with attention='usp': model {m.name!r} has no "
                          f"num_heads key to choose by; set model.ulysses_degree to a divisor of mesh.seq={sp}")
    kv = m.get("num_kv_heads") or heads
    return usp_degree(sp, int(heads) // tp, int(kv) // tp)


def _attention_impl(config, sizes, platform) -> str:
    """`model.attention_impl` resolved for the target: auto is splash on TPU and cuDNN on GPU (in bf16) where
    their layout and tiling allow it, else blockwise (the reference with attention_block=0). An explicit
    kernel where it cannot run is an error."""
    m, t = config.model, config.train
    impl = m.attention_impl
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"config.model.attention_impl={impl!r}: expected one of {', '.join(ATTENTION_IMPLS)}")
    layout_ok = sizes["seq"] == 1 or m.attention == "ulysses"  # each rank attends over one contiguous layout
    layout_why = (f"attention={m.attention!r} over mesh.seq={sizes['seq']} gives each rank zigzag chunks (use "
                  "dense or ulysses)")
    tiles_ok = splash_lib.supports(int(t.seq_len), int(m.attention_block))
    half = m.dtype in ("bfloat16", "float16")
    if impl == "splash" and platform == "gpu":
        raise ConfigError("config.model.attention_impl='splash': a TPU kernel; on gpu it would run in Pallas "
                          "interpret mode (for CPU tests only); use attention_impl=cudnn, blockwise or auto")
    if impl == "splash" and not (layout_ok and tiles_ok):
        why = layout_why if not layout_ok else (f"train.seq_len={t.seq_len} with attention_block="
                                                f"{m.attention_block} is not tiled by {splash_lib.MIN_BLOCK}-token "
                                                "multiples")
        raise ConfigError(f"config.model.attention_impl='splash': {why}; or use attention_impl=blockwise")
    if impl == "cudnn":
        if platform == "tpu":
            raise ConfigError("config.model.attention_impl='cudnn': a GPU kernel; on tpu use attention_impl=splash "
                              "or auto")
        if not layout_ok:
            raise ConfigError(f"config.model.attention_impl='cudnn': {layout_why}; or use attention_impl=blockwise")
        if platform == "gpu" and not half:
            raise ConfigError(f"config.model.attention_impl='cudnn': cuDNN flash attention takes bfloat16 or float16 "
                              f"inputs, model.dtype={m.dtype!r}; set model.dtype=bfloat16, or attention_impl=blockwise")
    if impl == "auto":
        if platform == "tpu" and layout_ok and tiles_ok:
            return "splash"
        return "cudnn" if platform == "gpu" and layout_ok and half else "blockwise"
    return impl


def _check_model_keys(config, cls):
    expected = set(model_lib.GENERIC_KEYS) | set(cls.config_defaults())
    have = set(config.model.keys())
    if have - expected:
        key = sorted(have - expected)[0]
        raise ConfigError(f"config.model.{key}: not a key of model {config.model.name!r} (its keys: "
                          f"{', '.join(sorted(expected))}); start the config from "
                          f"default_config(model={config.model.name!r})")
    if expected - have:
        key = sorted(expected - have)[0]
        raise ConfigError(f"config.model.{key}: missing, and model {config.model.name!r} needs it; start the "
                          f"config from default_config(model={config.model.name!r})")


def _check_generic(config, sizes):
    m, t, o = config.model, config.train, config.optim
    for key in ("num_layers", "vocab_size"):
        if int(m[key]) <= 0:
            raise ConfigError(f"config.model.{key}={m[key]}: must be positive")
    choices = (("dtype", DTYPES), ("remat", model_lib.REMAT_CHOICES), ("attention", ATTENTION))
    for key, valid in choices:
        if m[key] not in valid:
            raise ConfigError(f"config.model.{key}={m[key]!r}: expected one of {', '.join(valid)}")
    for key in ("attention_block", "loss_chunk"):
        if int(m[key]) < 0:
            raise ConfigError(f"config.model.{key}={m[key]}: must be >= 0 (0 turns it off)")
    for key in ("steps", "global_batch_size", "seq_len", "log_every", "keep_checkpoints", "microbatches"):
        if int(t[key]) <= 0:
            raise ConfigError(f"config.train.{key}={t[key]}: must be >= 1")
    for key in ("eval_every", "checkpoint_every"):
        if int(t[key]) < 0:
            raise ConfigError(f"config.train.{key}={t[key]}: must be >= 0 (0 turns it off)")
    if t.eval_every and t.eval_batches <= 0:
        raise ConfigError(f"config.train.eval_batches={t.eval_batches}: must be >= 1 when eval_every > 0")
    profile = tuple(t.profile_steps)
    if profile and (len(profile) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in profile)
                    or not 1 <= profile[0] <= profile[1] <= t.steps):
        raise ConfigError(f"config.train.profile_steps={profile}: expected two steps FIRST,LAST with 1 <= FIRST <= "
                          f"LAST <= train.steps={t.steps}, e.g. --config.train.profile_steps=3,5 (step 1 includes "
                          f"compilation), or () for no profile")
    if t.nan_policy not in ("stop", "skip"):
        raise ConfigError(f"config.train.nan_policy={t.nan_policy!r}: expected stop or skip")
    # 2bw (with a pipeline) delays the gradients itself, so delay_correction needs no grad_delay there
    optim_lib.check(o, stale_gradients=config.pipeline.schedule == "2bw" and sizes["pipe"] > 1)
    if o.lr < 0 or o.warmup_steps < 0 or o.decay_steps < 0 or o.weight_decay < 0 or o.clip_norm < 0:
        raise ConfigError(f"config.optim: lr={o.lr}, warmup_steps={o.warmup_steps}, decay_steps={o.decay_steps}, "
                          f"weight_decay={o.weight_decay}, clip_norm={o.clip_norm} must all be >= 0")
    sp, tp = sizes["seq"], sizes["tensor"]
    if t.seq_len % (sp * tp):
        raise ConfigError(f"config.train.seq_len={t.seq_len}: not divisible by mesh.seq*mesh.tensor={sp * tp} "
                          f"(the residual stream is split over both); use a multiple of {sp * tp}")
    u = int(m.ulysses_degree)
    if u and m.attention != "usp":
        raise ConfigError(f"config.model.ulysses_degree={u}: only attention='usp' uses it (attention="
                          f"{m.attention!r}); set ulysses_degree=0, or attention=usp")
    if u < 0 or (u and sp % u):
        raise ConfigError(f"config.model.ulysses_degree={u}: usp's Ulysses groups must divide mesh.seq={sp}; use "
                          f"a divisor of {sp}, or 0 (auto: the largest the heads allow)")
    if sp > 1 and m.attention == "dense":
        raise ConfigError(f"config.model.attention='dense' with mesh.seq={sp}: set attention to 'ulysses', "
                          f"'allgather' or 'ring', or set mesh.seq=1")
    if m.seq_layout not in ("zigzag", "balanced"):
        raise ConfigError(f"config.model.seq_layout={m.seq_layout!r}: expected zigzag or balanced")
    if m.seq_layout == "balanced" and m.attention != "allgather":
        raise ConfigError(f"config.model.seq_layout='balanced' with attention={m.attention!r}: the balanced "
                          f"layout is for attention='allgather' (ring's skipping needs zigzag chunks; Ulysses "
                          f"attends whole rows); set seq_layout=zigzag or attention=allgather")
    if m.attention in ("ring", "usp", "allgather") and t.seq_len % (2 * sp):
        raise ConfigError(f"config.train.seq_len={t.seq_len}: {m.attention}: seq_len={t.seq_len} is not divisible by "
                          f"2*seq={2 * sp} (zigzag layout): use a seq_len that is a multiple of {2 * sp}")
    if config.data.source == "text" and m.vocab_size < 256:
        raise ConfigError(f"config.model.vocab_size={m.vocab_size}: byte-level text needs vocab_size >= 256")


PSEUDO_GRAD_DTYPES = ("float32", "bfloat16", "int8")


def _check_diloco(config, sizes):
    """`diloco.*`, and the layouts DiLoCo replicas (`mesh.replica > 1`, `parallax.paths.diloco`) run."""
    d, r = config.diloco, sizes[mesh_lib.REPLICA]
    if int(d.sync_every) < 1:
        raise ConfigError(f"config.diloco.sync_every={d.sync_every}: must be >= 1 (inner steps between syncs)")
    if d.pseudo_grad_dtype not in PSEUDO_GRAD_DTYPES:
        raise ConfigError(f"config.diloco.pseudo_grad_dtype={d.pseudo_grad_dtype!r}: expected one of "
                          f"{', '.join(PSEUDO_GRAD_DTYPES)}")
    if float(d.outer_lr) <= 0 or not 0 <= float(d.outer_momentum) < 1:
        raise ConfigError(f"config.diloco: outer_lr={d.outer_lr} must be > 0 and outer_momentum={d.outer_momentum} "
                          f"in [0, 1)")
    if int(d.overlap) not in (0, 1) or not 0 <= float(d.mix) <= 1:
        raise ConfigError(f"config.diloco: overlap={d.overlap} must be 0 or 1 and mix={d.mix} in [0, 1]")
    f, layers = int(d.fragments), int(config.model.num_layers)
    if f < 1 or f > int(d.sync_every) or layers % f:
        raise ConfigError(f"config.diloco.fragments={d.fragments}: must divide model.num_layers={layers} and be at "
                          f"most diloco.sync_every={d.sync_every} (one fragment syncs at a time); e.g. 1")
    if r > 1 and sizes["pipe"] > 1 and config.pipeline.schedule == "2bw":
        raise ConfigError(f"config.mesh.replica={r} with pipeline.schedule='2bw': DiLoCo replicas run flushing "
                          f"schedules (a steady window carries the previous step's microbatches, which an outer "
                          f"sync would cut); use pipeline.schedule='1f1b' (or gpipe, interleaved_1f1b, zb_h1, zbv)")


def _check_muon_exclude(config, rules):
    names = [n.strip() for n in str(config.optim.muon_exclude).split(",") if n.strip()]
    for name in names:
        if name not in rules:
            raise ConfigError(f"config.optim.muon_exclude={config.optim.muon_exclude!r}: {name!r} is not a logical "
                              f"axis name of this model (names: {', '.join(sorted(rules))}); e.g. vocab")


def _rules(config, cls) -> dict:
    clash = set(cls.rules) & set(sharding.DEFAULT_RULES)
    if clash:
        raise ConfigError(f"config.model.name={config.model.name!r}: the model's `rules` redefine "
                          f"{sorted(clash)}; a model may only add logical names (change existing ones in "
                          f"config.sharding.rules)")
    return sharding.make_rules(dict(config.sharding.rules), extra=cls.rules)


def _check_batch(config, dp):
    t = config.train
    if t.global_batch_size % (dp * t.microbatches):
        raise ConfigError(
            f"config.train.global_batch_size={t.global_batch_size}: must be divisible by data-parallel size {dp} "
            f"(mesh.replica included) x microbatches {t.microbatches} = {dp * t.microbatches}")


def _check_explicit_rules(sizes, rules, logical):
    """Explicit tensor / sequence parallelism splits what the rules say: the logical names the model uses
    for heads, MLP and vocabulary must still map to `tensor`, and `length` to `seq`."""
    used = {n for names in jax.tree.leaves(logical, is_leaf=sharding.is_logical_names) for n in names} | {"length"}
    for name, axis in _EXPLICIT_RULES:
        if name in used and sizes[axis] > 1 and rules[name] != axis:
            raise ConfigError(f"config.sharding.rules.{name}={rules[name]!r}: mesh.{axis}={sizes[axis]} runs "
                              f"explicit {axis} parallelism, which needs {name} -> {axis!r}; restore that rule")


def _pipeline_schedule(config, sizes, dp) -> Schedule | None:
    p, pc, m, t = sizes["pipe"], config.pipeline, config.model, config.train
    if p == 1:
        return None
    if t.microbatches != 1:
        raise ConfigError(f"config.train.microbatches={t.microbatches}: with mesh.pipe={p} the pipeline "
                          f"microbatches the batch itself; set train.microbatches=1 and use pipeline.microbatches")
    if pc.microbatches < 1 or t.global_batch_size % (dp * pc.microbatches):
        raise ConfigError(
            f"config.pipeline.microbatches={pc.microbatches}: global_batch_size={t.global_batch_size} must be "
            f"divisible by data-parallel size {dp} (mesh.replica included) x pipeline.microbatches; choose a divisor of "
            f"{t.global_batch_size // dp}")
    if pc.schedule == "2bw" and int(config.optim.grad_delay):
        raise ConfigError("config.pipeline.schedule='2bw' applies each gradient one step late itself, and "
                          "optim.grad_delay=1 would delay it twice; set optim.grad_delay=0 (optim.delay_correction"
                          "=error_feedback still applies, to the pipeline's delay)")
    try:
        schedule = make_schedule(pc.schedule, p, pc.microbatches, pc.virtual_stages)
        validate(schedule)
    except ScheduleError as e:
        raise ConfigError(f"config.pipeline (schedule={pc.schedule!r}, microbatches={pc.microbatches}, "
                          f"virtual_stages={pc.virtual_stages}, mesh.pipe={p}): {e}") from None
    if pc.vocab_parallel:
        v, t = int(m.vocab_size), sizes["tensor"]
        if schedule.steady or sizes[mesh_lib.REPLICA] > 1:
            raise ConfigError(f"config.pipeline.vocab_parallel=True with schedule={pc.schedule!r}, mesh.replica="
                              f"{sizes[mesh_lib.REPLICA]}: it runs with the flushing schedules and one replica; "
                              f"set pipeline.vocab_parallel=False")
        if v % (p * t):
            raise ConfigError(f"config.pipeline.vocab_parallel=True: model.vocab_size={v} must be divisible by "
                              f"mesh.pipe x mesh.tensor = {p * t} (the head's vocabulary is split over both); "
                              f"pad the vocabulary to {-(-v // (p * t)) * p * t}")
    layout = str(pc.layout).replace(" ", "")
    if layout == "even" and m.num_layers % schedule.num_stages:
        raise ConfigError(
            f"config.model.num_layers={m.num_layers}: not divisible into {schedule.num_stages} pipeline stages "
            f"(mesh.pipe={p} x {schedule.num_chunks} chunks per rank); use a multiple of {schedule.num_stages}, "
            f"or set pipeline.layout='auto' or layers per stage (e.g. '{_spread(m.num_layers, schedule.num_stages)}')")
    if layout in ("even", "auto"):
        return schedule  # 'auto' is resolved once the model's parts can be counted (`_auto_layout`)
    try:
        counts = tuple(int(n) for n in layout.split(","))
    except ValueError:
        counts = ()
    if len(counts) != schedule.num_stages or min(counts) < 0 or sum(counts) != m.num_layers:
        raise ConfigError(
            f"config.pipeline.layout={pc.layout!r}: give 'even', 'auto' or {schedule.num_stages} layer counts >= 0, "
            f"one per stage in stage order (mesh.pipe={p} x {schedule.num_chunks} chunks per rank), summing to "
            f"model.num_layers={m.num_layers}, e.g. '{_spread(m.num_layers, schedule.num_stages)}'")
    return schedule.with_layers(counts)


def _spread(num_layers, num_stages) -> str:
    return ",".join(map(str, balanced_layers(num_layers, num_stages, 1.0)))


def part_flops(plan) -> dict:
    """Forward matmul FLOPs of one sequence (`pipeline.work.dot_flops` of the dense code's jaxpr) through
    the embedding, one layer, and the head and loss: what `pipeline.layout='auto'` balances."""
    from parallax.parallel.manual import DENSE
    from parallax.pipeline.work import dot_flops
    rest = {k: v for k, v in plan.abstract_params.items() if k != "blocks"}
    blocks = plan.abstract_params["blocks"]
    graphdef = nnx.split(nnx.merge(plan.graphdef, plan.abstract_params).blocks)[0]
    mb = jax.tree.map(lambda a: jnp.zeros((1, *a.shape[1:]), a.dtype), abstract_batch(plan.config))  # one row
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), blocks)  # one layer

    def model(p):
        return nnx.merge(plan.graphdef, {**p, "blocks": blocks})
    x = jax.eval_shape(lambda p: model(p).embed(mb, DENSE), rest)

    def count(fn, *args):
        return float(dot_flops(jax.make_jaxpr(fn)(*args).jaxpr))
    return {"embed": count(lambda p: model(p).embed(mb, DENSE), rest),
            "layer": count(lambda w, x: model_lib.apply_layer_aux(graphdef, w, x, mb, plan.remat, DENSE), one, x),
            "loss": count(lambda p, x: model(p).loss(x, mb, DENSE), rest, x)}


def _auto_layout(plan):
    """`plan` with `pipeline.layout='auto'` resolved: the layers per stage with the shortest simulated
    lockstep step at per-stage costs from the counted forward matmul FLOPs of a layer, the embedding
    (stage 0) and the head and loss (the last stage): `parallax.pipeline.simulate.best_layout`."""
    if plan.schedule is None or str(plan.config.pipeline.layout).strip() != "auto":
        return plan
    from parallax.pipeline.simulate import best_layout
    flops = part_flops(plan)
    layers = best_layout(plan.schedule, int(plan.config.model.num_layers), flops["layer"], flops["embed"],
                         flops["loss"], bool(plan.config.pipeline.vocab_parallel))
    return dataclasses.replace(plan, schedule=plan.schedule.with_layers(layers))


def _check_params(config, sizes, rules, abstract_params, logical):
    """Every parameter's logical names are in the rules and its sharded dims divide; `blocks` is a stack."""
    name = config.model.name
    if "blocks" not in abstract_params:
        raise ConfigError(f"config.model.name={name!r}: the model has no `blocks` attribute (the stack of "
                          f"identical blocks that parallax scans and pipelines); see parallax.model")
    mesh = types.SimpleNamespace(shape=sizes)
    is_names = sharding.is_logical_names
    for path, names in jax.tree_util.tree_flatten_with_path(logical, is_leaf=is_names)[0]:
        where = "parameter " + "/".join(str(getattr(k, "key", k)) for k in path)
        unknown = [n for n in names if n is not None and n not in rules]
        if unknown:
            raise ConfigError(f"config.model.name={name!r}: {where} uses logical name {unknown[0]!r}, which the "
                              f"rules table lacks; add it to the model's `rules` (valid: {', '.join(sorted(rules))})")
        shape = _leaf_at(abstract_params, path).shape
        sharding.logical_to_spec(names, rules, mesh, shape, where)  # raises ConfigError if it does not divide
        if path[0].key == "blocks" and (names[0] != "layers" or shape[0] != config.model.num_layers):
            raise ConfigError(f"config.model.name={name!r}: {where} has shape {shape} and names {names}; every "
                              f"block parameter needs a leading 'layers' dim of num_layers={config.model.num_layers}")


def _leaf_at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def abstract_batch(config) -> dict:
    """ShapeDtypeStructs of one global batch."""
    shape = (config.train.global_batch_size, config.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "weights" else jnp.int32)
            for k in ("inputs", "targets", "segment_ids", "positions", "weights")}
