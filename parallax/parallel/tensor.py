"""Megatron tensor parallelism with sequence parallelism, as explicit collectives over `tensor`.

Owns the column/row-parallel projections and the sequence-parallel boundaries around them. Called inside a
`jax.shard_map` manual over `tensor`. Between blocks the residual stream is sharded over `tensor` along the
sequence ([B, T/t, d] per rank), so norms and dropout run on 1/t of the tokens; a block is

    x_btd = gather_seq(x_local)                  # all-gather:     [B, T/t, d] -> [B, T, d]
    h_btf = x_btd @ w_df_local                   # column-parallel, no collective: [B, T, f/t]
    y_btd = h_btf @ w_fd_local                   # row-parallel, partial sums:     [B, T, d]
    y_local = scatter_seq(y_btd)                 # reduce-scatter: [B, T, d] -> [B, T/t, d]

instead of Megatron's all-reduce: the same bytes, and no replicated activations. Autodiff turns each
all-gather into a reduce-scatter and vice versa.

Communication per block, forward, per device (b = bytes per element): all-gather receives
(t-1)/t * B*T*d*b bytes, reduce-scatter sends (t-1)/t * B*T*d*b bytes; the backward repeats both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def reduction_dtype(dtype, platform: str | None = None):
    """The dtype a cross-device sum of `dtype` values runs in, on `platform` (the devices compiled for:
    `Parallelism.platform`, which the plan takes from the mesh's devices; None: `jax.default_backend()`).

    On XLA:CPU, bf16 / f16: float32. XLA:CPU sums those in f32 anyway (its AllReducePromotion pass), but that
    pass aborts the compile (`hlo_instruction.cc: Invalid binary instruction opcode copy`) when it meets a
    bf16 reduce-scatter whose reducer computation ends in a copy, which is what the reduce-scatters inside
    the pipeline executor's switch branches look like (bf16 + pipe=2 + tensor=2 was enough). Minimal
    reproduction: Trainer of configs/tiny.py with mesh pipe=2 tensor=2 data=2, model.dtype=bfloat16,
    `loss_and_grads.lower(...).compile()`. On GPU / TPU the collective keeps the input dtype.
    """
    dtype = jnp.dtype(dtype)
    if (platform or jax.default_backend()) == "cpu" and dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float32)
    return dtype


def gather_seq(x, axis_name: str = "tensor", axis: int = 1, platform: str | None = None):
    """All-gathers the sequence shards before a column-parallel projection: [B, T/t, d] -> [B, T, d].

    Its gradient is `scatter_seq` of the cotangent (a reduce-scatter, in `reduction_dtype`).
    """
    dt = reduction_dtype(x.dtype, platform)
    return jax.lax.all_gather(x.astype(dt), axis_name, axis=axis, tiled=True).astype(x.dtype)


def scatter_seq(y, axis_name: str = "tensor", axis: int = 1, platform: str | None = None):
    """Sums partial results over `axis_name` and keeps this rank's sequence shard: [B, T, d] -> [B, T/t, d].

    Used after a row-parallel projection; its gradient is `gather_seq` of the cotangent. Sums in
    `reduction_dtype`.
    """
    dt = reduction_dtype(y.dtype, platform)
    return jax.lax.psum_scatter(y.astype(dt), axis_name, scatter_dimension=axis, tiled=True).astype(y.dtype)
