"""Gemma 2 and Gemma 3 (text): `Gemma2ForCausalLM` and `Gemma3ForCausalLM`, one decoder layer for both.

What sets Gemma apart from Llama (models/llama.py), each as transformers' modeling code does it:
- RMSNorm with a unit offset: x * (1 + w), in fp32 (`rms_norm`); the scales start at 0.
- Four norms per layer: input, post-attention (on the attention output, before the residual add),
  pre-feedforward and post-feedforward (likewise).
- GeGLU: gelu_pytorch_tanh(x W_gate) * (x W_up), then W_down.
- The token embedding multiplied by sqrt(d_model), in the compute dtype; the head is tied to it.
- head_dim independent of d_model; the attention logits scaled by query_pre_attn_scalar^-1/2 instead of
  head_dim^-1/2 (q is multiplied by sqrt(head_dim / query_pre_attn_scalar) before `par.attention`).
- Gemma 2: attention logit soft-capping (`attn_softcap`, `par.attention(..., softcap=)`) and final logit
  soft-capping (`final_softcap`: c * tanh(logits / c), per logit, so the chunked and vocabulary-parallel
  losses are unchanged).
- Gemma 3: QK-norm (a unit-offset RMSNorm over head_dim on q and k, before RoPE), no attention soft cap,
  and two RoPEs: base `rope_local_theta` (10k) on the local layers, `rope_theta` (1M) with a linear
  scaling factor `rope_scale` (8 in the 4B and larger) on the global ones.
- Local (sliding-window) and global layers alternate: layer i is global iff (i + 1) % global_every == 0
  (Gemma 2: every other layer; Gemma 3: 5 local, then 1 global).

**Alternation inside one scanned stack.** parallax runs the blocks as one `lax.scan` (and cuts it into
pipeline stages, and decodes it with a KV cache), so every layer runs the same code and the attention
options, static per call, cannot depend on the layer index (which a layer does not know). Each layer
carries its kind instead: `local`, a stacked parameter [L] (1.0: local) set from the config at
initialisation and from config.json's `layer_types` on import (`hf_mapping.Constant`). The layer reads it
through `stop_gradient` (its gradient is exactly 0, and being 1-D it is never weight-decayed, so AdamW never
moves it) and passes it to `par.attention(..., window=W, windowed=flag)`, which runs the windowed or the
full variant under `lax.cond` (each compiled once). The same flag picks the layer's RoPE frequencies. So
the kind travels with the layer's weights wherever they go: scan, any pipeline stage or interleaved
chunk, a checkpoint restored onto another mesh, and the KV-cache decode (`parallax.generate`'s
`par.attention` takes the same `windowed`). A grouped stack (a block of 6 layers) would not do: 26 and 34
layers (Gemma 3 1B, 4B) are no multiple of 6. A second stack per kind would break the layer order.

Shapes: B batch, T length, D d_model, H query heads, K kv heads, Dh head_dim, F d_ff, V vocab, L layers.
Under tensor / sequence parallelism the layer runs per rank as Llama's does (models/llama.py).
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
from flax import nnx

from models import llama
from models.llama import rope
from parallax import hf_mapping as hf
from parallax.errors import ConfigError
from parallax.model import (DENSE, Model, Parallelism, attention_flops_per_token, check_attention_split, constrain,
                            param_flops_per_token)


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    dtype: str = "float32"
    norm_eps: float = 1e-6
    init_std: float = 0.02
    query_pre_attn_scalar: int = 0
    sliding_window: int = 0
    global_every: int = 2
    rope_theta: float = 10000.0
    rope_local_theta: float = 0.0
    rope_scale: float = 1.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    qk_norm: bool = False

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @classmethod
    def from_config(cls, model_config, **fixed) -> "GemmaConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in dict(model_config).items() if k in fields}, **fixed})


def local_layers(m) -> list[bool]:
    """Which layers attend through the sliding window: layer i unless (i + 1) % global_every == 0; none
    without a window."""
    return [bool(m.sliding_window) and (i + 1) % m.global_every != 0 for i in range(m.num_layers)]


def rms_norm(x, w, eps):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, returned in x's dtype. x [..., N], w [N]."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def inv_freq(theta: float, dh: int, scale: float = 1.0):
    """RoPE inverse frequencies [Dh/2] as transformers computes them, divided by a linear scaling factor."""
    return 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)) / scale




def _param(rngs, shape, logical, std):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), logical=logical)


def _zeros(shape, logical):
    return nnx.Param(jnp.zeros(shape, jnp.float32), logical=logical)


class Blocks(nnx.Module):
    """The stacked parameters of all decoder layers and their kinds; `layer` runs one layer on one slice."""

    def __init__(self, cfg: GemmaConfig, rngs: nnx.Rngs):
        L, D, H, K, Dh, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff
        std = cfg.init_std
        self.cfg = cfg
        self.kinds = tuple(local_layers(cfg))
        self.attn_norm = _zeros((L, D), ("layers", "norm"))
        self.wq = _param(rngs, (L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), std)
        self.wk = _param(rngs, (L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), std)
        self.wv = _param(rngs, (L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), std)
        self.wo = _param(rngs, (L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), std)
        if cfg.qk_norm:
            self.q_norm = _zeros((L, Dh), ("layers", "head_dim"))
            self.k_norm = _zeros((L, Dh), ("layers", "head_dim"))
        self.post_attn_norm = _zeros((L, D), ("layers", "norm"))
        self.mlp_norm = _zeros((L, D), ("layers", "norm"))
        self.w_gate = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_up = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_down = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), std)
        self.post_mlp_norm = _zeros((L, D), ("layers", "norm"))
        # 1.0 where the layer is local; never trained (read through stop_gradient; see the module docstring)
        self.local = nnx.Param(jnp.asarray(self.kinds, jnp.float32), logical=("layers",))

    def layer(self, x, batch, par: Parallelism = DENSE):
        """One decoder layer on a one-layer slice. x [B, T, D] (this rank's [B, T/(s*t), D] under par)."""
        cfg, dt, w = self.cfg, self.cfg.compute_dtype, par.weight
        segment_ids, positions = batch["segment_ids"], batch["positions"]
        mixed = len(set(self.kinds)) > 1
        is_local = jax.lax.stop_gradient(w(self.local)) > 0.5 if mixed else None  # () bool
        h = par.gather_seq(rms_norm(x, w(self.attn_norm), cfg.norm_eps))  # (B, T, D)
        q = par.dot("btd,dhk->bthk", h, self.wq, dt)  # (B, T, H, Dh)
        k = par.dot("btd,dhk->bthk", h, self.wk, dt)  # (B, T, K, Dh)
        v = par.dot("btd,dhk->bthk", h, self.wv, dt)  # (B, T, K, Dh)
        if cfg.qk_norm:  # per head, over head_dim, before RoPE
            q, k = rms_norm(q, w(self.q_norm), cfg.norm_eps), rms_norm(k, w(self.k_norm), cfg.norm_eps)
        freqs = self.freqs(is_local)  # (Dh/2,)
        q = rope(q, positions, freqs)
        if cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar != cfg.head_dim:
            q = q * jnp.asarray(math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar), q.dtype)  # logits / sqrt(qpas)
        q = constrain(q, ("batch", "length", "act_heads", None))
        k = constrain(rope(k, positions, freqs), ("batch", "length", "act_kv_heads", None))
        window = cfg.sliding_window if any(self.kinds) else None
        a = par.attention(q, k, v, segment_ids, positions, window=window, softcap=cfg.attn_softcap,
                          windowed=is_local)  # (B, T, H, Dh)
        out = par.scatter_seq(par.dot("bthk,hkd->btd", a, self.wo, dt))  # (B, T, D) row-parallel partial sums
        x = constrain(x + rms_norm(out, w(self.post_attn_norm), cfg.norm_eps), ("batch", "length", "act_embed"))
        h = par.gather_seq(rms_norm(x, w(self.mlp_norm), cfg.norm_eps))  # (B, T, D)
        gate = par.dot("btd,df->btf", h, self.w_gate, dt)  # (B, T, F)
        up = par.dot("btd,df->btf", h, self.w_up, dt)  # (B, T, F)
        act = constrain(jax.nn.gelu(gate, approximate=True) * up, ("batch", "length", "act_mlp"))
        out = par.scatter_seq(par.dot("btf,fd->btd", act, self.w_down, dt))  # (B, T, D)
        return constrain(x + rms_norm(out, w(self.post_mlp_norm), cfg.norm_eps), ("batch", "length", "act_embed"))

    def freqs(self, is_local):
        """This layer's RoPE frequencies [Dh/2]: the local base on local layers, the global base (and its linear
        scaling) on global ones; `is_local` None: every layer is of one kind."""
        cfg = self.cfg
        local = inv_freq(cfg.rope_local_theta or cfg.rope_theta, cfg.head_dim)
        glob = inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scale)
        if is_local is None:
            return local if self.kinds[0] else glob
        return jnp.where(is_local, local, glob)


class Gemma(Model):
    """The Gemma decoder: scaled, tied token embedding, `blocks`, final unit-offset RMSNorm, soft-capped logits.
    `Gemma2` and `Gemma3` (below) are its Hugging Face architectures."""

    parallel_axes = ("tensor", "seq")
    fixed: dict = {}  # GemmaConfig fields an architecture fixes (no config key)

    @classmethod
    def settings(cls, m) -> GemmaConfig:
        cfg = GemmaConfig.from_config(m, **cls.fixed)
        return dataclasses.replace(cfg, head_dim=cfg.head_dim or cfg.d_model // cfg.num_heads)

    @classmethod
    def attention_features(cls, m) -> frozenset:
        cfg = cls.settings(m)
        features = {"window"} if any(local_layers(cfg)) else set()
        return frozenset(features | ({"softcap"} if cfg.attn_softcap else set()))

    @classmethod
    def check_config(cls, m, sizes, config) -> None:
        for key in ("d_model", "num_heads", "num_kv_heads", "d_ff", "global_every"):
            if int(m[key]) <= 0:
                raise ConfigError(f"config.model.{key}={m[key]}: must be positive")
        if m.head_dim < 0 or (not m.head_dim and m.d_model % m.num_heads):
            raise ConfigError(f"config.model.head_dim={m.head_dim}: must be positive, or 0 with d_model={m.d_model} "
                              f"divisible by num_heads={m.num_heads}")
        cfg = cls.settings(m)
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"config.model.num_heads={cfg.num_heads}: not divisible by num_kv_heads="
                              f"{cfg.num_kv_heads}; make num_heads a multiple of num_kv_heads")
        if cfg.head_dim % 2:
            raise ConfigError(f"config.model.head_dim={cfg.head_dim}: RoPE needs an even head_dim")
        for key in ("sliding_window", "query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_local_theta"):
            if key in m and m[key] < 0:
                zero = "head_dim" if key == "query_pre_attn_scalar" else "none"
                raise ConfigError(f"config.model.{key}={m[key]}: must be >= 0 (0: {zero})")
        for key in ("rope_theta", "rope_scale"):
            if key in m and m[key] <= 0:
                raise ConfigError(f"config.model.{key}={m[key]}: must be positive")
        check_attention_split(m, sizes, config.train.seq_len, cfg.num_heads, cfg.num_kv_heads,
                              ("num_heads", "num_kv_heads", "vocab_size", "d_ff"))

    @classmethod
    def flops_per_token(cls, m, seq_len, params, logical) -> float:
        """6 per parameter (the tied table counted once, as the head's matmul; the layer kinds are no
        parameters a token multiplies), plus attention over each layer's causal window."""
        cfg = cls.settings(m)
        attention = sum(attention_flops_per_token(1, cfg.num_heads, cfg.head_dim,
                                                  min(seq_len, cfg.sliding_window) if is_local else seq_len)
                        for is_local in local_layers(cfg))
        return param_flops_per_token(params, logical, lookup=()) - 6.0 * cfg.num_layers + attention

    # --- Hugging Face ---------------------------------------------------------------------------------

    @staticmethod
    def _hf_common(c, where, pattern_default: int) -> dict:
        """The keys both architectures share, with their refusals."""
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            hf.unsupported(where, "hidden_activation", act, "Gemma's MLP is GeGLU with gelu_pytorch_tanh")
        for key, ok in (("attention_bias", False), ("use_bidirectional_attention", False),
                        ("tie_word_embeddings", True)):
            if bool(c.get(key, ok)) != ok:
                hf.unsupported(where, key, c[key], f"parallax's Gemma has {key}={ok!r}")
        L, D, H = (hf.required(c, k, where) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
        window = int(c.get("sliding_window") or 0)
        return dict(num_layers=L, vocab_size=hf.required(c, "vocab_size", where), d_model=D, num_heads=H,
                    num_kv_heads=c.get("num_key_value_heads") or H, head_dim=c.get("head_dim") or D // H,
                    d_ff=hf.required(c, "intermediate_size", where), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                    query_pre_attn_scalar=int(c.get("query_pre_attn_scalar") or 0), sliding_window=window,
                    global_every=_global_every(c, L, where, pattern_default),
                    final_softcap=float(c.get("final_logit_softcapping") or 0.0))

    @classmethod
    def _hf_config_common(cls, m) -> dict:
        cfg = cls.settings(m)
        kinds = local_layers(cfg)
        return {"vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
                "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
                "num_key_value_heads": m.num_kv_heads, "head_dim": cfg.head_dim,
                "hidden_activation": "gelu_pytorch_tanh",
                "rms_norm_eps": m.norm_eps, "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
                "sliding_window": int(m.sliding_window) or None,
                "layer_types": ["sliding_attention" if k else "full_attention" for k in kinds],
                "final_logit_softcapping": float(m.final_softcap) or None, "attention_bias": False,
                "tie_word_embeddings": True}

    @classmethod
    def hf_sources(cls, m, tensor_names=None):
        """Where our parameters live in an HF Gemma checkpoint: Llama's projections (Linear [out, in]
        transposed, heads split out; RoPE on the halves, rows as they are), the four norms' offsets w as they
        are (both compute x * (1 + w)), the head tied to `model.embed_tokens.weight` (a checkpoint's
        `lm_head.weight`, if it has one, is that same tensor and is not read), and the layer kinds, which
        config.json sets (`Constant`)."""
        cfg = cls.settings(m)
        D, S, layer = cfg.d_model, hf.Source, "model.layers.{i}."
        shapes = types.SimpleNamespace(d_model=D, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, d_ff=cfg.d_ff,
                                       vocab_size=cfg.vocab_size, head_dim=cfg.head_dim, tie_embeddings=True)
        sources = llama.decoder_sources(shapes, qk_norm=cfg.qk_norm)  # Llama's tensor names, Gemma's norms below
        sources.update({
            "blocks/post_attn_norm": S(layer + "post_attention_layernorm.weight", (D,), (D,)),
            "blocks/mlp_norm": S(layer + "pre_feedforward_layernorm.weight", (D,), (D,)),
            "blocks/post_mlp_norm": S(layer + "post_feedforward_layernorm.weight", (D,), (D,)),
            "blocks/local": hf.Constant(tuple(float(k) for k in local_layers(cfg))),
        })
        return sources

    def __init__(self, config, rngs: nnx.Rngs):
        cfg = self.settings(config)
        self.cfg = cfg
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
        self.blocks = Blocks(cfg, rngs)
        self.final_norm = _zeros((cfg.d_model,), ("norm",))

    def embed(self, batch, par: Parallelism = DENSE):
        """tokens [B, T] -> the embedding times sqrt(D) in the compute dtype [B, T, D] (this rank's
        [B, T/(s*t), D] under par). The scale is rounded to the compute dtype first, as transformers does."""
        dt = self.cfg.compute_dtype
        return par.embed(self.embedding, batch["inputs"], dt) * jnp.asarray(math.sqrt(self.cfg.d_model), dt)

    def logits(self, x, par: Parallelism = DENSE):
        """Final norm, the tied head and the soft cap. x [B, T, D] -> logits [B, T, V] in fp32 (this rank's
        [B, T/s, V/t] under par)."""
        cfg = self.cfg
        h = par.gather_seq(rms_norm(x, par.weight(self.final_norm), cfg.norm_eps))  # (B, T, D)
        table = par.weight(self.embedding)  # (V, D)
        logits = jnp.einsum("btd,vd->btv", h, table.astype(h.dtype), preferred_element_type=jnp.float32)
        if cfg.final_softcap:
            logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
        return constrain(logits, ("batch", "length", "act_vocab"))


def _global_every(c, num_layers: int, where: str, default: int) -> int:
    """config.json's layer kinds as `global_every` N (layer i global iff (i + 1) % N == 0): from `layer_types`,
    else `sliding_window_pattern` (older Gemma 3 configs), else the architecture's default. A pattern that is
    not periodic that way is refused."""
    types = c.get("layer_types")
    if types is None:
        return int(c.get("sliding_window_pattern") or default)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        hf.unsupported(where, "layer_types", unknown[0], "layers are sliding_attention or full_attention")
    local = [t == "sliding_attention" for t in types]
    for n in range(1, num_layers + 2):
        if local == [(i + 1) % n != 0 for i in range(num_layers)]:
            return n
    hf.unsupported(where, "layer_types", types, "parallax's Gemma makes layer i global iff (i + 1) % N == 0 for "
                   "one N (global_every)")


class Gemma2(Gemma):
    """Gemma 2 (`Gemma2ForCausalLM`): attention and final logit soft caps; local / global every other layer."""

    hf_architectures = ("Gemma2ForCausalLM",)
    fixed = {"qk_norm": False}

    @staticmethod
    def config_defaults() -> dict:
        return dict(
            d_model=64,  # width of the residual stream
            num_heads=4,  # query heads
            num_kv_heads=2,  # key / value heads (grouped-query attention; num_heads a multiple of it)
            head_dim=0,  # per-head width (0: d_model / num_heads)
            d_ff=128,  # GeGLU hidden width
            norm_eps=1e-6,  # RMSNorm epsilon
            init_std=0.02,  # std of the normal initialisation
            query_pre_attn_scalar=0,  # the attention logits are scaled by its -1/2 power (0: head_dim)
            sliding_window=4096,  # each query attends its document's latest this many positions (0: every earlier one)
            global_every=2,  # layer i is global (no window) iff (i + 1) % global_every == 0; the others local
            rope_theta=10000.0,  # RoPE base frequency
            attn_softcap=50.0,  # attention logit soft cap c: c * tanh(logits / c) (0: none)
            final_softcap=30.0,  # final logit soft cap c: c * tanh(logits / c) (0: none)
        )

    @staticmethod
    def hf_model_keys(c, where):
        """HF Gemma2 config.json -> our keys; refuses scaled RoPE, biases, an untied head, bidirectional
        attention and activations other than gelu_pytorch_tanh."""
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            hf.unsupported(where, "rope_type", rope_type, "Gemma 2's RoPE is unscaled (rope_type 'default')")
        return {**Gemma._hf_common(c, where, 2),
                "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                "attn_softcap": float(c.get("attn_logit_softcapping") or 0.0)}

    @classmethod
    def hf_config(cls, m):
        return {**cls._hf_config_common(m), "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
                "attn_logit_softcapping": float(m.attn_softcap) or None}


class Gemma3(Gemma):
    """Gemma 3 text (`Gemma3ForCausalLM`): QK-norm, local RoPE base 10k and global 1M (linearly scaled in
    4B+), 5 local layers to 1 global, no attention soft cap."""

    hf_architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    fixed = {"qk_norm": True, "attn_softcap": 0.0}

    @staticmethod
    def config_defaults() -> dict:
        return dict(
            d_model=64,  # width of the residual stream
            num_heads=4,  # query heads
            num_kv_heads=2,  # key / value heads (grouped-query attention; num_heads a multiple of it)
            head_dim=0,  # per-head width (0: d_model / num_heads)
            d_ff=128,  # GeGLU hidden width
            norm_eps=1e-6,  # RMSNorm epsilon
            init_std=0.02,  # std of the normal initialisation
            query_pre_attn_scalar=0,  # the attention logits are scaled by its -1/2 power (0: head_dim)
            sliding_window=1024,  # each query attends its document's latest this many positions (0: every earlier one)
            global_every=6,  # layer i is global (no window) iff (i + 1) % global_every == 0; the others local
            rope_theta=1000000.0,  # RoPE base frequency
            rope_scale=1.0,  # the global layers' linear RoPE scaling factor (positions / factor; 1: none)
            rope_local_theta=10000.0,  # the local layers' RoPE base frequency (0: rope_theta)
            final_softcap=0.0,  # final logit soft cap c: c * tanh(logits / c) (0: none)
        )

    @staticmethod
    def hf_model_keys(c, where):
        """HF Gemma3 text config.json -> our keys. Reads both RoPE layouts: transformers 5's `rope_parameters`
        per layer type, and the older `rope_theta`, `rope_local_base_freq` and `rope_scaling`. Refuses the
        vision model, RoPE other than linear scaling on global layers, and an attention soft cap (which
        transformers' Gemma 3 attention never applies); Gemma 2's refusals besides."""
        arch = (c.get("architectures") or [None])[0]
        if arch != "Gemma3ForCausalLM":
            hf.unsupported(where, "architectures", c.get("architectures"), "parallax's Gemma 3 is the text model "
                           "(Gemma3ForCausalLM, e.g. gemma-3-1b); the vision model is not implemented")
        if c.get("attn_logit_softcapping"):
            hf.unsupported(where, "attn_logit_softcapping", c["attn_logit_softcapping"], "transformers' Gemma 3 "
                           "attention ignores it; set it to null")
        rp = c.get("rope_parameters") or {}
        if "full_attention" in rp or "sliding_attention" in rp:
            glob, loc = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        else:
            glob, loc = dict(c.get("rope_scaling") or {}), {}
        theta = float(glob.get("rope_theta", c.get("rope_theta", 1000000.0)))
        local_theta = float(loc.get("rope_theta", c.get("rope_local_base_freq", 10000.0)))
        for kind, params, ok in (("full_attention", glob, ("default", "linear")),
                                 ("sliding_attention", loc, ("default",))):
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type not in ok:
                hf.unsupported(where, f"rope_parameters.{kind}.rope_type", rope_type,
                               f"parallax's Gemma 3 implements {' and '.join(ok)} RoPE on {kind} layers")
        scale = float(glob.get("factor", 1.0)) if glob.get("rope_type", glob.get("type")) == "linear" else 1.0
        return {**Gemma._hf_common(c, where, 6), "rope_theta": theta, "rope_local_theta": local_theta,
                "rope_scale": scale}

    @classmethod
    def hf_config(cls, m):
        full = ({"rope_type": "linear", "factor": float(m.rope_scale)} if m.rope_scale != 1 else
                {"rope_type": "default"})
        return {**cls._hf_config_common(m), "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "rope_parameters": {"full_attention": {**full, "rope_theta": m.rope_theta},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": m.rope_local_theta or m.rope_theta}},
                "attn_logit_softcapping": None, "use_bidirectional_attention": False}
