"""Qwen 2 / 2.5 and Qwen 3: the Llama decoder (`models/llama.py`) with the options these families fix.

- `Qwen2` (`Qwen2ForCausalLM`, Qwen 2 and 2.5): biases on the q / k / v projections (none on o).
- `Qwen3` (`Qwen3ForCausalLM`): an RMSNorm over head_dim on every q and k head before RoPE (QK-norm), an
  explicit head_dim, no biases.

Both take RoPE theta, the RMSNorm epsilon and the tie of the head to the embedding (the small sizes tie it)
from their HF config. Sliding-window attention (`use_sliding_window: true`, or a `sliding_attention` layer
type) is refused, as are attention biases beyond Qwen 2's q / k / v ones: one line naming the field.
"""

from __future__ import annotations

from parallax import hf_mapping as hf

from models import llama


def _full_attention_only(c: dict, where: str) -> None:
    if c.get("use_sliding_window", False):
        hf.unsupported(where, "use_sliding_window", c["use_sliding_window"],
                       "parallax's Qwen attends over the whole window (use_sliding_window=false)")
    for kind in c.get("layer_types") or ():
        if kind != "full_attention":
            hf.unsupported(where, "layer_types", kind, "parallax's Qwen has only 'full_attention' layers")


def _no_sliding_window(m) -> dict:
    return {"use_sliding_window": False, "max_window_layers": m.num_layers,
            "layer_types": ["full_attention"] * m.num_layers}


class Qwen2(llama.Llama):
    """Qwen 2 / 2.5: the Llama decoder with q / k / v projection biases."""

    layer_options = {"qkv_bias": True}

    @staticmethod
    def config_defaults() -> dict:
        return {**llama.Llama.config_defaults(), "rope_theta": 1e6, "norm_eps": 1e-6}

    hf_architectures = ("Qwen2ForCausalLM",)

    @staticmethod
    def hf_model_keys(c, where):
        """HF Qwen2 config.json -> our keys; refuses sliding-window attention."""
        _full_attention_only(c, where)
        return llama.decoder_keys(c, where)

    @staticmethod
    def hf_config(m):
        return {**llama.decoder_hf_config(m), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                **_no_sliding_window(m)}

    @staticmethod
    def hf_sources(m, tensor_names=None):
        """The Llama layout's tensors plus `self_attn.{q,k,v}_proj.bias` ([H*Dh] -> [H, Dh])."""
        return llama.decoder_sources(m, qkv_bias=True)


class Qwen3(llama.Llama):
    """Qwen 3 (dense): the Llama decoder with QK-norm."""

    layer_options = {"qk_norm": True}

    @staticmethod
    def config_defaults() -> dict:
        return {**llama.Llama.config_defaults(), "rope_theta": 1e6, "norm_eps": 1e-6}

    hf_architectures = ("Qwen3ForCausalLM",)

    @staticmethod
    def hf_model_keys(c, where):
        """HF Qwen3 config.json -> our keys; refuses attention biases and sliding-window attention."""
        if c.get("attention_bias", False):
            hf.unsupported(where, "attention_bias", c["attention_bias"], "parallax's Qwen3 has no attention biases")
        _full_attention_only(c, where)
        return llama.decoder_keys(c, where)

    @staticmethod
    def hf_config(m):
        return {**llama.decoder_hf_config(m), "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "attention_bias": False, **_no_sliding_window(m)}

    @staticmethod
    def hf_sources(m, tensor_names=None):
        """The Llama layout's tensors plus `self_attn.{q,k}_norm.weight` ([Dh] per layer)."""
        return llama.decoder_sources(m, qk_norm=True)
