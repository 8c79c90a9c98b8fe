"""Mistral (`MistralForCausalLM`): the Llama decoder of models/llama.py with a sliding attention window.

Mistral 7B v0.1 is Llama's architecture (RMSNorm, RoPE on the halves of each head, grouped-query
attention, SwiGLU, an untied head) whose layers attend to their document's latest `sliding_window`
positions (4096) instead of every earlier one; later Mistral checkpoints set `sliding_window` to null
(full causal attention). The window is Llama's `sliding_window` key, which the layers pass to
`par.attention(..., window=)`: every attention kind and kernel the plan can pick has it, the KV-cache
decode included. So this file holds only the Hugging Face names: the architecture, the config keys (the
window) and the tensor names (Llama's).
"""

from __future__ import annotations

from models import llama


class Mistral(llama.Llama):
    """Llama with a sliding window over every layer (`sliding_window`, 0: none) and Mistral's HF names."""

    hf_architectures = ("MistralForCausalLM",)

    @staticmethod
    def config_defaults() -> dict:
        return {**llama.Llama.config_defaults(),
                "sliding_window": 4096,  # attention to a document's latest this many positions (0: all; 4096 as HF's)
                }

    @staticmethod
    def hf_model_keys(c, where):
        """HF Mistral config.json -> our keys: Llama's (the same refusals), with `sliding_window` (null: 0)."""
        return {**llama.Llama.hf_model_keys(c, where), "sliding_window": int(c.get("sliding_window") or 0)}

    @staticmethod
    def hf_config(m):
        config = {**llama.Llama.hf_config(m), "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                  "sliding_window": int(m.sliding_window) or None}
        for key in ("attention_bias", "mlp_bias"):  # not MistralConfig's keys: its layers have no biases
            config.pop(key, None)
        return config
