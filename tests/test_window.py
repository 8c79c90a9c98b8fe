"""Sliding-window attention and attention logit soft-capping (`par.attention(..., window=, softcap=)`), and the
Mistral family built on the window.

Op level: every attention implementation the config can select (the reference, blockwise with its custom
backward, splash in Pallas interpret mode, cudnn's jax.nn call, Ulysses, ring, usp, all-gather, the KV-cache
decode) against one independent numpy reference of the windowed, soft-capped mask on packed rows: a row
starting mid-document, several documents, end padding, and windows smaller than, equal to and larger than
a document; gradients against autodiff of a transcription of that reference with the mask built by numpy.
Model level: a tiny random transformers Mistral (window 8, rows of 40 tokens): logits, export round trip,
greedy generation past the window; Mistral training parity on data x fsdp, tensor and pipe x tensor against
one device, and bf16 train / eval / resume.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from helpers import rel_err
from models.llama import Llama
from parallax.parallel import cudnn, flash, sequence, splash

TOL = 1e-5
H, K, DH = 4, 2, 8


def _layout(t):
    """Segment ids and positions [2, t]: row 0 starts mid-document (positions from 5) and holds three
    documents of 3t/8, 5t/16 and 5t/16 tokens; row 1 is one document over the first t - t/8 tokens, then
    t/8 of end padding (segment 0, positions counting up from 0: the kernels that mask by index, splash and
    cudnn, agree with the reference there too)."""
    a, b = 3 * t // 8, 5 * t // 16
    seg = np.stack([np.r_[np.full(a, 1), np.full(b, 2), np.full(t - a - b, 3)],
                    np.r_[np.full(t - t // 8, 1), np.zeros(t // 8)]]).astype(np.int32)
    pos = np.stack([np.r_[np.arange(5, 5 + a), np.arange(b), np.arange(t - a - b)],
                    np.r_[np.arange(t - t // 8), np.arange(t // 8)]]).astype(np.int32)
    return seg, pos


def _inputs(t, seed=0, kv_heads=K):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(2, t, n, DH)).astype(np.float32) for n in (H, kv_heads, kv_heads))
    return q, k, v, *_layout(t)


def _np_mask(seg, pos, window):
    """bool [B, Tq, Tk], pair by pair from the definition: same document, 0 <= q_pos - k_pos < window."""
    b, t = seg.shape
    mask = np.zeros((b, t, t), bool)
    for r in range(b):
        for i in range(t):
            for j in range(t):
                d = int(pos[r, i]) - int(pos[r, j])
                mask[r, i, j] = seg[r, i] == seg[r, j] and 0 <= d and (not window or d < window)
    return mask


def _np_attention(q, k, v, seg, pos, window, softcap):
    """The values, in float64 numpy: query head h uses kv head h // (H / K)."""
    mask = _np_mask(seg, pos, window)
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[2] // k.shape[2]
    out = np.zeros(q.shape)
    for r in range(q.shape[0]):
        for h in range(q.shape[2]):
            s = q[r, :, h] @ k[r, :, h // g].T / math.sqrt(q.shape[-1])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            s = np.where(mask[r], s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[r, :, h] = (p / p.sum(axis=1, keepdims=True)) @ v[r, :, h // g]
    return out


def _jnp_attention(mask, softcap):
    """The numpy reference transcribed to jnp (autodiff gives its gradients), on a numpy-built mask."""
    def fn(q, k, v):
        g = q.shape[2] // k.shape[2]
        kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        s = jnp.einsum("bqhd,bshd->bhqs", q, kk) / math.sqrt(q.shape[-1])
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        p = jax.nn.softmax(jnp.where(jnp.asarray(mask)[:, None], s, -1e30), axis=-1)
        return jnp.einsum("bhqs,bshd->bqhd", p, vv)
    return fn


def _check(fn, args, window, softcap, grads=True):
    """fn(q, k, v, seg, pos) against the numpy values and (`grads`) the transcription's gradients of
    sum(out * a fixed random cotangent) with respect to q, k and v."""
    q, k, v, seg, pos = args
    want = _np_attention(q, k, v, seg, pos, window, softcap)
    seg_j, pos_j = jnp.asarray(seg), jnp.asarray(pos)
    got = jax.jit(lambda q, k, v: fn(q, k, v, seg_j, pos_j))(q, k, v)
    err = rel_err(got, want)
    errs = [err]
    if grads:
        cot = np.random.default_rng(1).normal(size=want.shape).astype(np.float32)
        ref = _jnp_attention(_np_mask(seg, pos, window), softcap)
        g_want = jax.grad(lambda *a: jnp.sum(ref(*a) * cot), argnums=(0, 1, 2))(q, k, v)
        g_got = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a, seg_j, pos_j) * cot), argnums=(0, 1, 2)))(q, k, v)
        errs += [rel_err(a, b) for a, b in zip(g_got, g_want)]
    print(f"window={window} softcap={softcap}: rel errors " + ", ".join(f"{e:.1e}" for e in errs))
    assert max(errs) <= TOL, errs


# windows of 4 (< every document), 10 (= the 10-token documents of t=32), 40 (> the row) and the soft cap alone
# and with a window; the soft cap of 2 changes the logits' scale (~N(0, 1)) substantially
CASES = [(4, 0.0), (10, 0.0), (40, 0.0), (4, 2.0), (0, 2.0)]


def test_the_cases_change_the_values():
    """Each window and the soft cap make a difference on these inputs (so the checks below can fail), and a
    window longer than every document is causal attention."""
    q, k, v, seg, pos = _inputs(32)
    causal = _np_attention(q, k, v, seg, pos, 0, 0.0)
    for window, softcap in CASES[:2] + CASES[3:]:
        assert rel_err(_np_attention(q, k, v, seg, pos, window, softcap), causal) > 0.05, (window, softcap)
    np.testing.assert_array_equal(_np_attention(q, k, v, seg, pos, 40, 0.0), causal)
    assert _np_mask(seg, pos, 10)[0, 12:22, 12:22].sum() == 55  # 10 = the second document: its causal triangle


def test_reference_and_blockwise_attention_match_numpy_and_blockwise_gradients():
    """The reference (values) and the blockwise kernel in 8-token tiles (values and its custom backward)."""
    args = _inputs(32)
    for window, softcap in CASES:
        opts = dict(window=window, softcap=softcap)
        _check(lambda q, k, v, s, p: sequence.attention_reference(q, k, v, s, s, p, p, **opts), args, window, softcap,
               grads=False)
        _check(lambda q, k, v, s, p: flash.blockwise_attention(q, k, v, s, s, p, p, block=8, **opts), args, window,
               softcap)


def test_blockwise_skips_exactly_the_tiles_outside_the_window():
    """One document of 64 tokens in 8-token tiles: the tiles the kernel visits are those holding a visible
    pair (from the numpy mask), a band of 2 tiles per query tile at window 8 and 3 at window 10."""
    t, block = 64, 8
    seg, pos = np.ones((1, t), np.int32), np.arange(t, dtype=np.int32)[None]
    for window, band in ((8, 2), (10, 3), (1, 1)):
        visible = _np_mask(seg, pos, window)[0].reshape(t // block, block, t // block, block).any(axis=(1, 3))
        need = np.asarray(flash._tiles_needed(*(jnp.asarray(a) for a in (seg, seg, pos, pos)), block, block, window))
        np.testing.assert_array_equal(need, visible)
        assert need.sum(axis=1).max() == band, need.astype(int)


def test_splash_window_and_softcap_match_numpy_and_gradients_in_interpret_mode():
    """The Pallas splash kernel (its `LocalMask`, `attn_logits_soft_cap` and its own backward) in one
    128-token tile: window 16 (< every document) with the soft cap, values and gradients; window 40 (= the
    40-token documents), values."""
    args = _inputs(128, seed=2)
    for window, softcap, grads in ((16, 2.0, True), (40, 0.0, False)):
        _check(functools.partial(_splash, window=window, softcap=softcap), args, window, softcap, grads)


def _splash(q, k, v, seg, pos, **opts):
    return splash.splash_attention(q, k, v, seg, seg, pos, pos, platform="cpu", block=128, **opts)


def test_cudnn_wrapper_window_matches_numpy_and_refuses_a_softcap():
    """attention_impl=cudnn's jax.nn call (its XLA implementation here) with `local_window_size`."""
    args = _inputs(32, seed=3)
    for window in (4, 10, 40):
        _check(lambda q, k, v, s, p: cudnn.cudnn_attention(q, k, v, s, s, platform="cpu", window=window), args,
               window, 0.0, grads=window == 4)
    with pytest.raises(ValueError, match="no logit soft-capping"):
        cudnn.cudnn_attention(*args[:3], args[3], args[3], softcap=2.0)


def _mesh(n):
    return jax.make_mesh((n,), ("seq",), (AxisType.Auto,), devices=jax.devices()[:n])


def _seq_parallel(attention, n, order):
    """`attention` over `n` seq ranks on sequence-order inputs: laid out in `order` pieces, sharded, undone."""
    fn = jax.shard_map(attention, mesh=_mesh(n), in_specs=(P(None, "seq"),) * 5, out_specs=P(None, "seq"))

    def run(*args):
        out = fn(*(sequence.pieces_layout(a, order) for a in args))
        return sequence.pieces_unlayout(out, order)
    return run


def _blockwise(*a, **opts):
    return flash.blockwise_attention(*a, block=8, **opts)


@pytest.mark.parametrize("kind", ["ulysses", "ring", "usp", "allgather"])
def test_sequence_parallel_attention_with_window_and_softcap_matches_numpy_and_gradients(kind):
    """Each kind over the seq axis with window 4 and soft cap 2 (ulysses / all-gather with the blockwise
    kernel inside, usp as 2 Ulysses x 2 ring): values and gradients. Ring's per-step skipping stays exact."""
    window, softcap = 4, 2.0
    opts = dict(window=window, softcap=softcap)
    n, order = {"ulysses": (2, (0, 1)), "ring": (2, sequence.zigzag_order(2)), "usp": (4, sequence.usp_order(4, 2)),
                "allgather": (2, sequence.zigzag_order(2))}[kind]
    attention = {
        "ulysses": functools.partial(sequence.ulysses_attention, attend=_blockwise, **opts),
        "ring": functools.partial(sequence.ring_attention, **opts),
        "usp": functools.partial(sequence.usp_attention, ulysses=2, attend=_blockwise, **opts),
        "allgather": functools.partial(sequence.allgather_attention, attend=_blockwise, **opts)}[kind]
    _check(_seq_parallel(attention, n, order), _inputs(32, seed=4), window, softcap)


def test_kv_cache_decode_with_window_and_softcap_matches_numpy():
    """The decode's `par.attention` (parallax.generate): a prefill of 20 tokens, then 12 one-token steps, each
    writing its keys into a 40-slot cache and attending over it, against numpy on the whole 32-token row."""
    from parallax.generate import _CachedParallelism
    from parallax.model import DENSE

    window, softcap = 6, 2.0
    q, k, v, _, _ = _inputs(32, seed=5)
    seg, pos = np.ones((2, 32), np.int32), np.broadcast_to(np.arange(32, dtype=np.int32), (2, 32))
    want = _np_attention(q, k, v, seg, pos, window, softcap)

    @jax.jit
    def decode(q, k, v):
        cache = (jnp.zeros((2, 40, K, DH)), jnp.zeros((2, 40, K, DH)))
        outs = []
        for lo, hi in [(0, 20)] + [(i, i + 1) for i in range(20, 32)]:
            par = _CachedParallelism(DENSE, cache)
            outs.append(par.attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], jnp.asarray(seg[:, lo:hi]),
                                      jnp.asarray(pos[:, lo:hi]), window=window, softcap=softcap))
            cache = par.cache
        return jnp.concatenate(outs, axis=1)
    err = rel_err(decode(q, k, v), want)
    print(f"decode: rel error {err:.1e}")
    assert err <= TOL


def test_attention_options_must_not_be_negative():
    with pytest.raises(ValueError, match="window=-1, softcap=0.0: must be >= 0"):
        sequence.attention_options(-1, None)
    assert sequence.attention_options(None, None) == (0, 0.0)


class _SoftCapped(Llama):
    """A Llama that would attend with a soft cap: what the plan reads is the class's `attention_features`."""

    @staticmethod
    def attention_features(m):
        return frozenset({"softcap"})


def test_the_plan_never_picks_a_kernel_without_the_models_attention_features():
    """A model attending with a soft cap: auto on a GPU in bf16 takes blockwise, not cudnn; an explicit
    cudnn is a one-line config error naming the key, the value and the fix; splash (TPU) has the cap."""
    from helpers import tiny_config
    from parallax.errors import ConfigError
    from parallax.plan import make_plan

    config = tiny_config()
    config.model.update(name="test_window:_SoftCapped", dtype="bfloat16")
    assert make_plan(config, 1, "gpu").parallelism.attention_impl == "blockwise"
    config.model.name = "llama"  # the same config without the cap: cuDNN
    assert make_plan(config, 1, "gpu").parallelism.attention_impl == "cudnn"
    config.model.update(name="test_window:_SoftCapped", attention_impl="cudnn")
    with pytest.raises(ConfigError) as e:
        make_plan(config, 1, "gpu")
    assert str(e.value) == ("config.model.attention_impl='cudnn': jax.nn.dot_product_attention has no attention "
                            "logit soft-capping, and model 'test_window:_SoftCapped' attends with a softcap (its "
                            "attention_features); use attention_impl=blockwise or auto")
    config.model.update(attention_impl="splash", attention_block=128)
    config.train.seq_len = 128
    assert make_plan(config, 1, "tpu").parallelism.attention_impl == "splash"
