"""cuDNN flash attention (`jax.nn.dot_product_attention`, implementation "cudnn") behind parallax's attention
signature: the GPU kernel torchtitan and Megatron call through PyTorch / Transformer Engine.

`cudnn_attention(q, k, v, q_segment_ids, kv_segment_ids, platform=...)` has the values of
`sequence.attention_reference` for self-attention over one contiguous layout (the dense path, Ulysses
after its all-to-all, inside pipeline stages), like the splash kernel and for the same reason: the
kernel's causal mask compares token indices, which within a packed document are its positions shifted by
a constant; a boolean mask [B, 1, T, T] of same-document pairs hides the other documents (padding, segment
0, is one more document); a sliding window is its `local_window_size`, by index for the same reason (the
logit soft cap is not in the API: the plan refuses it). jax.nn's API takes no segment ids, so the mask is
dense: T^2 bytes per row, which cuDNN reads as a bias (the kernel still keeps no [T, T] scores for the
backward). Grouped-query and
multi-query attention are the API's own (K kv heads for H query heads, H % K == 0); the scale is its
default, 1/sqrt(Dh). cuDNN needs float16 / bfloat16 inputs (the plan checks `model.dtype`). On padding
it differs from the reference as the splash kernel does (`parallax.parallel.splash`): a padding query sees
the earlier padding keys only; padding has weight 0.

Off GPU the same call runs with implementation "xla" (jax.nn's own dense reference), so the CPU tests check
this wrapper (layout, mask, GQA, scale) on the path a GPU takes; the cuDNN kernel itself has not run here
(no GPU was lent): `launch/bench.py --part=device` on a GPU machine says which kernel ran.
"""

from __future__ import annotations

import jax


def cudnn_attention(q, k, v, q_segment_ids, kv_segment_ids, *, platform: str | None = None, window=None,
                    softcap=None):
    """q [B, T, H, Dh], k / v [B, T, K, Dh], segment ids [B, T] -> [B, T, H, Dh] in q's dtype. `window` W:
    the API's `local_window_size=(W - 1, 0)` (by index, like its causal mask; cuDNN's sliding window of W);
    `softcap`: not in the API, a ValueError (the plan refuses attention_impl=cudnn for such a model)."""
    from parallax.parallel.sequence import attention_options

    window, softcap = attention_options(window, softcap)
    if softcap:
        raise ValueError("cudnn attention: jax.nn.dot_product_attention has no logit soft-capping; use the "
                         "blockwise or splash kernel")
    implementation = "cudnn" if (platform or jax.default_backend()) == "gpu" else "xla"
    same_doc = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]  # (B, 1, T, T)
    return jax.nn.dot_product_attention(q, k, v, mask=same_doc, is_causal=True, implementation=implementation,
                                        local_window_size=(window - 1, 0) if window else None)
