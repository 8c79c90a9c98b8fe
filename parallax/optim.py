"""Optax optimizers: AdamW with linear warmup + cosine decay, global-norm clipping, weight-decay mask.

Weight decay applies only to matrices: a parameter is decayed when it has at least two dimensions besides
the stacking dimension (`layers`), so norms, biases and other vectors are never decayed even when
stacked over layers. The mask is computed from the logical axis names, not from parameter names.
"""

from __future__ import annotations

import jax
import optax

from parallax.config import ConfigError

_STACKING = ("layers",)


def lr_schedule(optim_config, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio`.

    The decay ends at `optim.decay_steps`, or at `total_steps` when that is 0; a run stopped early (or one
    whose `train.steps` is raised on resume) keeps the schedule it started with if `decay_steps` is set.
    """
    warmup = int(optim_config.warmup_steps)
    total_steps = int(optim_config.decay_steps) or total_steps
    decay_steps = max(total_steps - warmup, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=float(optim_config.lr), warmup_steps=warmup,
        decay_steps=warmup + decay_steps, end_value=float(optim_config.lr) * float(optim_config.min_lr_ratio))


# `head_dim` splits a feature dim into heads: a [heads, head_dim] bias is still a vector.
_NOT_MATRIX_DIMS = ("head_dim",)


def decay_mask(logical_names) -> dict:
    """True for parameters that get weight decay: matrices, i.e. two or more dims besides the stacking
    dims (`layers`) and `head_dim`. Norm scales and biases are not decayed."""
    return jax.tree.map(lambda names: sum(n not in _STACKING + _NOT_MATRIX_DIMS for n in names) >= 2,
                        logical_names, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(optim_config, total_steps: int, logical_names) -> optax.GradientTransformation:
    """The optimizer named by `optim.name` (adamw), with clipping when `optim.clip_norm` > 0."""
    name = optim_config.name
    if name != "adamw":
        raise ConfigError(f"config.optim.name={name!r}: unknown optimizer; valid: adamw")
    tx = optax.adamw(
        learning_rate=lr_schedule(optim_config, total_steps), b1=float(optim_config.b1), b2=float(optim_config.b2),
        eps=float(optim_config.eps), weight_decay=float(optim_config.weight_decay), mask=decay_mask(logical_names))
    if float(optim_config.clip_norm) > 0:
        tx = optax.chain(optax.clip_by_global_norm(float(optim_config.clip_norm)), tx)
    return tx
