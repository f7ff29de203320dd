"""Scan kernels (Pallas) and their pure-jnp references, behind one dispatcher (``impl``)."""
