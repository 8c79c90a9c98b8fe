"""DPO's settings (`config.dpo`), checked and typed once: `resolve(section, ...) -> DpoSettings`.

A run trains with DPO when its data is preference pairs (`data.source='preference'`, `parallax.preference`);
this section says which pairwise loss and how the pairs are cut. Every `config.dpo.*` error is raised here,
and so are the layouts DPO does not run on; `parallax/steps/dpo.py` (the loss on a step path) reads the
settings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from parallax.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo")
# The section `config.dpo` (read with data.source='preference').
KEYS = dict(
    loss_type="sigmoid",  # sigmoid (DPO) | ipo (IPO on length-normalised log-ratios, as TRL's loss_type='ipo')
    beta=0.1,  # DPO's beta (the KL weight against the reference); IPO's tau: the target margin is 1 / (2 beta)
    max_length=0,  # TRL's max_length: prompt + chosen and prompt + rejected each cut to this many tokens (0: none)
    chat_template="",  # conversational pairs: '' (the tokenizer's own), chatml | llama3, or a .jinja file
)
# The arrays a preference batch has besides the language model's (`train_settings.BATCH_KEYS`), each
# [rows, seq_len] float32: +1 where the target is a token of the chosen response, -1 of the rejected one,
# 0 elsewhere; and the reference model's log-probability sums of the row's chosen and rejected responses,
# at the first target of each (0 elsewhere), so that a masked row sum gives the reference's sum.
BATCH_KEYS = ("sign", "ref_logps")


@dataclasses.dataclass(frozen=True)
class DpoSettings:
    """`config.dpo`, typed (`resolve`)."""
    loss_type: str  # sigmoid | ipo
    beta: float
    max_length: int  # 0: no truncation
    chat_template: str


def resolve(section, sizes: dict, steady: bool) -> DpoSettings:
    """`config.dpo` for a mesh of `sizes` (`steady`: the pipeline schedule is 2bw's); raises ConfigError."""
    d = section
    if d.loss_type not in LOSS_TYPES:
        raise ConfigError(f"config.dpo.loss_type={d.loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
    if not float(d.beta) > 0:
        raise ConfigError(f"config.dpo.beta={d.beta}: must be > 0 (TRL's default is 0.1)")
    if int(d.max_length) < 0:
        raise ConfigError(f"config.dpo.max_length={d.max_length}: must be >= 0 (0: no truncation)")
    if sizes.get("replica", 1) > 1:
        raise ConfigError(f"config.mesh.replica={sizes['replica']}: DPO (data.source='preference') runs without "
                          "DiLoCo replicas; set mesh.replica=1")
    if steady:
        raise ConfigError("config.pipeline.schedule: DPO (data.source='preference') needs a flushing schedule (its "
                          "second pass weights each token by the first pass's result); use 1f1b, gpipe or zb_h1")
    return DpoSettings(loss_type=str(d.loss_type), beta=float(d.beta), max_length=int(d.max_length),
                       chat_template=str(d.chat_template))


def batch_shapes(rows: int, seq_len: int) -> dict:
    """ShapeDtypeStructs of the preference keys of a batch (`BATCH_KEYS`)."""
    return {k: jax.ShapeDtypeStruct((rows, seq_len), jnp.float32) for k in BATCH_KEYS}
