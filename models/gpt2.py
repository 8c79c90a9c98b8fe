"""A GPT-2 style decoder in Flax NNX: LayerNorm with bias, learned positions, GELU MLP, multi-head attention,
tied input / output embeddings.

Built on the parallax model contract (`parallax.model`) alone: parallax has no GPT-2 code. Like every
parallax model it stores its blocks stacked (leading `layers` dim) and runs the same code on every mesh;
under tensor / sequence parallelism it runs per rank and `par` adds the collectives (the residual stream
is [B, T/(s*t), D], weights hold H/t heads, F/t hidden units and V/t vocabulary rows).

Positions are per document (`batch['positions']`), so packed documents each start at position 0; they must
lie in [0, max_positions) (`parallax.data` numbers each document's piece of a row from 0, so they stay below
seq_len). An out-of-range position embeds as NaN rather than as a clipped row, so the bug stops training.

There is no key bias: a bias added to every key adds the same q.b to all of a query's scores, which the
softmax cancels, so it never changes the output and its gradient is identically zero. (GPT-2 checkpoints
carry one inside `c_attn`; importing drops it without changing a logit.)

Shapes: B batch, T length, D d_model, H heads, Dh head_dim, F d_ff, V vocab, P max_positions, L layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import hf_mapping as hf
from parallax.errors import ConfigError
from parallax.model import (DENSE, Model, Parallelism, attention_flops_per_token, check_attention_split, constrain,
                            param_flops_per_token)


def layer_norm(x, scale, bias, eps):
    """LayerNorm over the last dim in fp32, returned in x's dtype. x: [..., D]; scale, bias: [D]."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def _normal(rngs, shape, logical, std):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), logical=logical)


def _const(value, shape, logical):
    return nnx.Param(jnp.full(shape, value, jnp.float32), logical=logical)


class Blocks(nnx.Module):
    """The stacked parameters of all transformer blocks; `layer` runs one block on a one-layer slice."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        L, D, H, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.d_ff
        Dh, std = D // H, cfg.init_std
        out_std = std / math.sqrt(2 * L)  # GPT-2's scaled init of the projections into the residual stream
        self.eps, self.dtype = cfg.norm_eps, jnp.dtype(cfg.dtype)
        self.ln1_scale = _const(1.0, (L, D), ("layers", "norm"))
        self.ln1_bias = _const(0.0, (L, D), ("layers", "norm"))
        self.wq = _normal(rngs, (L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), std)
        self.wk = _normal(rngs, (L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), std)
        self.wv = _normal(rngs, (L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), std)
        self.bq = _const(0.0, (L, H, Dh), ("layers", "heads", "head_dim"))
        self.bv = _const(0.0, (L, H, Dh), ("layers", "heads", "head_dim"))
        self.wo = _normal(rngs, (L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), out_std)
        self.bo = _const(0.0, (L, D), ("layers", "bias"))
        self.ln2_scale = _const(1.0, (L, D), ("layers", "norm"))
        self.ln2_bias = _const(0.0, (L, D), ("layers", "norm"))
        self.w_fc = _normal(rngs, (L, D, F), ("layers", "embed", "mlp"), std)
        self.b_fc = _const(0.0, (L, F), ("layers", "mlp"))
        self.w_proj = _normal(rngs, (L, F, D), ("layers", "mlp", "embed"), out_std)
        self.b_proj = _const(0.0, (L, D), ("layers", "bias"))

    def layer(self, x, batch, par: Parallelism = DENSE):
        """One pre-LayerNorm block. x: [B, T, D] (this rank's [B, T/(s*t), D] under par)."""
        w, dt = par.weight, self.dtype

        def project(h, weight, bias=None):  # (B, T, D) x (D, H, Dh) + (H, Dh) -> (B, T, H, Dh)
            y = par.dot("btd,dhk->bthk", h, weight, dt)
            return y if bias is None else y + w(bias, dt)

        h = par.gather_seq(layer_norm(x, w(self.ln1_scale), w(self.ln1_bias), self.eps))  # (B, T, D)
        q = constrain(project(h, self.wq, self.bq), ("batch", "length", "act_heads", None))
        k = constrain(project(h, self.wk), ("batch", "length", "act_heads", None))
        v = project(h, self.wv, self.bv)
        a = par.attention(q, k, v, batch["segment_ids"], batch["positions"])  # (B, T, H, Dh)
        out = par.scatter_seq(par.dot("bthk,hkd->btd", a, self.wo, dt))  # row-parallel partial sums
        x = constrain(x + out + w(self.bo, dt), ("batch", "length", "act_embed"))
        h = par.gather_seq(layer_norm(x, w(self.ln2_scale), w(self.ln2_bias), self.eps))  # (B, T, D)
        f = par.dot("btd,df->btf", h, self.w_fc, dt) + w(self.b_fc, dt)  # (B, T, F)
        f = constrain(jax.nn.gelu(f, approximate=True), ("batch", "length", "act_mlp"))
        out = par.scatter_seq(par.dot("btf,fd->btd", f, self.w_proj, dt))
        return constrain(x + out + w(self.b_proj, dt), ("batch", "length", "act_embed"))


class GPT2(Model):
    """Decoder-only LM with learned positions and a head tied to the token embedding."""

    parallel_axes = ("tensor", "seq")
    rules = {"positions": None, "bias": None}  # rows of the position table; [D] biases (replicated)

    @staticmethod
    def config_defaults() -> dict:
        return dict(
            d_model=64,  # width of the residual stream
            num_heads=4,  # attention heads
            d_ff=256,  # GELU MLP hidden width
            max_positions=1024,  # learned position embeddings (train.seq_len at most)
            norm_eps=1e-5,  # LayerNorm epsilon
            init_std=0.02,  # std of the normal initialisation
        )

    @staticmethod
    def check_config(m, sizes, config) -> None:
        for key in ("d_model", "num_heads", "d_ff", "max_positions"):
            if int(m[key]) <= 0:
                raise ConfigError(f"config.model.{key}={m[key]}: must be positive")
        if m.d_model % m.num_heads:
            raise ConfigError(f"config.model.d_model={m.d_model}: not divisible by num_heads={m.num_heads}; "
                              f"make d_model a multiple of num_heads")
        if config.train.seq_len > m.max_positions:
            raise ConfigError(f"config.train.seq_len={config.train.seq_len}: longer than the learned positions "
                              f"(model.max_positions={m.max_positions}); raise max_positions or shorten seq_len")
        check_attention_split(m, sizes, config.train.seq_len, m.num_heads, m.num_heads)

    hf_architectures = ("GPT2LMHeadModel",)
    hf_in_axis = 0  # HF Conv1D weights are [in, out] (LoRA reads which dims are inputs from it)

    @staticmethod
    def hf_model_keys(c, where):
        """HF GPT-2 config.json -> our keys (tanh GELU, scaled attention, tied head only)."""
        for key, ok in (("activation_function", "gelu_new"), ("scale_attn_weights", True),
                        ("scale_attn_by_inverse_layer_idx", False), ("tie_word_embeddings", True)):
            if c.get(key, ok) != ok and not (key == "activation_function" and c[key] == "gelu_pytorch_tanh"):
                hf.unsupported(where, key, c[key], f"parallax's GPT-2 has {key}={ok!r}")
        D = hf.required(c, "n_embd", where)
        return dict(num_layers=hf.required(c, "n_layer", where), vocab_size=hf.required(c, "vocab_size", where),
                    d_model=D, num_heads=hf.required(c, "n_head", where), d_ff=c.get("n_inner") or 4 * D,
                    max_positions=hf.required(c, "n_positions", where),
                    norm_eps=float(c.get("layer_norm_epsilon", 1e-5)))

    @staticmethod
    def hf_config(m):
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
                "n_embd": m.d_model, "n_head": m.num_heads, "n_layer": m.num_layers, "n_inner": m.d_ff,
                "n_positions": m.max_positions, "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new",
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "tie_word_embeddings": True}

    @staticmethod
    def hf_sources(m, tensor_names=None):
        """Where our parameters live in an HF `GPT2LMHeadModel` checkpoint (tensor names with or without the
        `transformer.` prefix). `Conv1D` weights are already [in, out]; the fused `c_attn` [D, 3D] splits
        into q | k | v column blocks. Its key-bias block is not read (the softmax cancels it, see the module
        docstring) and is written as zeros."""
        D, H, F, V, P = m.d_model, m.num_heads, m.d_ff, m.vocab_size, m.max_positions
        Dh, S = D // H, hf.Source
        prefix = "" if tensor_names is not None and "wte.weight" in tensor_names else "transformer."
        layer = prefix + "h.{i}."
        c_attn, c_attn_b = layer + "attn.c_attn.weight", layer + "attn.c_attn.bias"
        return {
            "wte": S(prefix + "wte.weight", (V, D), (V, D)),
            "wpe": S(prefix + "wpe.weight", (P, D), (P, D)),
            "blocks/ln1_scale": S(layer + "ln_1.weight", (D,), (D,)),
            "blocks/ln1_bias": S(layer + "ln_1.bias", (D,), (D,)),
            "blocks/wq": S(c_attn, (D, 3 * D), (D, H, Dh), block=(1, 0, D)),
            "blocks/wk": S(c_attn, (D, 3 * D), (D, H, Dh), block=(1, D, 2 * D)),
            "blocks/wv": S(c_attn, (D, 3 * D), (D, H, Dh), block=(1, 2 * D, 3 * D)),
            "blocks/bq": S(c_attn_b, (3 * D,), (H, Dh), block=(0, 0, D)),
            "blocks/bv": S(c_attn_b, (3 * D,), (H, Dh), block=(0, 2 * D, 3 * D)),
            "blocks/wo": S(layer + "attn.c_proj.weight", (D, D), (H, Dh, D)),
            "blocks/bo": S(layer + "attn.c_proj.bias", (D,), (D,)),
            "blocks/ln2_scale": S(layer + "ln_2.weight", (D,), (D,)),
            "blocks/ln2_bias": S(layer + "ln_2.bias", (D,), (D,)),
            "blocks/w_fc": S(layer + "mlp.c_fc.weight", (D, F), (D, F)),
            "blocks/b_fc": S(layer + "mlp.c_fc.bias", (F,), (F,)),
            "blocks/w_proj": S(layer + "mlp.c_proj.weight", (F, D), (F, D)),
            "blocks/b_proj": S(layer + "mlp.c_proj.bias", (D,), (D,)),
            "lnf_scale": S(prefix + "ln_f.weight", (D,), (D,)),
            "lnf_bias": S(prefix + "ln_f.bias", (D,), (D,)),
        }

    @staticmethod
    def flops_per_token(m, seq_len, params, logical) -> float:
        """6 per parameter but the position table (a lookup; the token table is also the head, a matmul),
        plus attention over the causal window."""
        return param_flops_per_token(params, logical, lookup=("positions",)) + attention_flops_per_token(
            m.num_layers, m.num_heads, m.d_model // m.num_heads, seq_len)

    def __init__(self, config, rngs: nnx.Rngs):
        D, std = config.d_model, config.init_std
        self.dtype, self.eps = jnp.dtype(config.dtype), config.norm_eps
        self.wte = _normal(rngs, (config.vocab_size, D), ("vocab", "embed"), std)
        self.wpe = _normal(rngs, (config.max_positions, D), ("positions", "embed"), 0.01)
        self.blocks = Blocks(config, rngs)
        self.lnf_scale = _const(1.0, (D,), ("norm",))
        self.lnf_bias = _const(0.0, (D,), ("norm",))

    def embed(self, batch, par: Parallelism = DENSE):
        """Token + position embeddings: [B, T] -> [B, T, D] (this rank's [B, T/(s*t), D] under par)."""
        x = par.embed(self.wte, batch["inputs"], self.dtype)
        positions, table = batch["positions"], par.weight(self.wpe)  # (B, T/s), (P, D)
        # A position outside [0, P) has no row, and embeds as NaN on purpose: the step's loss is non-finite
        # and training stops there. Clipping would silently train the last row on every late token, and
        # jnp.take alone would wrap a negative position. parallax.data never produces one (see its doc).
        in_table = (positions >= 0) & (positions < table.shape[0])  # (B, T/s)
        pos = jnp.where(in_table[..., None], jnp.take(table, positions, axis=0, mode="clip"), jnp.nan)
        pos = pos.astype(self.dtype)  # (B, T/s, D)
        return constrain(x + par.split_seq(pos), ("batch", "length", "act_embed"))

    def logits(self, x, par: Parallelism = DENSE):
        """Final LayerNorm and the tied head: x [B, T, D] -> logits [B, T, V] fp32 ([B, T/s, V/t] under par)."""
        h = par.gather_seq(layer_norm(x, par.weight(self.lnf_scale), par.weight(self.lnf_bias), self.eps))
        table = par.weight(self.wte)  # (V, D)
        logits = jnp.einsum("btd,vd->btv", h, table.astype(h.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "act_vocab"))
