"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B) as parallax's MoE model (`models.moe`).

transformers' Qwen3-MoE layer is Llama's attention with QK-norm (an RMSNorm over head_dim on each query
and key head, before RoPE: `self_attn.q_norm` / `k_norm`, here `model.qk_norm`) and a sparse MLP: router
logits `h @ gate.weight.T` [E], a softmax over all E experts in fp32, the top-k, renormalised over the k
only when `norm_topk_prob` (`Qwen3MoeTopKRouter`), and the gate-weighted sum of the k experts' SwiGLU
(`gate_proj`, `up_proj`, `down_proj` of width `moe_intermediate_size`); no shared expert (Qwen2-MoE's).
In `model.moe` terms: `router=softmax`, `norm_topk=norm_topk_prob`, `router_scale=1`, no shared experts,
no router bias (`FIXED`, checked). Routing is dropless by default (`HFMoE`). Checkpoints store each
expert's projections as their own tensors (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`: the
Hub's files and `save_pretrained`'s; fused only in transformers' memory); export writes the same names.

Refused with one line: a dense layer anywhere (`decoder_sparse_step` other than 1, a non-empty
`mlp_only_layers`), sliding windows (`use_sliding_window=true`), and Llama's refusals (scaled RoPE,
attention biases, activations other than SiLU).
"""

from __future__ import annotations

from models.moe import HFMoE
from parallax import hf_mapping as hf


class Qwen3MoE(HFMoE):
    """Qwen3-MoE: `HFMoE` with QK-norm, Qwen3's routing and tensor names."""

    FIXED = {"moe.router": "softmax", "moe.router_scale": 1.0, "moe.shared_experts": 0, "moe.first_dense": 0,
             "moe.bias_rate": 0.0, "qk_norm": True}
    HF_MOE = "model.layers.{i}.mlp"
    hf_architectures = ("Qwen3MoeForCausalLM",)

    @staticmethod
    def config_defaults() -> dict:
        return {**HFMoE.config_defaults(), "qk_norm": True}

    @classmethod
    def hf_model_keys(cls, c, where):
        """HF Qwen3-MoE config.json -> our keys (see the module docstring for what is refused)."""
        if c.get("decoder_sparse_step", 1) != 1:
            hf.unsupported(where, "decoder_sparse_step", c["decoder_sparse_step"],
                           "every layer must be a MoE layer (decoder_sparse_step=1)")
        if c.get("mlp_only_layers"):
            hf.unsupported(where, "mlp_only_layers", c["mlp_only_layers"],
                           "every layer must be a MoE layer (mlp_only_layers=[])")
        if c.get("use_sliding_window"):
            hf.unsupported(where, "use_sliding_window", c["use_sliding_window"],
                           "parallax's attention here is full causal; only use_sliding_window=false is read")
        experts = c.get("num_experts", c.get("num_local_experts"))  # the Hub's name, transformers 5's
        if not experts:
            hf.unsupported(where, "num_experts", experts, "a MoE checkpoint has num_experts > 0")
        moe = dict(num_experts=experts, top_k=hf.required(c, "num_experts_per_tok", where),
                   d_ff_expert=hf.required(c, "moe_intermediate_size", where),
                   norm_topk=bool(c.get("norm_topk_prob", False)))
        return {**cls.hf_common_keys(c, where), "moe": moe}

    @classmethod
    def hf_config(cls, m):
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **cls.hf_common_config(m),
                "moe_intermediate_size": m.moe.d_ff_expert, "num_experts": m.moe.num_experts,
                "num_experts_per_tok": m.moe.top_k, "norm_topk_prob": bool(m.moe.norm_topk),
                "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                "sliding_window": None,
                # the width of a dense layer's MLP, which this model has none of (Qwen3-30B-A3B writes k * F)
                "intermediate_size": m.moe.top_k * m.moe.d_ff_expert}
