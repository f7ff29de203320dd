"""The shipped task models (copy, MQAR, align, needle; Mamba-1 and Mamba-2; the needle hybrids with
Mamba-2 or Gated DeltaNet beside attention), one directory each in
the saved format. ``latim_jax.load("copy-mamba2")`` resolves these names
(``latim_jax.io.loading.SHIPPED``)."""
