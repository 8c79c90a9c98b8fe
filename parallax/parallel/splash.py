"""Pallas splash attention (the TPU kernel MaxText uses) behind parallax's attention signature.

`splash_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)` has the values of
`sequence.attention_reference` for self-attention over one contiguous layout (the dense path, Ulysses after
its all-to-all, inside pipeline stages): the kernel's causal mask compares token indices, which within a
packed document are its positions shifted by a constant (a row's documents are contiguous and count up by
one), and segment ids mask the other documents. A sliding window is the kernel's `LocalMask` by index for
the same reason, and a logit soft cap its `attn_logits_soft_cap`. So it is not for the ring / all-gather
layouts, whose local queries and keys are zigzag chunks (those keep the blockwise kernel; the plan refuses
the pair).

One difference, on padding only: `parallax.data` gives padding segment 0 and position 0, so in the
reference every padding query sees every padding key, here only the earlier ones. Padding carries weight 0,
so a loss differs only where a padding token's output reaches a real one: in an MoE layer with capacity
dispatch, padding competes for slots (a row padded at the end: an eval split shorter than a row).

Grouped-query attention runs as the kernel's multi-query form per kv head: q [B, T, K, G, Dh] -> for each
batch row and kv head, G query heads against one k / v (vmapped), so k and v are never repeated. The kernel
leaves the 1/sqrt(Dh) scale to the caller. Off TPU it runs in Pallas interpret mode (the tests' CPU path:
exact, slow); on TPU it lowers to the Mosaic kernel (a `tpu_custom_call` in the HLO) with its own VJP.

The sequence length must be a multiple of `block` (tiles of min(block, T), at least 128 on TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_BLOCK = 128


def supports(seq_len: int, block: int) -> bool:
    """Whether the kernel's tiling fits a local sequence of `seq_len` tokens."""
    b = min(block or 512, seq_len)
    return seq_len % MIN_BLOCK == 0 and b % MIN_BLOCK == 0 and seq_len % b == 0


def splash_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions=None, kv_positions=None, *,
                     platform: str | None = None, block: int = 512, window=None, softcap=None):
    """q [B, T, H, Dh]; k, v [B, T, K, Dh] (H % K == 0); segment ids [B, T] -> [B, T, H, Dh] in q's dtype.
    `window` W: the kernel's `LocalMask` with W - 1 keys to the left and none to the right (by index, like
    its causal mask); `softcap`: its `attn_logits_soft_cap` (on the scaled logits, as q arrives scaled)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    from parallax.parallel.sequence import attention_options

    del q_positions, kv_positions  # the causal mask by index equals the one by position (module doc)
    window, softcap = attention_options(window, softcap)
    b, t, h, dh = q.shape
    s, kh = k.shape[1], k.shape[2]
    if s != t or not supports(t, block):
        raise ValueError(f"splash attention needs self-attention over a multiple of {MIN_BLOCK} tokens "
                         f"(q {t}, kv {s}, block {block})")
    g = h // kh
    bt = min(block or 512, t)
    sizes = sk.BlockSizes(block_q=bt, block_kv=bt, block_kv_compute=bt, block_q_dkv=bt, block_kv_dkv=bt,
                          block_kv_dkv_compute=bt, block_q_dq=bt, block_kv_dq=bt)
    one = sm.LocalMask((t, t), (window - 1, 0), 0) if window else sm.CausalMask((t, t))
    mask = sm.MultiHeadMask([one for _ in range(g)])
    kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes, attn_logits_soft_cap=softcap or None,
                                              interpret=(platform or jax.default_backend()) != "tpu")
    qg = (q * jnp.asarray(dh ** -0.5, q.dtype)).reshape(b, t, kh, g, dh).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, Dh)
    kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, T, Dh)

    def row(qg, k, v, q_seg, kv_seg):  # one batch row: (K, G, T, Dh), (K, T, Dh)
        ids = sk.SegmentIds(q=q_seg, kv=kv_seg)
        return jax.vmap(lambda qh, kh_, vh: kernel(qh, kh_, vh, segment_ids=ids))(qg, k, v)

    out = jax.vmap(row)(qg, kk, vv, q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh).astype(q.dtype)
