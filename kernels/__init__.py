"""Pallas kernels with their pure-jnp references, the one definition of the decay tile M, the one tile-size
type, and the scan dispatcher; imports nothing of latim_jax above latim_jax.parallel."""

import jax.numpy as jnp

f32 = jnp.float32  # the dtype of every accumulation, state and score in the library
