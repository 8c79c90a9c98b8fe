"""DPO's loss on any step path: two passes over the path's weighted cross-entropy, and no second model.

A preference batch row holds one pair: prompt + chosen, then prompt + rejected, as two documents
(`parallax.preference`), with `sign` marking each response's targets (+1 chosen, -1 rejected) and
`ref_logps` the reference model's sums (computed once, before training, by `reference_logps`). The loss is a
nonlinear function of each row's two log-probability sums l_c, l_r (sums over the response tokens of
log p(target) = -c_t, c_t the token's cross-entropy), so it cannot be a weighted token sum; but its gradient
is one: with L = mean over pairs of f(l_c, l_r),

    dL/dc_t = -(df/dl_c)[pair of t] on chosen tokens, -(df/dl_r)[pair of t] on rejected ones,

so a step is (a) a forward pass for every token's c_t, then (b) the path's ordinary weighted cross-entropy
backward with those (signed) weights and divisor 1, whose gradient is exactly DPO's. (a) needs per-token
values from paths that return a scalar sum; a weighted sum is linear in its weights, so the gradient of the
path's `sum` with respect to `weights` is the per-token cross-entropy: every path (dense, manual, pipelined,
with any microbatching) gives it unchanged, and the sums over a row's tokens are plain sums. The second
pass costs one forward more than a language-model step (about 4/3 of it).

Pairs are rows, so microbatches and data shards never split a pair; a row split over `seq` is summed here,
outside the region, by the compiler. The loss and TRL's metrics (`rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`) come from (a), over the global
batch. A row without a chosen response (padding rows of the reference pass) counts for nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallax.errors import ConfigError
from parallax.steps.base import accumulate
from parallax.train_settings import BATCH_KEYS


def lm_batch(batch: dict, weights=None) -> dict:
    """The language-model keys of a preference batch (what a step path reads), `weights` replaced if given."""
    out = {k: batch[k] for k in BATCH_KEYS}
    return out if weights is None else {**out, "weights": weights}


def token_logps(path, params, batch):
    """[B, T] log p(target) at every position, by the path's forward: the gradient of its weighted
    cross-entropy sum with respect to the weights (in `train.microbatches` pieces, as training)."""
    m = path.plan.train.microbatches

    def total(weights):
        b = lm_batch(batch, weights)
        if m == 1:
            return path.sum(params, b)
        return accumulate(lambda mb: path.sum(params, mb), path.split_microbatches(b, m))
    return -jax.grad(total)(batch["weights"].astype(jnp.float32))


def row_sums(values, batch) -> dict:
    """Per row of `values` [B, T]: sums over the chosen and the rejected response targets, and their counts."""
    chosen = (batch["sign"] > 0).astype(jnp.float32) * batch["weights"]  # (B, T)
    rejected = (batch["sign"] < 0).astype(jnp.float32) * batch["weights"]  # (B, T)
    return {"chosen": jnp.sum(values * chosen, axis=1), "rejected": jnp.sum(values * rejected, axis=1),
            "n_chosen": jnp.sum(chosen, axis=1), "n_rejected": jnp.sum(rejected, axis=1)}


def pair_losses(settings, chosen, rejected, ref, counts):
    """Per pair [B]: TRL's loss for `loss_type` from the policy's log-prob sums `chosen`, `rejected` [B], the
    reference's `ref` (row_sums) and the response lengths `counts` (row_sums)."""
    beta = settings.beta
    chosen_ratio, rejected_ratio = chosen - ref["chosen"], rejected - ref["rejected"]
    if settings.loss_type == "sigmoid":
        return -jax.nn.log_sigmoid(beta * (chosen_ratio - rejected_ratio))
    # ipo (TRL): the log-ratios averaged over each response's tokens, then (delta - 1 / (2 beta))^2
    delta = (chosen_ratio / jnp.maximum(counts["n_chosen"], 1.0)
             - rejected_ratio / jnp.maximum(counts["n_rejected"], 1.0))
    return (delta - 1 / (2 * beta)) ** 2


def objective(settings, batch, logps):
    """(mean loss over the batch's pairs, per-row (dL/dl_c, dL/dl_r), TRL's metrics) from per-token `logps`."""
    policy = row_sums(logps, batch)
    ref = row_sums(batch["ref_logps"], batch)
    pairs = (policy["n_chosen"] > 0).astype(jnp.float32)  # (B,) 0: an empty row
    n = jnp.maximum(jnp.sum(pairs), 1.0)

    def mean_loss(chosen, rejected):
        return jnp.sum(pairs * pair_losses(settings, chosen, rejected, ref, policy)) / n
    loss, (d_chosen, d_rejected) = jax.value_and_grad(mean_loss, argnums=(0, 1))(policy["chosen"], policy["rejected"])
    chosen_rewards = settings.beta * (policy["chosen"] - ref["chosen"])
    rejected_rewards = settings.beta * (policy["rejected"] - ref["rejected"])

    def mean(x):
        return jnp.sum(pairs * x) / n
    metrics = {"rewards/chosen": mean(chosen_rewards), "rewards/rejected": mean(rejected_rewards),
               "rewards/accuracies": mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
               "rewards/margins": mean(chosen_rewards - rejected_rewards),
               "logps/chosen": mean(policy["chosen"]), "logps/rejected": mean(policy["rejected"])}
    return loss, (d_chosen, d_rejected), metrics


def loss_grads_metrics(path, params, batch):
    """(mean DPO loss, its gradients, {}, TRL's metrics) of a preference batch on `path`: (a) the per-token
    log-probs, (b) the weighted cross-entropy gradient with weights -dL/dl of each token's response."""
    settings = path.plan.dpo
    logps = jax.lax.stop_gradient(token_logps(path, params, batch))
    loss, (d_chosen, d_rejected), metrics = objective(settings, batch, logps)
    chosen = (batch["sign"] > 0).astype(jnp.float32) * batch["weights"]
    rejected = (batch["sign"] < 0).astype(jnp.float32) * batch["weights"]
    # dL/dc_t = -dL/dl of t's response (l = -sum c): the weights of a weighted cross-entropy sum of gradient dL
    weights = jax.lax.stop_gradient(-(d_chosen[:, None] * chosen + d_rejected[:, None] * rejected))  # (B, T)
    b = lm_batch(batch, weights)
    m = path.plan.train.microbatches
    if m == 1:
        _, grads, aux = path.sum_and_grads(params, b)
    else:
        def piece(mb):
            _, g, a = path.sum_and_grads(params, mb)
            return jax.tree.map(lambda x: x.astype(jnp.float32), g), a
        grads, aux = accumulate(piece, path.split_microbatches(b, m))
    if aux:
        raise ConfigError("config.data.source='preference': this model's layers return aux values (a MoE router's "
                          "losses, weighted by token weights), which DPO's signed weights would change; DPO runs "
                          "dense models")
    return loss, grads, {}, metrics


def eval_sums(path, params, batch):
    """[sum of the pairs' DPO losses, number of pairs] of one batch (forward only): eval's mean is over pairs."""
    logps = token_logps(path, params, batch)
    loss, _, _ = objective(path.plan.dpo, batch, logps)
    pairs = jnp.sum((jnp.sum((batch["sign"] > 0) * batch["weights"], axis=1) > 0).astype(jnp.float32))
    return jnp.stack([loss * jnp.maximum(pairs, 1.0), pairs])


def response_logps(path, params, batch):
    """[B, 2] the policy's log-prob sums of each row's chosen and rejected responses (forward only): what the
    reference pass stores, with the starting parameters."""
    sums = row_sums(token_logps(path, params, batch), batch)
    return jnp.stack([sums["chosen"], sums["rejected"]], axis=1)
