"""What goes in and out of the library: loading models, the Attribution result and its files (atomic .npz,
streamed directories), progress bars and plots; reads model and convert, never the LaTIM maths."""

from latim_jax.io.loading import load
from latim_jax.io.results import Attribution

__all__ = ["Attribution", "load"]
