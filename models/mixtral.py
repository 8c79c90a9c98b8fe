"""Mixtral (HF `MixtralForCausalLM`, e.g. Mixtral 8x7B) as parallax's MoE model (`models.moe`).

transformers' Mixtral layer is Llama's attention (GQA, RoPE over the two halves of each head, RMSNorm
before attention and before the MLP) and a sparse MLP: router logits `h @ gate.weight.T` [E], a softmax
over all E experts in fp32, the top-k of those probabilities, renormalised to sum to 1 over the k
(`MixtralTopKRouter`), and the gate-weighted sum of the k experts' SwiGLU (`w1` gate, `w3` up, `w2` down).
In `model.moe` terms: `router=softmax`, `norm_topk=true`, `router_scale=1`, no shared experts, no dense
layers, no router bias (`FIXED`, checked); `num_experts`, `top_k` and `d_ff_expert` come from
`num_local_experts`, `num_experts_per_tok` and `intermediate_size`. Routing is dropless by default
(`HFMoE`). Checkpoints store each expert's projections as their own tensors
(`model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`, what the Hub's files and transformers'
`save_pretrained` hold; transformers fuses them into `experts.gate_up_proj` in memory only); export
writes the same names.

Refused with one line: `sliding_window` other than null (Mixtral 8x7B has null), `router_jitter_noise`
other than 0, and Llama's refusals (scaled RoPE, biases, activations other than SiLU).
"""

from __future__ import annotations

from models.moe import HFMoE
from parallax import hf_mapping as hf


class Mixtral(HFMoE):
    """Mixtral: `HFMoE` with Mixtral's routing and tensor names."""

    FIXED = {"moe.router": "softmax", "moe.norm_topk": True, "moe.router_scale": 1.0, "moe.shared_experts": 0,
             "moe.first_dense": 0, "moe.bias_rate": 0.0, "qk_norm": False}
    HF_MOE = "model.layers.{i}.block_sparse_moe"
    HF_EXPERTS = ("w1", "w3", "w2")
    hf_architectures = ("MixtralForCausalLM",)

    @classmethod
    def hf_model_keys(cls, c, where):
        """HF Mixtral config.json -> our keys (see the module docstring for what is refused)."""
        if c.get("sliding_window") is not None:
            hf.unsupported(where, "sliding_window", c["sliding_window"],
                           "parallax's attention here is full causal; only sliding_window=null is read")
        if c.get("router_jitter_noise", 0.0):
            hf.unsupported(where, "router_jitter_noise", c["router_jitter_noise"],
                           "parallax's router adds no noise; set router_jitter_noise=0")
        moe = dict(num_experts=hf.required(c, "num_local_experts", where),
                   top_k=hf.required(c, "num_experts_per_tok", where),
                   d_ff_expert=hf.required(c, "intermediate_size", where))
        return {**cls.hf_common_keys(c, where), "moe": moe}

    @classmethod
    def hf_config(cls, m):
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **cls.hf_common_config(m),
                "intermediate_size": m.moe.d_ff_expert, "num_local_experts": m.moe.num_experts,
                "num_experts_per_tok": m.moe.top_k, "sliding_window": None, "router_jitter_noise": 0.0}
