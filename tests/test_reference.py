"""Independent references: each model family (Llama, GPT-2, MoE) written out in plain `jnp` here, sharing no code with
`models/` or `parallax/`, compared with the model's loss and gradients at fp32.

The parity tests compare every layout with the one-device run of the *same* code, which proves the
parallelism but not the model: a bug in shared code cancels out. These references catch that kind of bug.
Norm scales and biases are randomised (at initialisation they are 1 and 0, where a wrong use of them can
have no effect), and every parameter must get a non-zero gradient.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import max_leaf_rel_err, rel_err, tiny_config
from parallax.train import make_dataset
from parallax.trainer import Trainer


def _randomise(params, seed=0):
    """Norm scales (all ones at init) -> 1 + 0.3 N(0, 1); biases (all zeros) -> 0.2 N(0, 1); matrices as
    initialised, times 3 so the activations are not all near zero."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for key, leaf in zip(keys, leaves):
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        if bool(jnp.all(leaf == 1)):
            out.append(1 + 0.3 * noise)
        elif bool(jnp.all(leaf == 0)):
            out.append(0.2 * noise)
        else:
            out.append(3 * leaf)
    return jax.tree.unflatten(treedef, out)


def _mask(segment_ids):
    """[B, T, T]: key j visible to query i iff same document and j <= i (by index)."""
    t = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same & np.tril(np.ones((t, t), bool))[None]


def _attend(q, k, v, segment_ids):
    """Multi-head attention with heads already matched: q, k, v [B, T, H, Dh] -> [B, T, H*Dh]."""
    scores = jnp.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(_mask(segment_ids)[:, None], scores, -jnp.inf)
    probs = jnp.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    out = jnp.einsum("bhij,bjhd->bihd", probs, v)
    return out.reshape(*out.shape[:2], -1)


def _mean_cross_entropy(logits, batch):
    m = logits.max(-1, keepdims=True)
    lse = (m + jnp.log(jnp.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    picked = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    w = batch["weights"]
    return jnp.sum(w * (lse - picked)) / jnp.sum(w)


def llama_reference(p, batch, m):
    """Llama: RMSNorm, RoPE (rotating the pairs (i, i + Dh/2) as complex numbers), GQA with each kv head
    serving H/K consecutive query heads, SwiGLU, untied head."""
    H, K = m.num_heads, m.num_kv_heads
    Dh = m.head_dim or m.d_model // H

    def rms(x, g):
        return x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + m.norm_eps) * g

    def rotate(x):  # [B, T, N, Dh]
        half = Dh // 2
        angle = batch["positions"][..., None, None] * (m.rope_theta ** (-np.arange(half) / half))
        z = (x[..., :half] + 1j * x[..., half:]) * jnp.exp(1j * angle)
        return jnp.concatenate([z.real, z.imag], -1).astype(jnp.float32)

    x = p["embedding"][batch["inputs"]]
    blocks = p["blocks"]
    for l in range(m.num_layers):
        w = {name: value[l] for name, value in blocks.items()}
        h = rms(x, w["attn_norm"])
        q = rotate(jnp.einsum("btd,dnk->btnk", h, w["wq"]))
        k = jnp.repeat(rotate(jnp.einsum("btd,dnk->btnk", h, w["wk"])), H // K, axis=2)
        v = jnp.repeat(jnp.einsum("btd,dnk->btnk", h, w["wv"]), H // K, axis=2)
        x = x + _attend(q, k, v, batch["segment_ids"]) @ w["wo"].reshape(H * Dh, -1)
        h = rms(x, w["mlp_norm"])
        gate = h @ w["w_gate"]
        x = x + (gate / (1 + jnp.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
    return _mean_cross_entropy(rms(x, p["final_norm"]) @ p["head"], batch)


def gpt2_reference(p, batch, m):
    """GPT-2: learned positions, pre-LayerNorm blocks with biases (no key bias: it cannot change the
    softmax), tanh-GELU MLP, head tied to the token embedding."""
    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + m.norm_eps) * g + b

    def gelu(x):
        return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    x = p["wte"][batch["inputs"]] + p["wpe"][batch["positions"]]
    for l in range(m.num_layers):
        w = {name: value[l] for name, value in p["blocks"].items()}
        h = ln(x, w["ln1_scale"], w["ln1_bias"])
        q = jnp.einsum("btd,dnk->btnk", h, w["wq"]) + w["bq"]
        k = jnp.einsum("btd,dnk->btnk", h, w["wk"])
        v = jnp.einsum("btd,dnk->btnk", h, w["wv"]) + w["bv"]
        x = x + _attend(q, k, v, batch["segment_ids"]) @ w["wo"].reshape(m.d_model, -1) + w["bo"]
        h = ln(x, w["ln2_scale"], w["ln2_bias"])
        x = x + gelu(h @ w["w_fc"] + w["b_fc"]) @ w["w_proj"] + w["b_proj"]
    return _mean_cross_entropy(ln(x, p["lnf_scale"], p["lnf_bias"]) @ p["wte"].T, batch)


def _llama_attention_half(x, w, batch, m):
    """The attention half of a Llama layer (RMSNorm, RoPE, GQA), as in `llama_reference`."""
    H, K = m.num_heads, m.num_kv_heads
    Dh = m.head_dim or m.d_model // H

    def rotate(v):
        half = Dh // 2
        angle = batch["positions"][..., None, None] * (m.rope_theta ** (-np.arange(half) / half))
        z = (v[..., :half] + 1j * v[..., half:]) * jnp.exp(1j * angle)
        return jnp.concatenate([z.real, z.imag], -1).astype(jnp.float32)

    h = x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + m.norm_eps) * w["attn_norm"]
    q = rotate(jnp.einsum("btd,dnk->btnk", h, w["wq"]))
    k = jnp.repeat(rotate(jnp.einsum("btd,dnk->btnk", h, w["wk"])), H // K, axis=2)
    v = jnp.repeat(jnp.einsum("btd,dnk->btnk", h, w["wv"]), H // K, axis=2)
    return x + _attend(q, k, v, batch["segment_ids"]) @ w["wo"].reshape(H * Dh, -1)


def moe_reference(p, batch, m):
    """MoE (softmax router, dropless): each token's top-k experts by score + selection bias, gates the
    chosen softmax scores renormalised, the output the gate-weighted sum of those experts' SwiGLUs, looped
    token by token over its choices; plus the Switch balance loss per row and the router z-loss, both
    weighted by the tokens' weights, added to the cross-entropy sum before the mean."""
    moe = m.moe
    E, k = moe.num_experts, moe.top_k
    w_tok = batch["weights"]
    aux = 0.0
    x = p["embedding"][batch["inputs"]]
    for l in range(m.num_layers):
        w = {name: value[l] for name, value in p["blocks"].items()}
        x = _llama_attention_half(x, w, batch, m)
        h = x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + m.norm_eps) * w["mlp_norm"]
        logits = h @ w["w_router"]  # (B, T, E)
        scores = jnp.exp(logits - logits.max(-1, keepdims=True))
        scores = scores / scores.sum(-1, keepdims=True)
        chosen = jnp.argsort(-jax.lax.stop_gradient(scores + w["router_bias"]), axis=-1)[..., :k]  # (B, T, k)
        gates = jnp.take_along_axis(scores, chosen, -1)
        gates = gates / gates.sum(-1, keepdims=True) * moe.router_scale
        y = jnp.zeros_like(x)
        for choice in range(k):
            e = chosen[..., choice]  # (B, T)
            gate_w, up_w, down_w = w["we_gate"][e], w["we_up"][e], w["we_down"][e]  # per token
            g = jnp.einsum("btd,btdf->btf", h, gate_w)
            out = jnp.einsum("btf,btfd->btd", g / (1 + jnp.exp(-g)) * jnp.einsum("btd,btdf->btf", h, up_w), down_w)
            y = y + gates[..., choice, None] * out
        x = x + y
        t = x.shape[1]
        f = jnp.stack([(chosen == e).sum((1, 2)) for e in range(E)], -1) / (t * k)  # (B, E)
        balance = (E * (f * scores.mean(1)).sum(-1) * w_tok.sum(1)).sum()
        lse = logits.max(-1) + jnp.log(jnp.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
        aux = aux + moe.balance_weight * balance + moe.z_weight * (w_tok * lse ** 2).sum()
    h = x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + m.norm_eps) * p["final_norm"]
    return _mean_cross_entropy(h @ p["head"], batch) + aux / w_tok.sum()


REFERENCES = {"llama": llama_reference, "gpt2": gpt2_reference, "moe": moe_reference}


@pytest.mark.parametrize("model", ["llama", "gpt2", "moe"])
def test_model_matches_an_independent_reference(model):
    config = tiny_config(model, data=1)
    if model == "moe":  # dropless (capacity: every token of a row), with both aux losses on
        config.model.moe.update(capacity_factor=0.0, balance_weight=0.1, z_weight=0.01)
    trainer = Trainer(config, devices=jax.devices()[:1])
    params = _randomise(jax.device_get(trainer.init_state()["params"]))
    batch = make_dataset(config).batch(0)
    assert 0 < batch["weights"].sum() < batch["weights"].size, "want real and padding tokens"
    loss, grads = jax.device_get(trainer.loss_and_grads(params, trainer.device_batch(batch)))
    host = {k: jnp.asarray(v) for k, v in batch.items()}
    ref_loss, ref_grads = jax.value_and_grad(REFERENCES[model])(params, host, config.model)
    err, where = max_leaf_rel_err(grads, ref_grads)
    print(f"{model}: loss {float(loss):.6f} vs {float(ref_loss):.6f}; worst gradient {where} {err:.2e}")
    assert rel_err(loss, ref_loss) <= 1e-5
    assert err <= 1e-5, f"gradient {where} differs by {err:.2e}"
    for path, g in jax.tree_util.tree_flatten_with_path(ref_grads)[0]:
        if "router_bias" in jax.tree_util.keystr(path):  # chooses experts only: never trained by gradient
            assert float(jnp.abs(g).max()) == 0
            continue
        assert float(jnp.abs(g).max()) > 0, f"{jax.tree_util.keystr(path)} gets no gradient"
