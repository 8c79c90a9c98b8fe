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


def gather_seq(x, axis_name: str = "tensor", axis: int = 1):
    """All-gathers the sequence shards before a column-parallel projection: [B, T/t, d] -> [B, T, d].

    Its gradient is `scatter_seq` of the cotangent.
    """
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)


def scatter_seq(y, axis_name: str = "tensor", axis: int = 1):
    """Sums partial results over `axis_name` and keeps this rank's sequence shard: [B, T, d] -> [B, T/t, d].

    Used after a row-parallel projection; its gradient is `gather_seq` of the cotangent.
    """
    return jax.lax.psum_scatter(y, axis_name, scatter_dimension=axis, tiled=True)
