"""The pipeline's settings (`config.pipeline`), checked and typed once: `resolve(...) -> PipelineSettings`.

Every `config.pipeline.*` error is raised here, with the schedule's facts read from the registry
(`schedule.KINDS`), never from its name; the step paths and the executor read the settings. The layout
`auto` is resolved later by the plan (it needs the model's counted FLOPs: `parallax.plan._auto_layout`).
"""

from __future__ import annotations

import dataclasses

import jax

from parallax.errors import ConfigError
from parallax.pipeline.schedule import DEFAULT, KINDS, Schedule, ScheduleError, balanced_layers, make_schedule
from parallax.pipeline.validate import validate
from parallax.sharding import is_logical_names

# The section `config.pipeline`.
KEYS = dict(
    schedule=DEFAULT,  # gpipe | 1f1b | interleaved_1f1b | zb_h1 | zbv | v_half | v_min | dualpipev | 2bw (pipe > 1)
    microbatches=4,  # pipeline microbatches per step
    virtual_stages=1,  # stages (chunks) per pipeline rank (interleaved_1f1b; zbv, v_half, v_min, dualpipev take 2)
    remat=False,  # store only each chunk's input and recompute its forward in the backward
    layout="even",  # layers per stage: even | auto (the shortest simulated step at counted FLOPs) | "3,5"
    vocab_parallel=False,  # embedding, head and loss split over the pipe ranks along the vocabulary (untied head)
)


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """`config.pipeline` for a mesh of `pipe` ranks, typed (`resolve`). `schedule` is None without a pipeline."""
    name: str
    schedule: Schedule | None  # the validated schedule, with its layer layout when one was given
    microbatches: int
    virtual_stages: int
    remat: bool  # store only each chunk's input and recompute its forward in the backward
    layout: str  # even | auto | the layers per stage, e.g. "3,5"
    vocab_parallel: bool  # embedding, head and loss split over the pipe ranks (only with a pipeline)

    @property
    def steady(self) -> bool:
        """A steady schedule runs (no flush; gradients one step late)."""
        return self.schedule is not None and self.schedule.steady

    @property
    def auto_layout(self) -> bool:
        return self.schedule is not None and self.layout == "auto"


def stale_gradients(section, pipe: int) -> bool:
    """Whether the schedule `section` names delays the gradients itself (a steady schedule over pipe > 1):
    what the optimizer's checks need before the pipeline is resolved."""
    kind = KINDS.get(section.schedule)
    return pipe > 1 and kind is not None and kind.steady


def resolve(section, sizes: dict, *, num_layers: int, vocab_size: int, data_parallel: int, global_batch_size: int,
            accumulation: int, grad_delay: int) -> PipelineSettings:
    """`config.pipeline` for mesh `sizes`; raises ConfigError naming the fix. `data_parallel`: the ways the
    batch splits (replicas included); `accumulation`: `train.microbatches`; `grad_delay`: `optim.grad_delay`."""
    pc, p, replicas = section, sizes["pipe"], sizes.get("replica", 1)
    kind = KINDS.get(pc.schedule)
    plain = dict(name=str(pc.schedule), microbatches=int(pc.microbatches), virtual_stages=int(pc.virtual_stages),
                 remat=bool(pc.remat), layout=str(pc.layout).replace(" ", ""), vocab_parallel=bool(pc.vocab_parallel))
    if p == 1:
        return PipelineSettings(schedule=None, **{**plain, "vocab_parallel": False})
    if replicas > 1 and kind is not None and kind.steady:
        flushing = ", ".join(n for n, k in KINDS.items() if k.flushes)
        raise ConfigError(f"config.mesh.replica={replicas} with pipeline.schedule={pc.schedule!r}: DiLoCo replicas run "
                          f"flushing schedules (a steady window carries the previous step's microbatches, which an "
                          f"outer sync would cut); use pipeline.schedule='{kind.flushing_twin}' (or {flushing})")
    if accumulation != 1:
        raise ConfigError(f"config.train.microbatches={accumulation}: with mesh.pipe={p} the pipeline "
                          f"microbatches the batch itself; set train.microbatches=1 and use pipeline.microbatches")
    if pc.microbatches < 1 or global_batch_size % (data_parallel * pc.microbatches):
        raise ConfigError(
            f"config.pipeline.microbatches={pc.microbatches}: global_batch_size={global_batch_size} must be "
            f"divisible by data-parallel size {data_parallel} (mesh.replica included) x pipeline.microbatches; choose "
            f"a divisor of {global_batch_size // data_parallel}")
    if kind is not None and kind.steady and grad_delay:
        raise ConfigError(f"config.pipeline.schedule={pc.schedule!r} applies each gradient one step late itself, and "
                          "optim.grad_delay=1 would delay it twice; set optim.grad_delay=0 (optim.delay_correction"
                          "=error_feedback still applies, to the pipeline's delay)")
    try:
        schedule = make_schedule(pc.schedule, p, pc.microbatches, pc.virtual_stages)
        validate(schedule)
    except ScheduleError as e:
        raise ConfigError(f"config.pipeline (schedule={pc.schedule!r}, microbatches={pc.microbatches}, "
                          f"virtual_stages={pc.virtual_stages}, mesh.pipe={p}): {e}") from None
    if pc.vocab_parallel:
        t = sizes["tensor"]
        if schedule.steady or replicas > 1:
            raise ConfigError(f"config.pipeline.vocab_parallel=True with schedule={pc.schedule!r}, mesh.replica="
                              f"{replicas}: it runs with the flushing schedules and one replica; "
                              f"set pipeline.vocab_parallel=False")
        if vocab_size % (p * t):
            raise ConfigError(f"config.pipeline.vocab_parallel=True: model.vocab_size={vocab_size} must be divisible "
                              f"by mesh.pipe x mesh.tensor = {p * t} (the head's vocabulary is split over both); "
                              f"pad the vocabulary to {-(-vocab_size // (p * t)) * p * t}")
    layout = plain["layout"]
    if layout == "even" and num_layers % schedule.num_stages:
        raise ConfigError(
            f"config.model.num_layers={num_layers}: not divisible into {schedule.num_stages} pipeline stages "
            f"(mesh.pipe={p} x {schedule.num_chunks} chunks per rank); use a multiple of {schedule.num_stages}, "
            f"or set pipeline.layout='auto' or layers per stage (e.g. '{_spread(num_layers, schedule.num_stages)}')")
    if layout not in ("even", "auto"):  # 'auto' is resolved once the model's parts can be counted (the plan)
        try:
            counts = tuple(int(n) for n in layout.split(","))
        except ValueError:
            counts = ()
        if len(counts) != schedule.num_stages or min(counts) < 0 or sum(counts) != num_layers:
            raise ConfigError(
                f"config.pipeline.layout={pc.layout!r}: give 'even', 'auto' or {schedule.num_stages} layer counts >= "
                f"0, one per stage in stage order (mesh.pipe={p} x {schedule.num_chunks} chunks per rank), summing to "
                f"model.num_layers={num_layers}, e.g. '{_spread(num_layers, schedule.num_stages)}'")
        schedule = schedule.with_layers(counts)
    return PipelineSettings(schedule=schedule, **plain)


def check_parts(settings: PipelineSettings, parts, logical) -> None:
    """The pipeline settings against what the model's parts read (`parallax.pipeline.parts.Parts`, traced
    by the plan; `logical`: the parameters' logical names): a steady schedule runs layers without aux
    values; the vocabulary split over the pipe ranks needs an untied head and an embedding that is one
    lookup table."""
    if settings.steady and parts.stage_aux:
        flushing = " or ".join(n for n, k in KINDS.items() if k.flushes)
        raise ConfigError(f"config.pipeline.schedule={settings.name!r} does not run layers with aux values (this "
                          f"model's MoE layers) yet; use pipeline.schedule={flushing}")
    if not settings.vocab_parallel:
        return
    first, last = parts.first_keys, parts.last_keys
    flat = jax.tree_util.tree_flatten_with_path({k: v for k, v in logical.items() if k != "blocks"},
                                                is_leaf=is_logical_names)[0]
    names = {jax.tree_util.keystr(p): tuple(n) for p, n in flat}
    obstacles = []  # every one, so that one run names all a model would have to change
    if first & last:
        obstacles.append(f"its head shares parameters with its embedding ({', '.join(sorted(first & last))}): "
                         f"it needs an untied head")
    others = sorted(k for k in first if names[k][:1] != ("vocab",))
    if others:
        obstacles.append(f"its embedding reads {', '.join(others)} besides a lookup table over 'vocab': it needs an "
                         f"embedding that is one lookup table")
    if obstacles:
        raise ConfigError(f"config.pipeline.vocab_parallel=True: the model cannot split its embedding and head over "
                          f"the pipe ranks: {'; '.join(obstacles)}; set pipeline.vocab_parallel=False")


def _spread(num_layers, num_stages) -> str:
    return ",".join(map(str, balanced_layers(num_layers, num_stages, 1.0)))
