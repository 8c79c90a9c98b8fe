"""A user's own model, outside `models/`: the "Bring your own model" example of docs/custom-models.md, verbatim (a test
checks that it stays so). It uses no parallel surface (no `parallel_axes`), so parallax runs it dense, data
/ FSDP parallel and pipelined. Named in tests/user_model_config.py by its import path,
`user_model:ResidualMLP` (tests/ on PYTHONPATH)."""

import jax, jax.numpy as jnp
from flax import nnx
from parallax.model import Model

def param(rngs, shape, names, std):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), logical=names)

class Blocks(nnx.Module):
    def __init__(self, c, rngs):
        self.w_in = param(rngs, (c.num_layers, c.width, 4 * c.width), ("layers", "embed", "mlp"), 0.1)
        self.w_out = param(rngs, (c.num_layers, 4 * c.width, c.width), ("layers", "mlp", "embed"), 0.1)

    def layer(self, x, batch, par):  # one block, on this layer's slice of the stacked weights
        return x + jnp.tanh(x @ self.w_in[...]) @ self.w_out[...]

class ResidualMLP(Model):
    @staticmethod
    def config_defaults():
        return {"width": 64}  # config.model keys of this model, besides num_layers, vocab_size, ...

    def __init__(self, c, rngs):  # c: the config.model section
        self.table = param(rngs, (c.vocab_size, c.width), ("vocab", "embed"), 1.0)
        self.blocks = Blocks(c, rngs)
        self.out = param(rngs, (c.width, c.vocab_size), ("embed", "vocab"), 0.1)

    def embed(self, batch, par):
        return jnp.take(self.table[...], batch["inputs"], axis=0)

    def logits(self, x, par):
        return x @ self.out[...]
