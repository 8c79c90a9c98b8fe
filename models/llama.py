"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Options of the decoder that other families of the same shape use (`models/qwen.py`): RoPE frequencies
rewritten for long contexts (`rope_scaling`: linear, or Llama 3.1's `llama3`), a head tied to the embedding
(`tie_embeddings`: one table, the head is its transpose), biases on the q / k / v projections (`qkv_bias`)
and an RMSNorm over each head of q and k before RoPE (`qk_norm`). The last two are fixed per family
(`Llama.layer_options`), not config keys: a family's HF mapping reads and writes exactly its tensors.

A parallax model (`parallax.model.Model`): the layers are stored stacked (every block parameter has a
leading `layers` dimension) and parallax runs them with one `lax.scan`, so compile time does not grow with
depth and the pipeline can cut the stack into chunks. Every parameter carries logical axis names
(`logical` metadata) that `parallax.sharding` maps onto the mesh.

One implementation serves every mesh. The methods take a `Parallelism` (default `DENSE`: the plain
single-program model that the compiler shards over data / FSDP). Under tensor or sequence parallelism the
same code runs per rank on local shards: the residual stream is [B, T/(s*t), D], weights hold H/t heads,
F/t hidden units and V/t vocabulary rows, and the parallel points (`par.weight`, `par.gather_seq` /
`par.scatter_seq` around the projections, `par.attention`, `par.embed`, `par.cross_entropy`) add the
collectives; shapes below are the dense ones.

Shapes: B batch, T length, D d_model, H query heads, K kv heads, Dh head_dim, F d_ff, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import hf_mapping as hf
from parallax.errors import ConfigError
from parallax.model import (DENSE, Model, Parallelism, attention_flops_per_token, check_attention_split,
                            check_row_chunks, constrain, param_flops_per_token)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    d_ff: int
    vocab_size: int
    head_dim: int = 0  # 0: d_model // num_heads
    dtype: str = "float32"  # compute dtype: float32 or bfloat16 (parameters stay float32)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    mlp_chunks: int = 1  # the MLP over this many sequence chunks, each recomputed in the backward (`Blocks.layer`)
    sliding_window: int = 0  # attention to the latest this many positions of a document (0: all earlier ones)
    tie_embeddings: bool = False  # the head is the embedding table's transpose (one parameter)
    rope_scaling: str = "none"  # none | linear | llama3: the RoPE frequencies' rewrite (`rope_frequencies`)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    qkv_bias: bool = False  # biases on the q / k / v projections (not on o)
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before RoPE

    @property
    def dh(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @classmethod
    def from_config(cls, model_config) -> "LlamaConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(model_config).items() if k in fields})


def _param(rngs, shape, logical, std):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), logical=logical)


def rms_norm(x, scale, eps):
    """RMSNorm in fp32, returned in x's dtype. x: [..., D], scale: [D]."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


ROPE_SCALINGS = ("none", "linear", "llama3")


def rope_frequencies(cfg: LlamaConfig):
    """The rotary frequencies, fp32 (Dh/2,): theta^(-2i/Dh), rewritten by `cfg.rope_scaling`.

    linear: all divided by `rope_factor`. llama3 (Llama 3.1's long context, transformers'
    `_compute_llama3_parameters`): with wavelengths 2 pi / f and the pretraining context C =
    `rope_original_positions`, frequencies of wavelength < C / high_freq_factor stay, those of wavelength
    > C / low_freq_factor are divided by `rope_factor`, and those between are interpolated:
    (1 - s) f / factor + s f with s = (C / wavelength - low) / (high - low)."""
    half = cfg.dh // 2
    freqs = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (Dh/2,)
    if cfg.rope_scaling == "linear":
        return freqs / cfg.rope_factor
    if cfg.rope_scaling != "llama3":
        return freqs
    context, low, high = cfg.rope_original_positions, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / freqs
    scaled = jnp.where(wavelength > context / low, freqs / cfg.rope_factor, freqs)
    smooth = (context / wavelength - low) / (high - low)
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return jnp.where(medium, (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled, scaled)


def rope(x, positions, freqs):
    """Rotary embedding on the last dim. x: [B, T, N, Dh], positions: [B, T], freqs: [Dh/2] (`rope_frequencies`)."""
    angles = positions.astype(jnp.float32)[..., None] * freqs  # (B, T, Dh/2)
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]  # (B, T, 1, Dh/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def swiglu(h, gate, up, down):
    """SwiGLU: h [B, T, D] -> [B, T, D]; `gate`, `up` ([D, F]) and `down` ([F, D]) are the weights'
    projections (`par.projection`: `(spec, x) -> y`)."""
    g = gate("btd,df->btf", h)  # (B, T, F)
    u = up("btd,df->btf", h)  # (B, T, F)
    act = constrain(jax.nn.silu(g) * u, ("batch", "length", "act_mlp"))
    return down("btf,fd->btd", act)


class Blocks(nnx.Module):
    """The stacked parameters of all decoder layers; `layer` runs one layer on one slice of them."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        L, D, H, K, Dh, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.dh, cfg.d_ff
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * L)
        self.cfg = cfg
        self.attn_norm = nnx.Param(jnp.ones((L, D)), logical=("layers", "norm"))
        self.wq = _param(rngs, (L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), std)
        self.wk = _param(rngs, (L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), std)
        self.wv = _param(rngs, (L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), std)
        self.wo = _param(rngs, (L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), out_std)
        self.mlp_norm = nnx.Param(jnp.ones((L, D)), logical=("layers", "norm"))
        self.w_gate = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_up = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_down = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), out_std)
        if cfg.qkv_bias:  # split over `tensor` with their heads
            self.bq = nnx.Param(jnp.zeros((L, H, Dh)), logical=("layers", "heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((L, K, Dh)), logical=("layers", "kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((L, K, Dh)), logical=("layers", "kv_heads", "head_dim"))
        if cfg.qk_norm:  # one scale per head_dim entry, shared by the heads
            self.q_norm = nnx.Param(jnp.ones((L, Dh)), logical=("layers", "head_dim"))
            self.k_norm = nnx.Param(jnp.ones((L, Dh)), logical=("layers", "head_dim"))

    def layer(self, x, batch, par: Parallelism = DENSE):
        """One decoder layer; called on a merged slice whose parameters have no `layers` dim. x: [B, T, D].

        Under `par` x is this rank's [B, T/(s*t), D]; the batch arrays are [B, T/s].
        """
        x = self.attend(x, batch, par)
        n = self.cfg.mlp_chunks if x.shape[1] % self.cfg.mlp_chunks == 0 else 1  # a decode step: one position
        if n == 1:
            h = par.gather_seq(rms_norm(x, par.weight(self.mlp_norm), self.cfg.norm_eps))  # (B, T, D)
            return constrain(x + par.scatter_seq(self.mlp(h, par)), ("batch", "length", "act_embed"))
        return constrain(x + self.chunked_mlp(x, n, par), ("batch", "length", "act_embed"))

    def chunked_mlp(self, x, n: int, par: Parallelism = DENSE):
        """The MLP half of `layer` (norm, gather, SwiGLU, scatter) over n chunks of this rank's positions, in a
        scan whose steps are recomputed in the backward: one chunk's [B, T/n, F] intermediates (and, under
        tensor parallelism, its gathered [B, T/n, D] stream) are live, not the row's. The weights are gathered
        once, before the scan. Per-token, so the values are the unchunked ones; the cost is one more MLP
        forward in the backward. x: this rank's [B, T/(s*t), D] -> [B, T/(s*t), D]. Chunk j of rank r's
        positions, gathered over `tensor`, is every rank's chunk j, and the reduce-scatter hands each rank its
        own back."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        scale, mlp = par.weight(self.mlp_norm), [par.projection(v, dt) for v in (self.w_gate, self.w_up, self.w_down)]
        b, tl, d = x.shape

        def one(_, xc):
            return None, par.scatter_seq(swiglu(par.gather_seq(rms_norm(xc, scale, cfg.norm_eps)), *mlp))
        one = jax.checkpoint(one, policy=jax.checkpoint_policies.nothing_saveable)
        _, ys = jax.lax.scan(one, None, jnp.moveaxis(x.reshape(b, n, tl // n, d), 1, 0))
        return jnp.moveaxis(ys, 0, 1).reshape(b, tl, d)

    def attend(self, x, batch, par: Parallelism = DENSE):
        """The attention half of a layer with its residual: x [B, T, D] -> x [B, T, D] (split as `layer`)."""
        cfg, dt, w = self.cfg, self.cfg.compute_dtype, par.weight
        segment_ids, positions = batch["segment_ids"], batch["positions"]
        h = par.gather_seq(rms_norm(x, w(self.attn_norm), cfg.norm_eps))  # (B, T, D)
        q = par.dot("btd,dhk->bthk", h, self.wq, dt)  # (B, T, H, Dh)
        k = par.dot("btd,dhk->bthk", h, self.wk, dt)  # (B, T, K, Dh)
        v = par.dot("btd,dhk->bthk", h, self.wv, dt)  # (B, T, K, Dh)
        if cfg.qkv_bias:
            q, k, v = q + w(self.bq, dt), k + w(self.bk, dt), v + w(self.bv, dt)
        if cfg.qk_norm:  # over each head's Dh, before RoPE
            q, k = rms_norm(q, w(self.q_norm), cfg.norm_eps), rms_norm(k, w(self.k_norm), cfg.norm_eps)
        freqs = rope_frequencies(cfg)
        q = constrain(rope(q, positions, freqs), ("batch", "length", "act_heads", None))
        k = constrain(rope(k, positions, freqs), ("batch", "length", "act_kv_heads", None))
        a = par.attention(q, k, v, segment_ids, positions, window=cfg.sliding_window)  # (B, T, H, Dh)
        x = x + par.scatter_seq(par.dot("bthk,hkd->btd", a, self.wo, dt))
        return constrain(x, ("batch", "length", "act_embed"))

    def mlp(self, h, par: Parallelism = DENSE):
        """SwiGLU on the normed, gathered stream h [B, T, D] -> [B, T, D] (partial sums over `tensor`)."""
        dt = self.cfg.compute_dtype
        return swiglu(h, *(par.projection(v, dt) for v in (self.w_gate, self.w_up, self.w_down)))


class Llama(Model):
    """Decoder-only LM: token embedding, `blocks`, final RMSNorm and a head (untied, or the embedding's
    transpose with `tie_embeddings`)."""

    parallel_axes = ("tensor", "seq")
    # Decoder options fixed by the family (`LlamaConfig` fields that are not config keys): a subclass for a
    # family with q/k/v biases or QK-norm sets them here (models/qwen.py).
    layer_options: dict = {}

    @staticmethod
    def config_defaults() -> dict:
        return dict(
            d_model=64,  # width of the residual stream
            num_heads=4,  # query heads
            num_kv_heads=2,  # key / value heads (grouped-query attention; num_heads a multiple of it)
            d_ff=128,  # SwiGLU hidden width
            head_dim=0,  # per-head width (0: d_model / num_heads)
            rope_theta=10000.0,  # RoPE base frequency
            rope_scaling="none",  # none | linear | llama3: RoPE frequencies rewritten for a longer context
            rope_factor=1.0,  # linear, llama3: the factor low frequencies are divided by
            rope_low_freq_factor=1.0,  # llama3: wavelengths over rope_original_positions / this are scaled
            rope_high_freq_factor=4.0,  # llama3: wavelengths under rope_original_positions / this are kept
            rope_original_positions=8192,  # llama3: the pretraining context length the factors refer to
            tie_embeddings=False,  # the head is the embedding table's transpose (one parameter)
            norm_eps=1e-5,  # RMSNorm epsilon
            init_std=0.02,  # std of the normal initialisation
            mlp_chunks=1,  # the MLP in this many sequence chunks, each recomputed in the backward (less memory)
            sliding_window=0,  # each query attends its document's latest this many positions (0: every earlier one)
        )

    @staticmethod
    def attention_features(m) -> frozenset:
        return frozenset({"window"} if m.sliding_window else ())

    @staticmethod
    def check_config(m, sizes, config) -> None:
        for key in ("d_model", "num_heads", "num_kv_heads", "d_ff"):
            if int(m[key]) <= 0:
                raise ConfigError(f"config.model.{key}={m[key]}: must be positive")
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"config.model.num_heads={m.num_heads}: not divisible by num_kv_heads="
                              f"{m.num_kv_heads}; make num_heads a multiple of num_kv_heads")
        if not m.head_dim and m.d_model % m.num_heads:
            raise ConfigError(f"config.model.d_model={m.d_model}: not divisible by num_heads={m.num_heads}; "
                              f"change one, or set model.head_dim explicitly")
        if (m.head_dim or m.d_model // m.num_heads) % 2:
            raise ConfigError(f"config.model.head_dim={m.head_dim or m.d_model // m.num_heads}: RoPE needs an "
                              f"even head_dim")
        _check_rope(m)
        check_attention_split(m, sizes, config.train.seq_len, m.num_heads, m.num_kv_heads,
                              ("num_heads", "num_kv_heads", "vocab_size", "d_ff"))
        check_row_chunks("mlp_chunks", m.mlp_chunks, sizes, config.train.seq_len)
        if int(m.sliding_window) < 0:
            raise ConfigError(f"config.model.sliding_window={m.sliding_window}: must be >= 0 (0: full causal attention)")

    hf_architectures = ("LlamaForCausalLM",)

    @staticmethod
    def hf_model_keys(c, where):
        """HF Llama config.json -> our keys. Refuses biases, activations other than SiLU and RoPE scalings
        other than linear and llama3 (Llama 3.1 - 3.3)."""
        for key, ok in (("attention_bias", False), ("mlp_bias", False)):
            if c.get(key, ok) != ok:
                hf.unsupported(where, key, c[key], f"parallax's Llama has {key}={ok!r}")
        return decoder_keys(c, where)

    @staticmethod
    def hf_config(m):
        return {**decoder_hf_config(m), "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "attention_bias": False, "mlp_bias": False}

    @staticmethod
    def hf_sources(m, tensor_names=None):
        """Where our parameters live in an HF `LlamaForCausalLM` checkpoint.

        HF `Linear` weights are [out, in]: they are transposed and the heads split out (q_proj [H*Dh, D] ->
        wq [D, H, Dh]; k/v_proj have K*Dh rows under GQA). RoPE: `rope` above rotates the two *halves* of
        each head, which is HF's `rotate_half` convention with the same frequencies, so q / k rows are
        copied as they are (only an interleaved-pair RoPE, as in Meta's original checkpoints, would need a
        row permutation); tests/test_hf.py checks it against transformers' logits. A tied checkpoint
        (`tie_word_embeddings`, no `lm_head.weight`) is tied here too: there is no `head` parameter, and
        export writes no `lm_head.weight`."""
        return decoder_sources(m)

    @staticmethod
    def flops_per_token(m, seq_len, params, logical) -> float:
        """6 per parameter but the embedding table (a lookup, unless it is also the head), plus attention
        over the causal window (the sliding window, where it is shorter)."""
        lookup = () if m.tie_embeddings else ("vocab",)
        keys = min(seq_len, m.sliding_window or seq_len)
        return param_flops_per_token(params, logical, lookup) + attention_flops_per_token(
            m.num_layers, m.num_heads, m.head_dim or m.d_model // m.num_heads, keys)

    def __init__(self, config, rngs: nnx.Rngs):
        cfg = LlamaConfig.from_config({**dict(config), **self.layer_options})
        self.cfg = cfg
        # a table that is also the head starts at the head's scale (as transformers initialises it)
        std = cfg.init_std if cfg.tie_embeddings else 1.0
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std)
        self.blocks = Blocks(cfg, rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,)), logical=("norm",))
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    def embed(self, batch, par: Parallelism = DENSE):
        """tokens [B, T] -> activations [B, T, D] in the compute dtype (this rank's [B, T/(s*t), D] under par)."""
        return par.embed(self.embedding, batch["inputs"], self.cfg.compute_dtype)

    def logits(self, x, par: Parallelism = DENSE):
        """Final norm and head. x [B, T, D] -> logits [B, T, V] in fp32 (this rank's [B, T/s, V/t] under par)."""
        h = par.gather_seq(rms_norm(x, par.weight(self.final_norm), self.cfg.norm_eps))  # (B, T, D)
        if self.cfg.tie_embeddings:
            table = par.weight(self.embedding)  # (V, D)
            logits = jnp.einsum("btd,vd->btv", h, table.astype(h.dtype), preferred_element_type=jnp.float32)
        else:
            head = par.weight(self.head)  # (D, V)
            logits = jnp.einsum("btd,dv->btv", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "act_vocab"))


# --- what the families of this decoder share in their HF mapping (models/qwen.py uses them too) --------------

def _check_rope(m) -> None:
    if m.rope_scaling not in ROPE_SCALINGS:
        raise ConfigError(f"config.model.rope_scaling={m.rope_scaling!r}: expected one of {', '.join(ROPE_SCALINGS)}")
    if m.rope_scaling != "none" and m.rope_factor < 1:
        raise ConfigError(f"config.model.rope_factor={m.rope_factor}: must be >= 1 with rope_scaling="
                          f"{m.rope_scaling!r}")
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise ConfigError(f"config.model.rope_low_freq_factor={m.rope_low_freq_factor}: must be > 0 and below "
                          f"rope_high_freq_factor={m.rope_high_freq_factor} (rope_scaling='llama3')")
    if m.rope_scaling == "llama3" and m.rope_original_positions <= 0:
        raise ConfigError(f"config.model.rope_original_positions={m.rope_original_positions}: must be positive "
                          f"(rope_scaling='llama3')")


def rope_keys(c: dict, where: str) -> dict:
    """Our RoPE keys from an HF config.json: `rope_parameters` (transformers 5) or `rope_scaling` (older),
    `rope_theta` in it or beside it. Refuses rope types other than default, linear and llama3, a partial
    rotary factor, and per-layer-type RoPE."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        hf.unsupported(where, "rope_parameters", rope, "parallax rotates every layer with one RoPE")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        hf.unsupported(where, "partial_rotary_factor", partial, "parallax rotates the whole head (1.0)")
    keys = dict(rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))), rope_scaling="none")
    if rope_type == "default":
        return keys
    if rope_type not in ("linear", "llama3"):
        hf.unsupported(where, "rope_type", rope_type, "parallax implements rope_type 'default', 'linear' and 'llama3'")
    keys.update(rope_scaling=rope_type, rope_factor=float(hf.required(rope, "factor", f"{where} rope_parameters")))
    if rope_type == "llama3":
        original = (rope.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
                    or hf.required(c, "max_position_embeddings", where))
        keys.update(rope_low_freq_factor=float(hf.required(rope, "low_freq_factor", f"{where} rope_parameters")),
                    rope_high_freq_factor=float(hf.required(rope, "high_freq_factor", f"{where} rope_parameters")),
                    rope_original_positions=int(original))
    return keys


def decoder_keys(c: dict, where: str) -> dict:
    """The keys every family of this decoder reads from its HF config.json: sizes, RoPE, the tie, the norm's
    epsilon. Refuses activations other than SiLU."""
    if c.get("hidden_act", "silu") != "silu":
        hf.unsupported(where, "hidden_act", c["hidden_act"], "parallax's decoder has hidden_act='silu'")
    D, H = hf.required(c, "hidden_size", where), hf.required(c, "num_attention_heads", where)
    head_dim = c.get("head_dim") or D // H
    return dict(num_layers=hf.required(c, "num_hidden_layers", where),
                vocab_size=hf.required(c, "vocab_size", where), d_model=D, num_heads=H,
                num_kv_heads=c.get("num_key_value_heads") or H, d_ff=hf.required(c, "intermediate_size", where),
                head_dim=0 if head_dim * H == D else head_dim, **rope_keys(c, where),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)), norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def decoder_hf_config(m) -> dict:
    """The HF config.json entries every family of this decoder writes (`decoder_keys` inverted)."""
    rope = {"rope_type": "default" if m.rope_scaling == "none" else m.rope_scaling, "rope_theta": m.rope_theta}
    if m.rope_scaling != "none":
        rope["factor"] = m.rope_factor
    if m.rope_scaling == "llama3":
        rope.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_positions)
    return {"vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim or m.d_model // m.num_heads,
            "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "rope_parameters": rope, "rope_theta": m.rope_theta,
            "tie_word_embeddings": bool(m.tie_embeddings)}


def decoder_sources(m, qkv_bias: bool = False, qk_norm: bool = False) -> dict:
    """The `Source` of every parameter of this decoder in an HF checkpoint of the Llama layout (the tensor
    names transformers' Llama, Qwen2 and Qwen3 share), with the optional biases and QK-norm scales."""
    D, H, K, F, V = m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.vocab_size
    Dh, S = m.head_dim or D // H, hf.Source
    layer = "model.layers.{i}."
    sources = {
        "embedding": S("model.embed_tokens.weight", (V, D), (V, D)),
        "blocks/attn_norm": S(layer + "input_layernorm.weight", (D,), (D,)),
        "blocks/wq": S(layer + "self_attn.q_proj.weight", (H * Dh, D), (H, Dh, D), (2, 0, 1)),
        "blocks/wk": S(layer + "self_attn.k_proj.weight", (K * Dh, D), (K, Dh, D), (2, 0, 1)),
        "blocks/wv": S(layer + "self_attn.v_proj.weight", (K * Dh, D), (K, Dh, D), (2, 0, 1)),
        "blocks/wo": S(layer + "self_attn.o_proj.weight", (D, H * Dh), (D, H, Dh), (1, 2, 0)),
        "blocks/mlp_norm": S(layer + "post_attention_layernorm.weight", (D,), (D,)),
        "blocks/w_gate": S(layer + "mlp.gate_proj.weight", (F, D), (F, D), (1, 0)),
        "blocks/w_up": S(layer + "mlp.up_proj.weight", (F, D), (F, D), (1, 0)),
        "blocks/w_down": S(layer + "mlp.down_proj.weight", (D, F), (D, F), (1, 0)),
        "final_norm": S("model.norm.weight", (D,), (D,)),
    }
    if qkv_bias:  # [H*Dh] -> [H, Dh]
        for name, heads in (("q", H), ("k", K), ("v", K)):
            sources[f"blocks/b{name}"] = S(layer + f"self_attn.{name}_proj.bias", (heads * Dh,), (heads, Dh))
    if qk_norm:
        for name in ("q", "k"):
            sources[f"blocks/{name}_norm"] = S(layer + f"self_attn.{name}_norm.weight", (Dh,), (Dh,))
    if not m.tie_embeddings:
        sources["head"] = S("lm_head.weight", (V, D), (V, D), (1, 0))
    return sources
