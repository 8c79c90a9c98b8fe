"""DiLoCo's settings (`config.diloco`), checked and typed once: `resolve(section, num_layers) -> DilocoSettings`.

Every `config.diloco.*` error is raised here; `parallax/steps/diloco.py` (the replicas' inner steps and
the outer sync) reads the settings. The layouts replicas cannot run (a steady pipeline schedule, the
vocabulary split over the pipe ranks) are the pipeline settings' checks (`parallax/pipeline/settings.py`).
"""

from __future__ import annotations

import dataclasses

from parallax.errors import ConfigError

PSEUDO_GRAD_DTYPES = ("float32", "bfloat16", "int8")
# The section `config.diloco` (read with mesh.replica > 1).
KEYS = dict(
    sync_every=50,  # inner steps between outer syncs (DiLoCo's H), with mesh.replica > 1
    outer_lr=0.7,  # the outer optimizer's learning rate (DiLoCo: 0.7; 1 with outer_momentum=0: averaging)
    outer_momentum=0.9,  # the outer optimizer's momentum (0: plain SGD)
    nesterov=True,  # Nesterov momentum for the outer optimizer
    pseudo_grad_dtype="float32",  # float32 | bfloat16 | int8: what the pseudo-gradients travel as
    error_feedback=True,  # bfloat16 / int8: add each replica's rounding error to its next pseudo-gradient
    fragments=1,  # Streaming DiLoCo: the layer stack in this many parts, synced at staggered steps
    overlap=0,  # 0 | 1: a fragment's exchange runs beside the next inner step and is applied after it
    mix=0.5,  # overlap=1: a replica's synced fragment becomes mix * its own + (1 - mix) * the new global one
)



@dataclasses.dataclass(frozen=True)
class DilocoSettings:
    """`config.diloco`, typed (`resolve`)."""
    sync_every: int  # DiLoCo's H: inner steps between outer syncs
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    pseudo_grad_dtype: str  # float32 | bfloat16 | int8
    error_feedback: bool  # only where the exchange rounds (bfloat16, int8)
    fragments: int  # Streaming DiLoCo's parts of the layer stack
    overlap: int  # 0 | 1
    mix: float


def resolve(section, num_layers: int) -> DilocoSettings:
    """`config.diloco` for a model of `num_layers` layers; raises ConfigError naming the fix."""
    d = section
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
    f = int(d.fragments)
    if f < 1 or f > int(d.sync_every) or num_layers % f:
        raise ConfigError(f"config.diloco.fragments={d.fragments}: must divide model.num_layers={num_layers} and be "
                          f"at most diloco.sync_every={d.sync_every} (one fragment syncs at a time); e.g. 1")
    return DilocoSettings(
        sync_every=int(d.sync_every), outer_lr=float(d.outer_lr), outer_momentum=float(d.outer_momentum),
        nesterov=bool(d.nesterov), pseudo_grad_dtype=str(d.pseudo_grad_dtype),
        error_feedback=bool(d.error_feedback) and d.pseudo_grad_dtype != "float32", fragments=f,
        overlap=int(d.overlap), mix=float(d.mix))
