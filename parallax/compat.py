"""JAX internals parallax needs, in one place (placeholder until the compat module lands)."""
from jax._src.interpreters.partial_eval import dce_jaxpr  # noqa: F401
