"""JAX's API beyond its stable public surface, in one place: every `jax._src` import of parallax, and the
jaxpr-level names of `jax.extend` / `jax.interpreters`, which change between releases without jax's
deprecation cycle. Each name says what public API is missing and for which versions it is checked: the floor
(jax 0.10.2, Python 3.11) and the newest tested (jax 0.12.0.1, Python 3.12). A JAX upgrade that moves one of
them breaks this file only. A leaf: it imports nothing of parallax.
"""

# Reading and evaluating jaxprs (`parallax.pipeline.split`). Public only in `jax.extend.core` at the floor:
# jax.core's Var and Literal were removed by 0.10.2, its DropVar is deprecated there (gone in 0.12).
from jax.extend.core import DropVar, Literal, Var  # noqa: F401  (re-exported)

# Dead-code elimination of a jaxpr (`parallax.pipeline.work`, the routed inputs of the loss paths). No public
# API in jax.* at the floor or in 0.12; `jax.interpreters.partial_eval` re-exports jax._src's, in both.
from jax.interpreters.partial_eval import dce_jaxpr  # noqa: F401  (re-exported)


def distributed_runtime():
    """(client, process id, process count) of the runtime `jax.distributed.initialize` started; the client
    (None before it) holds the coordinator's key-value store (`key_value_set`, `key_value_try_get`). Raises
    ImportError or AttributeError on a JAX without them: callers treat that as "no key-value store"."""
    # No public handle to the runtime client: `jax.distributed` exports only initialize / is_initialized /
    # shutdown (0.10.2 and 0.12.0.1). Imported here, not at the top, so a JAX that moves it costs the
    # caller's feature (the watchdog), not every import of parallax.
    from jax._src import distributed

    state = distributed.global_state
    return state.client, state.process_id, state.num_processes
