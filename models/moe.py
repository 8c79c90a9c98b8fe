"""A Llama-style decoder whose MLP is a mixture of experts (Mixtral, DeepSeek-V3 style routing).

Attention, norms and RoPE are Llama's (`models.llama`); each layer's MLP is E routed SwiGLU experts, of
which every token uses k, plus optional always-on shared experts (one SwiGLU of width
shared_experts * d_ff_expert, Llama's MLP). Settings live in `config.model.moe` (see `MOE_DEFAULTS`).

Routing (router logits in fp32, [B, T, E]):
- `router=softmax` (Mixtral): scores = softmax(logits); the top-k scores are the gates, renormalised to
  sum to 1 when `norm_topk`.
- `router=sigmoid` (DeepSeek-V3): scores = sigmoid(logits), top-k, gates renormalised over the chosen
  (`norm_topk`) and scaled by `router_scale`.
- Aux-loss-free balancing (`bias_rate` > 0, DeepSeek-V3): a per-expert bias is added to the scores for
  *choosing* experts only; the gates come from the unbiased scores. After each optimizer step the bias
  moves by `bias_rate * sign(mean load - load)` (`after_step`), from the step's global per-expert load.
  Why a parameter: the trainer keeps a model's whole state in `params` (checkpointed, sharded, restored
  with it), so the bias is saved with the weights for free. It is read through `stop_gradient`, so its
  gradient is exactly 0 and AdamW leaves it exactly as it is (no decay: it is not a matrix); only the
  model's own `after_step` hook changes it.

Aux losses, added to the loss sum and so averaged over tokens like the cross-entropy:
- load balance (Switch): `balance_weight * E * sum_e f_e * P_e` per sequence row (f_e the fraction of the
  row's k*T assignments choosing e, P_e the mean router probability of e: softmax scores, or sigmoid scores
  normalised per token), weighted by the row's weight total;
- router z-loss (ST-MoE): `z_weight * logsumexp(logits)^2` per token.

Per layer the layer returns (x, aux) with this rank's sums (`parallax.model`): `loss`, `balance`, `z`,
`load` [E] (assignments per expert, before dropping), `dropped` and `assignments`; `aux_metrics` turns
them into the train metrics aux_loss, balance_loss, z_loss, load_min / load_max (relative to a uniform
load), load_cv (coefficient of variation over experts, mean over layers) and dropped (the fraction of
assignments over capacity).

Dense first layers (`moe.first_dense` > 0, DeepSeek-V3: 3): the blocks are one homogeneous scanned
stack, and a per-layer dense/MoE flag would make every layer carry both MLPs' weights. So the dense layers
are a second, small stack of Llama blocks (`dense_blocks`, MLP width `moe.dense_d_ff`) that `embed` runs
after the token embedding: they are part of the embedding in the contract's terms, so on a pipeline they
run on the first stage (their `layers` dim is split over `pipe` when stored: `first_dense` must divide by
mesh.pipe). `config.model.num_layers` counts the MoE layers only.

Expert parallelism, capacity and dropless dispatch are the library's (`par.experts`:
`parallax.parallel.moe`, the token movement `parallax.parallel.expert`); this model owns the routing. Sequence parallelism
(`mesh.seq`, any `model.attention` that runs there): each rank routes its own tokens; a routing group is
still the whole row, so capacity drops (`parallax.parallel.expert.seq_offsets`) and the balance loss (`aux`) see the row
through small [B, E] collectives over `seq`, and every mesh drops and balances as one device does.

Generating (`par.decoding`), every token is routed, dropless, whatever `moe.dispatch`: with capacity, a
row's drops depend on the tokens sharing its group (a prompt's padding, the window a sampler recomputes),
so a prompt's continuation would depend on the batch and the decoding algorithm. Capacity is a training
device; an inference without drops is the limit it approximates (MaxText also decodes dropless).

HF architectures (`HFMoE`, below; `models/mixtral.py`, `models/qwen3_moe.py`): this model with the routing
keys an architecture fixes, without the router bias, dropless by default, and the architecture's mapping
(docs/moe.md, "Importing Mixtral and Qwen3-MoE").
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models import llama
from parallax.errors import ConfigError
from parallax import hf_mapping as hf
from parallax import model as model_lib
from parallax.model import DENSE, Model, Parallelism, apply_blocks, attention_flops_per_token, param_flops_per_token
from parallax.parallel import moe as moe_lib

MOE_DEFAULTS = dict(
    num_experts=8,  # routed experts per layer
    top_k=2,  # experts each token is routed to
    d_ff_expert=64,  # hidden width of one expert
    shared_experts=0,  # always-on experts: one SwiGLU of width shared_experts * d_ff_expert
    router="softmax",  # softmax (Mixtral) | sigmoid (DeepSeek-V3)
    router_scale=1.0,  # gates are multiplied by this (DeepSeek-V3: 2.5)
    norm_topk=True,  # renormalise the k gates to sum to 1
    dispatch="capacity",  # capacity (drops past C slots; all-to-all over expert) | ragged (dropless; ragged_all_to_all)
    capacity_factor=2.0,  # slots per expert and row = ceil(factor * T * k / E); 0: T slots (drops nothing)
    grouped_impl="auto",  # grouped matmuls (ragged, or expert=1): auto (megablox on TPU) | ragged_dot | megablox
    ff_chunks=1,  # grouped matmuls: the expert width in this many slices, one live at a time (memory)
    ep_buffer=0.0,  # ragged over mesh.expert: receive buffer in balanced shares (0: worst case, dropless)
    dispatch_chunks=1,  # over expert > 1: this many row groups (capacity: all-to-alls overlap matmuls; ragged: memory)
    balance_weight=0.01,  # Switch load-balancing loss weight
    z_weight=0.001,  # router z-loss weight
    bias_rate=0.0,  # aux-loss-free balancing: bias step per optimizer step (0: off)
    first_dense=0,  # dense Llama layers before the num_layers MoE layers (see the module docstring)
    dense_d_ff=0,  # their MLP width (needed when first_dense > 0)
)
ROUTERS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoESettings:
    num_experts: int
    top_k: int
    d_ff_expert: int
    shared_experts: int
    router: str
    router_scale: float
    norm_topk: bool
    dispatch: str
    grouped_impl: str
    ff_chunks: int
    ep_buffer: float
    capacity_factor: float
    dispatch_chunks: int
    balance_weight: float
    z_weight: float
    bias_rate: float
    first_dense: int
    dense_d_ff: int


def _settings(model_config) -> MoESettings:
    return MoESettings(**{f.name: model_config.moe[f.name] for f in dataclasses.fields(MoESettings)})


def _llama_config(model_config) -> llama.LlamaConfig:
    moe = model_config.moe
    return llama.LlamaConfig.from_config({**dict(model_config), "d_ff": max(1, moe.shared_experts * moe.d_ff_expert)})


class MoEBlocks(llama.Blocks):
    """Llama's stacked attention (and, with shared experts, its MLP as the shared experts) plus the router
    and the stacked routed experts [layers, experts, ...]."""

    def __init__(self, cfg: llama.LlamaConfig, moe: MoESettings, rngs: nnx.Rngs, router_bias: bool = True):
        super().__init__(cfg, rngs)
        L, D, E, F = cfg.num_layers, cfg.d_model, moe.num_experts, moe.d_ff_expert
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * L)
        self.moe = moe
        self.dispatch = moe_lib.Dispatch.of(dataclasses.asdict(moe))
        if not moe.shared_experts:  # Llama's dense MLP is the shared experts; none here
            del self.w_gate, self.w_up, self.w_down
        self.w_router = llama._param(rngs, (L, D, E), ("layers", "embed", "router"), std)
        if router_bias:
            self.router_bias = nnx.Param(jnp.zeros((L, E)), logical=("layers", "router"))  # only after_step moves it
        self.we_gate = llama._param(rngs, (L, E, D, F), ("layers", "experts", "embed", "mlp"), std)
        self.we_up = llama._param(rngs, (L, E, D, F), ("layers", "experts", "embed", "mlp"), std)
        self.we_down = llama._param(rngs, (L, E, F, D), ("layers", "experts", "mlp", "embed"), out_std)

    def layer(self, x, batch, par: Parallelism = DENSE):
        """One decoder layer: Llama attention, then the MoE MLP. x [B, T, D] (this rank's [B, T/t, D] under
        par) -> (x, aux sums of this rank's tokens)."""
        cfg, moe = self.cfg, self.moe
        x = self.attend(x, batch, par)
        h = par.gather_seq(llama.rms_norm(x, par.weight(self.mlp_norm), cfg.norm_eps))  # (B, T, D)
        idx, gates, probs, logits = self.route(h, par)
        y, keep, load = self.routed(h, idx, gates, par)
        if moe.shared_experts:
            y = y + self.mlp(h, par)
        x = llama.constrain(x + par.scatter_seq(y), ("batch", "length", "act_embed"))
        return x, self.aux(batch, logits, probs, keep, load, par)

    def route(self, h, par):
        """h [B, T, D] -> (expert indices [B, T, k], gates [B, T, k] fp32, probabilities for the balance
        loss [B, T, E], router logits [B, T, E] fp32)."""
        moe = self.moe
        w = par.weight(self.w_router).astype(jnp.float32)
        logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), w)
        if moe.router == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
            probs = scores
        else:
            scores = jax.nn.sigmoid(logits)
            probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        bias = jax.lax.stop_gradient(par.weight(self.router_bias)) if hasattr(self, "router_bias") else 0.0
        _, idx = jax.lax.top_k(scores + bias, moe.top_k)  # (B, T, k)
        gates = jnp.take_along_axis(scores, idx, axis=-1)
        if moe.norm_topk:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        return idx, gates * moe.router_scale, probs, logits

    def routed(self, h, idx, gates, par):
        """The routed experts' output [B, T, D] (partial sums over `tensor`), keep mask, load [B, E]: the
        library's dispatch (`par.experts`), on this layer's expert weights."""
        dt, w = self.cfg.compute_dtype, par.weight
        ws = (w(self.we_gate, dt), w(self.we_up, dt), w(self.we_down, dt))  # (E/ep, D, F/t), (E/ep, F/t, D)
        names = [p.logical[1:] for p in (self.we_gate, self.we_up, self.we_down)]  # one layer's
        return par.experts(h.astype(dt), idx, gates, ws, names, self.dispatch)

    def aux(self, batch, logits, probs, keep, load, par: Parallelism = DENSE):
        """This rank's aux sums (see the module docstring); the loss entries are weighted by token weights.
        A row split over `seq`: its balance term takes the whole row's load and mean probabilities (a psum
        over `seq` of [B, E] sums), weighted by this rank's share of the row's weights, so the sum over the
        seq ranks is the row's term."""
        moe = self.moe
        weights = batch["weights"].astype(jnp.float32)  # (B, T/s)
        t, k = par.row_length(logits.shape[1]), moe.top_k
        row_load, row_probs = par.sum_row((load.astype(jnp.float32), jnp.sum(probs, axis=1)))  # (B, E) each
        f = row_load / (t * k)  # (B, E) fraction of each row's assignments
        balance_row = moe.num_experts * jnp.sum(f * row_probs / t, axis=-1)  # (B,)
        balance = jnp.sum(balance_row * jnp.sum(weights, axis=1))
        z = jnp.sum(weights * jax.nn.logsumexp(logits, axis=-1) ** 2)
        stop = jax.lax.stop_gradient
        return dict(loss=moe.balance_weight * balance + moe.z_weight * z, balance=stop(balance), z=stop(z),
                    load=jnp.sum(load, axis=0).astype(jnp.float32),
                    dropped=jnp.sum(~keep).astype(jnp.float32),
                    assignments=jnp.asarray(keep.size, jnp.float32))


class MoE(Model):
    """Decoder-only MoE LM: Llama's embedding, head and attention; `MoEBlocks` as the stack."""

    parallel_axes = ("tensor", "seq", "expert")
    rules = {"router": None}  # the router's expert dim: every rank scores every expert
    router_bias = True  # the choosing bias of aux-loss-free balancing (a subclass without it: `HFMoE`)
    attention_features = staticmethod(llama.Llama.attention_features)  # Llama's attention, its sliding_window too

    @staticmethod
    def config_defaults() -> dict:
        defaults = llama.Llama.config_defaults()
        del defaults["d_ff"], defaults["mlp_chunks"]  # the experts' width is moe.d_ff_expert; no dense MLP chunks
        del defaults["tie_embeddings"]  # an untied head (`__init__`)
        # RMSNorm over head_dim on q and k before RoPE (Qwen3-MoE's), with scales q_norm / k_norm
        return {**defaults, "qk_norm": False, "moe": dict(MOE_DEFAULTS)}

    @staticmethod
    def check_config(m, sizes, config) -> None:
        moe = m.moe
        missing = set(MOE_DEFAULTS) - set(moe.keys())
        extra = set(moe.keys()) - set(MOE_DEFAULTS)
        if missing or extra:
            key = sorted(missing or extra)[0]
            raise ConfigError(f"config.model.moe.{key}: {'missing' if missing else 'not a key of model.moe'} "
                              f"(its keys: {', '.join(sorted(MOE_DEFAULTS))}); start from default_config(model='moe')")
        for key in ("num_experts", "top_k", "d_ff_expert", "dispatch_chunks", "ff_chunks"):
            if int(moe[key]) <= 0:
                raise ConfigError(f"config.model.moe.{key}={moe[key]}: must be positive")
        if moe.top_k > moe.num_experts:
            raise ConfigError(f"config.model.moe.top_k={moe.top_k}: more than num_experts={moe.num_experts}")
        if moe.router not in ROUTERS:
            raise ConfigError(f"config.model.moe.router={moe.router!r}: expected one of {', '.join(ROUTERS)}")
        for key in ("ep_buffer", "shared_experts", "capacity_factor", "balance_weight", "z_weight", "bias_rate",
                    "first_dense", "dense_d_ff"):
            if moe[key] < 0:
                raise ConfigError(f"config.model.moe.{key}={moe[key]}: must be >= 0")
        moe_lib.check_dispatch(moe, sizes, config, model_lib.target_platform())
        llama.Llama.check_config(ml_collections.ConfigDict({**m.to_dict(), "d_ff": moe.d_ff_expert, "mlp_chunks": 1}),
                                 sizes,
                                 config)  # heads, dims

    def __init__(self, config, rngs: nnx.Rngs):
        cfg = _llama_config(config)
        self.cfg = cfg
        self.embedding = llama._param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)
        moe = _settings(config)
        self.remat = config.remat
        if moe.first_dense:
            dense = dataclasses.replace(cfg, num_layers=moe.first_dense, d_ff=moe.dense_d_ff)
            self.dense_blocks = llama.Blocks(dense, rngs)
        self.blocks = MoEBlocks(cfg, moe, rngs, router_bias=self.router_bias)
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,)), logical=("norm",))
        self.head = llama._param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    logits = llama.Llama.logits

    def embed(self, batch, par: Parallelism = DENSE):
        """Token embedding, then the dense first layers if any: tokens [B, T] -> [B, T, D] (split as Llama)."""
        x = llama.Llama.embed(self, batch, par)
        if hasattr(self, "dense_blocks"):
            graphdef, stacked = nnx.split(self.dense_blocks)
            x = apply_blocks(graphdef, nnx.to_pure_dict(stacked), x, batch, self.remat, par)
        return x

    @staticmethod
    def flops_per_token(m, seq_len, params, logical) -> float:
        """The active parameters: 6 per parameter but the embedding table, routed experts counted top_k /
        num_experts; plus attention in every layer (the dense first ones too)."""
        moe = m.moe
        layers = m.num_layers + moe.first_dense
        return (param_flops_per_token(params, logical, fraction={"experts": moe.top_k / moe.num_experts})
                + attention_flops_per_token(layers, m.num_heads, m.head_dim or m.d_model // m.num_heads, seq_len))

    @staticmethod
    def aux_metrics(model_config, aux, weight_total) -> dict:
        load = aux["load"]  # (L, E) global assignments per expert
        layers, experts = load.shape
        rel = load / jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)  # 1 = uniform
        return dict(aux_loss=jnp.sum(aux["loss"]) / weight_total,
                    balance_loss=jnp.sum(aux["balance"]) / weight_total / layers,
                    z_loss=jnp.sum(aux["z"]) / weight_total / layers,
                    load_min=jnp.min(rel), load_max=jnp.max(rel), load_cv=jnp.mean(jnp.std(rel, axis=-1)),
                    dropped=jnp.sum(aux["dropped"]) / jnp.maximum(jnp.sum(aux["assignments"]), 1.0))

    @staticmethod
    def after_step(model_config, params, aux) -> dict:
        """Aux-loss-free balancing: bias += rate * sign(mean load - load), per layer, from the step's load."""
        rate = float(model_config.moe.bias_rate)
        if not rate:
            return params
        load = aux["load"]  # (L, E)
        blocks = dict(params["blocks"])
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        blocks["router_bias"] = params["blocks"]["router_bias"] + step
        return {**params, "blocks": blocks}


class HFMoE(MoE):
    """The MoE model as an HF architecture computes it (the base of `models/mixtral.py`,
    `models/qwen3_moe.py`): the routing keys the architecture fixes (`FIXED`, checked), no router bias (HF
    has none; `moe.bias_rate` must stay 0), and dropless by default (`capacity_factor=0`: C = T slots, what
    transformers computes; `dispatch=ragged` is dropless too, on one expert rank or on GPU / TPU). The HF
    mapping is Llama's attention, norms, embedding and head (`models.llama`, with `q_norm` / `k_norm` when
    `qk_norm`) plus the router and one HF tensor per expert and projection (`Source.parts`)."""

    router_bias = False
    FIXED: dict = {}  # config.model (and model.moe) keys the architecture fixes: {key: value}
    HF_MOE = ""  # the layer's MoE module in HF names, e.g. 'model.layers.{i}.mlp'
    HF_EXPERTS = ("gate_proj", "up_proj", "down_proj")  # the expert's gate, up and down projections in HF names

    @staticmethod
    def config_defaults() -> dict:
        defaults = MoE.config_defaults()
        defaults["moe"]["capacity_factor"] = 0.0  # dropless, as transformers routes
        return defaults

    @classmethod
    def check_config(cls, m, sizes, config) -> None:
        MoE.check_config(m, sizes, config)
        for key, want in cls.FIXED.items():
            section, field = (m.moe, key[4:]) if key.startswith("moe.") else (m, key)
            if section[field] != want:
                raise ConfigError(f"config.model.{key}={section[field]!r}: model {m.name!r} is "
                                  f"{cls.hf_architectures[0]}, which has {key}={want!r}; use model.name=moe for "
                                  f"another routing or layer")

    @classmethod
    def hf_common_keys(cls, c: dict, where: str) -> dict:
        """Llama's keys of an HF config.json (attention, RoPE, norms, vocabulary; Llama's refusals), without
        Llama's dense MLP width."""
        keys = llama.Llama.hf_model_keys(c, where)
        del keys["d_ff"], keys["tie_embeddings"]  # a tied checkpoint is read untied (`hf_sources`)
        return keys

    @staticmethod
    def hf_common_config(m) -> dict:
        """Llama's config.json entries of `m` (attention, RoPE, norms, vocabulary), without the dense MLP's."""
        out = llama.Llama.hf_config(ml_collections.ConfigDict({**m.to_dict(), "d_ff": m.moe.d_ff_expert,
                                                                "tie_embeddings": False}))
        for key in ("architectures", "model_type", "intermediate_size", "mlp_bias"):
            del out[key]
        return out

    @classmethod
    def hf_sources(cls, m, tensor_names=None):
        """Llama's sources for attention, norms, embedding and head (tied heads as Llama reads them); the
        router `gate.weight` [E, D] -> w_router [D, E]; expert e's projections, HF `Linear` [out, in] each,
        -> we_gate / we_up [E, D, F], we_down [E, F, D]."""
        D, E, F, S = m.d_model, m.moe.num_experts, m.moe.d_ff_expert, hf.Source
        dense = ml_collections.ConfigDict({**m.to_dict(), "d_ff": F, "tie_embeddings": False})
        sources = {k: v for k, v in llama.Llama.hf_sources(dense, tensor_names).items()
                   if k not in ("blocks/w_gate", "blocks/w_up", "blocks/w_down")}
        if tensor_names is not None and "lm_head.weight" not in tensor_names:  # tied: the head starts as the table
            V = m.vocab_size
            sources["head"] = S("model.embed_tokens.weight", (V, D), (V, D), (1, 0))
        if m.qk_norm:
            Dh = m.head_dim or D // m.num_heads
            for ours in ("q_norm", "k_norm"):
                sources[f"blocks/{ours}"] = S(f"model.layers.{{i}}.self_attn.{ours}.weight", (Dh,), (Dh,))
        gate, up, down = (f"{cls.HF_MOE}.experts.{{j}}.{n}.weight" for n in cls.HF_EXPERTS)
        sources.update({
            "blocks/w_router": S(f"{cls.HF_MOE}.gate.weight", (E, D), (E, D), (1, 0)),
            "blocks/we_gate": S(gate, (F, D), (F, D), (1, 0), parts=E),
            "blocks/we_up": S(up, (F, D), (F, D), (1, 0), parts=E),
            "blocks/we_down": S(down, (D, F), (D, F), (1, 0), parts=E),
        })
        return sources
