"""8-bit matmuls (`config.quant`): the layers' projections with int8 or fp8 operands, on every mesh.

A model's projection is `par.dot(spec, x, weight_param, dtype)` (`parallax.parallel.manual.Parallelism.dot`):
an einsum of an activation and one weight. With `quant.mode` set it runs here, as one `jax.custom_vjp`:

    forward   y  = (q(x) . q(w)) * s_x * s_w       x per token, w per output channel (rowwise modes),
                                                   or x in 1 x B tiles and w in B x B tiles (fp8_block)
    backward  dx = (q(g) . q(w~)^T) * s_g * s_w~   g per token; w~ = the forward's dequantized weight,
                                                   quantized per input channel (per tile for fp8_block)
              dw = x^T . g                         high precision (fp32 accumulation), straight through
                                                   the quantizer (its gradient is taken as the identity)

| mode | forward operands | dx operands | dot accumulates in |
|---|---|---|---|
| `int8` | int8 (absmax / 127, round to nearest) | int8 | int32 |
| `fp8` | float8_e4m3fn (absmax / 448) | float8_e5m2 (absmax / 57344) | fp32 |
| `fp8_block` | e4m3, 1 x B activation tiles, B x B weight tiles (DeepSeek-V3's recipe, B = `quant.block`) | e5m2, 1 x B tiles | fp32 per tile |

Only dw stays in high precision, as MaxText's int8 recipe (AQT with the weight gradient unquantized) and
DeepSeek-V3's keep their most sensitive product. Scales are *current* (from this step's tensors): an amax
history (delayed scaling) is not built, because every scale here is per token or per channel / tile, which
is what makes them independent of the batch, its microbatches and the mesh.

**Scales independent of the mesh.** A scale is a max over the dims a dot contracts. Inside the manual region
(`parallax.parallel.manual`) a contracting dim may be split over `tensor` (the out projections' heads, the
MLP's hidden units) or, for a weight, over an FSDP axis: the local max is then wrong, and the scale's `pmax`
over those axes gives every rank the one a single device computes. The rowwise scales of tokens need no
collective over batch axes (a token's row is whole on its rank), which is why they are per token rather than
per tensor. fp8_block needs no collective at all: its tiles never straddle a shard (a ConfigError asks for local
sizes that are multiples of B).

**8-bit weight all-gathers.** A weight dim split over an FSDP axis is quantized on its shard (with the
global scale above), then gathered: the gather moves 1 byte per value instead of 2 (bf16) or 4, and the
shard's gradient is reduce-scattered in fp32 as `manual._gather_cast` does. Under the compiler's sharding
(no region: `DENSE`) the same code runs on global arrays and XLA places the gathers.

Which dots: a model's projections through `par.dot` (every attention and MLP projection of the models in
`models/`); embeddings, norms, the router, the experts' grouped matmuls, attention itself and the head stay
in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from parallax.errors import ConfigError

MODES = ("none", "int8", "fp8", "fp8_block")
# The section `config.quant`.
KEYS = dict(
    mode="none",  # none | int8 | fp8 | fp8_block: the layers' projections in 8 bits (docs/quantization.md)
    block=128,  # fp8_block: the tile (activations 1 x block, weights block x block), along flattened dims
    gather=True,  # FSDP: quantize a weight's shard before its all-gather (1 byte per value moved)
    generate="quantized",  # quantized | high: sampling and lm-eval on the 8-bit dots, or in the compute dtype
)

# (forward dtype, its largest value, dx's gradient dtype, its largest value, accumulation dtype)
_FORMATS = {
    "int8": (jnp.int8, 127.0, jnp.int8, 127.0, jnp.int32),
    "fp8": (jnp.float8_e4m3fn, 448.0, jnp.float8_e5m2, 57344.0, jnp.float32),
    "fp8_block": (jnp.float8_e4m3fn, 448.0, jnp.float8_e5m2, 57344.0, jnp.float32),
}


@dataclasses.dataclass(frozen=True)
class QuantSettings:
    """`config.quant`, typed (`resolve`)."""
    mode: str  # int8 | fp8 | fp8_block
    block: int
    gather: bool
    generate: str  # quantized | high (eval_loss always runs the training step's dots)

    @property
    def blockwise(self) -> bool:
        return self.mode == "fp8_block"


def resolve(section) -> QuantSettings | None:
    """`config.quant` checked; None when `mode='none'`."""
    mode = str(section.mode)
    if mode not in MODES:
        raise ConfigError(f"config.quant.mode={mode!r}: expected one of {', '.join(MODES)}")
    if int(section.block) <= 0:
        raise ConfigError(f"config.quant.block={section.block}: must be a positive tile size (128 is DeepSeek-V3's)")
    if str(section.generate) not in ("quantized", "high"):
        raise ConfigError(f"config.quant.generate={section.generate!r}: expected quantized (the 8-bit dots, as "
                          "trained) or high (the compute dtype)")
    if mode == "none":
        return None
    return QuantSettings(mode=mode, block=int(section.block), gather=bool(section.gather),
                         generate=str(section.generate))


# --- the einsum in canonical form --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """How one projection's einsum maps onto [rows..., K] x [K, N] (static).

    `spec` is 'x,w->out' with single letters, x the activation and w the weight; K is w's contracting dims
    flattened in w's order, N its other dims flattened; a letter in x, w and out (a batch dim of the dot) is
    not supported. Axes (manual region only, else empty): `k_axes` split a contracting dim of x (and of the
    gathered w) over ranks, `w_k_axes` split one of the local w shard (with the FSDP axes it is gathered
    over), `n_axes` split an output dim of the gathered w; `gather` is ((w dim, axes), ...) to all-gather."""
    spec: str
    k_axes: tuple = ()
    w_k_axes: tuple = ()
    n_axes: tuple = ()
    gather: tuple = ()

    def letters(self):
        ins, out = self.spec.split("->")
        x, w = ins.split(",")
        contract = tuple(c for c in w if c in x and c not in out)
        if any(c in x and c in w for c in out):
            raise ValueError(f"{self.spec}: a dim in x, w and the output is not supported by quant.dot")
        return x, w, out, contract


def _pmax(a, axes):
    return jax.lax.pmax(a, axes) if axes else a


def _canonical_x(x, layout):
    """x -> ([rows..., K], the rows' letters)."""
    xl, wl, _, contract = layout.letters()
    rows = tuple(c for c in xl if c not in contract)
    perm = [xl.index(c) for c in rows + contract]
    xt = jnp.transpose(x, perm)
    return xt.reshape(*xt.shape[:len(rows)], -1), rows


def _canonical_w(w, layout):
    """w -> ([K, N], w's output letters, their sizes)."""
    xl, wl, _, contract = layout.letters()
    outs = tuple(c for c in wl if c not in contract)
    perm = [wl.index(c) for c in contract + outs]
    wt = jnp.transpose(w, perm)
    k = math.prod(wt.shape[:len(contract)])
    return wt.reshape(k, -1), outs, wt.shape[len(contract):]


def _from_canonical(y2, rows, outs, out_sizes, layout):
    """[rows..., N] -> the einsum's output layout."""
    _, _, ol, _ = layout.letters()
    y = y2.reshape(*y2.shape[:-1], *out_sizes)
    have = rows + outs
    return jnp.transpose(y, [have.index(c) for c in ol])


def _scale(amax, qmax):
    """amax -> the scale (1 where amax is 0: an all-zero row quantizes to zeros)."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, amax / qmax, 1.0)


def _quantize(a, scale, dtype, qmax):
    """a / scale, rounded to nearest and saturated to the format's range, in `dtype`."""
    v = jnp.clip(a.astype(jnp.float32) / scale, -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        v = jnp.round(v)
    return v.astype(dtype)


def quantize_rows(a2, dtype, qmax, axes=(), axis=-1):
    """a2 quantized along `axis` (the contracting one): (q, scale with that axis kept as 1)."""
    s = _scale(_pmax(jnp.max(jnp.abs(a2), axis=axis, keepdims=True), axes), qmax)
    return _quantize(a2, s, dtype, qmax), s


def quantize_tiles(a2, dtype, qmax, block, tile_rows: bool):
    """Tiles of `block` along the last dim (1 x B), or B x B over both dims of a [K, N] weight (`tile_rows`):
    (q reshaped [..., K/B, B] or [K/B, B, N/B, B], scale broadcastable to it)."""
    if tile_rows:
        k, n = a2.shape
        t = a2.reshape(k // block, block, n // block, block)
        s = _scale(jnp.max(jnp.abs(t), axis=(1, 3), keepdims=True), qmax)
    else:
        t = a2.reshape(*a2.shape[:-1], a2.shape[-1] // block, block)
        s = _scale(jnp.max(jnp.abs(t), axis=-1, keepdims=True), qmax)
    return _quantize(t, s, dtype, qmax), s


def _dot_rows(xq, xs, wq, ws, acc):
    """[rows..., K] x [K, N] of quantized operands, scaled back: fp32 [rows..., N]."""
    y = jnp.einsum("...k,kn->...n", xq, wq, preferred_element_type=acc)
    return y.astype(jnp.float32) * xs * ws


def _dot_tiles(xq, xs, wq, ws, acc):
    """Tiled operands (`quantize_tiles`): x [..., T, B] with scales [..., T, 1], w [T, B, M, B] with scales
    [T, 1, M, 1] -> fp32 [..., M * B]. Each tile's product is accumulated on its own, scaled, then summed over
    the tiles (a block-scaled GEMM's order)."""
    p = jnp.einsum("...tk,tkmn->...tmn", xq, wq, preferred_element_type=acc).astype(jnp.float32)  # (..., T, M, B)
    y = jnp.sum(p * xs[..., None] * jnp.squeeze(ws, 1), axis=-3)  # (..., M, B)
    return y.reshape(*y.shape[:-2], -1)


def _gather(w, gathers):
    for dim, axes in gathers:
        w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def _weight(w, dtype, settings, layout):
    """This rank's weight shard, in the compute `dtype`, quantized for the forward and gathered: (wq [K, N]
    (tiles for fp8_block), its scales, w's output letters and sizes)."""
    fwd, fmax = _FORMATS[settings.mode][:2]
    w = w.astype(dtype)
    if settings.blockwise:  # tiles never straddle a shard: the gather moves the compute dtype
        w2, outs, sizes = _canonical_w(_gather(w, layout.gather), layout)
        _check_tiles(*w2.shape, settings, layout)
        wq, ws = quantize_tiles(w2, fwd, fmax, settings.block, tile_rows=True)
        return wq, ws, outs, sizes
    _, wl, _, contract = layout.letters()
    kdims = tuple(wl.index(c) for c in contract)
    scale_gathers = tuple((d, a) for d, a in layout.gather if d not in kdims)  # a scale's K dims are 1
    if settings.gather:  # per output channel, the max across every rank holding a part of the contracting
        # dims; the 8-bit shard and its scale are gathered
        s = _scale(_pmax(jnp.max(jnp.abs(w), axis=kdims, keepdims=True), layout.w_k_axes), fmax)
        wq, s = _gather(_quantize(w, s, fwd, fmax), layout.gather), _gather(s, scale_gathers)
    else:
        w = _gather(w, layout.gather)
        s = _scale(_pmax(jnp.max(jnp.abs(w), axis=kdims, keepdims=True), layout.k_axes), fmax)
        wq = _quantize(w, s, fwd, fmax)
    w2, outs, sizes = _canonical_w(wq, layout)
    return w2, _canonical_w(s, layout)[0], outs, sizes  # scales [1, N]


_TRACED = [0]  # quantized dots traced so far (`check_used`)


def check_used(trace, model_name: str, *args) -> None:
    """Raises a ConfigError when tracing `trace(*args)` (the model's forward, abstract) runs no 8-bit dot: its
    projections do not go through `par.dot`, so `quant.mode` would change nothing ("configured" is not
    "running")."""
    before = _TRACED[0]
    jax.eval_shape(trace, *args)
    if _TRACED[0] == before:
        raise ConfigError(f"config.quant.mode: model {model_name!r} runs no projection through par.dot, so nothing "
                          "would run in 8 bits; set quant.mode=none, or project with par.dot (the model contract)")


def _check_tiles(k: int, n: int, settings, layout) -> None:
    if settings.blockwise and (k % settings.block or n % settings.block):
        raise ConfigError(f"config.quant.block={settings.block}: the projection {layout.spec} multiplies [{k}] by "
                          f"[{k}, {n}] here (contracting x output values, per rank); fp8_block tiles both by the "
                          f"block: use a block dividing {k} and {n} (a power of two), or quant.mode=fp8")


def _forward(x, w, settings, layout):
    _TRACED[0] += 1
    fwd, fmax, _, _, acc = _FORMATS[settings.mode]

    wq, ws, outs, sizes = _weight(w, x.dtype, settings, layout)
    x2, rows = _canonical_x(x, layout)
    if settings.blockwise:
        xq, xs = quantize_tiles(x2, fwd, fmax, settings.block, tile_rows=False)
        y2 = _dot_tiles(xq, xs, wq, ws, acc)
    else:
        xq, xs = quantize_rows(x2, fwd, fmax, layout.k_axes)
        y2 = _dot_rows(xq, xs, wq, ws, acc)
    return _from_canonical(y2, rows, outs, sizes, layout).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dot(x, w, settings: QuantSettings, layout: Layout):
    """einsum(layout.spec, x, w) with 8-bit operands (module docstring). `w` is this rank's shard of the
    weight (the fp32 master copy), gathered here (`layout.gather`); the output is in x's dtype."""
    return _forward(x, w, settings, layout)


def _dot_fwd(x, w, settings, layout):
    return _forward(x, w, settings, layout), (x, w)


def _dot_bwd(settings, layout, res, g):
    x, w = res
    fwd, fmax, bwd, bmax, acc = _FORMATS[settings.mode]
    wq, ws, outs, sizes = _weight(w, x.dtype, settings, layout)  # the forward's operand (the gather again)
    x2, rows = _canonical_x(x, layout)
    xl, wl, ol, contract = layout.letters()
    g2 = jnp.transpose(g, [ol.index(c) for c in rows + outs]).reshape(*x2.shape[:-1], -1)  # (rows..., N)
    k, n = x2.shape[-1], g2.shape[-1]
    w_deq = (wq.astype(jnp.float32) * ws).reshape(k, n)  # the weight the forward multiplied by
    if settings.blockwise:  # dx: g in 1 x B tiles along N, w~^T in B x B tiles
        gq, gs = quantize_tiles(g2, bwd, bmax, settings.block, tile_rows=False)
        wtq, wts = quantize_tiles(w_deq.T, fwd, fmax, settings.block, tile_rows=True)
        dx2 = _dot_tiles(gq, gs, wtq, wts, acc)
    else:  # dx: g per token, w~ per input channel (the max over the output dims, across their ranks)
        gq, gs = quantize_rows(g2, bwd, bmax, layout.n_axes)
        wtq, wts = quantize_rows(w_deq, fwd, fmax, layout.n_axes)  # (K, N), scales (K, 1)
        dx2 = _dot_rows(gq, gs, wtq.T, wts.T, acc)
    dx = dx2.reshape(*dx2.shape[:-1], *[x.shape[xl.index(c)] for c in contract])
    dx = jnp.transpose(dx, [(rows + contract).index(c) for c in xl]).astype(x.dtype)
    # dw: x^T g in fp32 (straight through the quantizer), reduce-scattered back to this rank's shard in fp32
    dw = jnp.einsum(f"{xl},{ol}->{wl}", x, g, preferred_element_type=jnp.float32)
    for dim, axes in reversed(layout.gather):
        dw = jax.lax.psum_scatter(dw, axes, scatter_dimension=dim, tiled=True)
    return dx, dw.astype(w.dtype)


dot.defvjp(_dot_fwd, _dot_bwd)
