"""latim-jax: LaTIM token-to-token interactions for Mamba-1 and Mamba-2 in JAX.

Public API: :func:`load`, :func:`attribute`, :func:`contributions`, :func:`conservation_error`,
:class:`Attribution`, :class:`MambaConfig`, :class:`MambaLM`, :func:`shard` (lay a model out on a device
mesh; see :mod:`latim_jax.sharding`), :func:`open_results` (read an attribute-dataset run).
"""

__version__ = "0.1.0"

from latim_jax.attribution import attribute, conservation_error, contributions  # noqa: E402
from latim_jax.config import MambaConfig  # noqa: E402
from latim_jax.dataset import open_results  # noqa: E402
from latim_jax.loading import load  # noqa: E402
from latim_jax.model import MambaLM  # noqa: E402
from latim_jax.results import Attribution  # noqa: E402
from latim_jax.sharding import shard  # noqa: E402

__all__ = [
    "Attribution",
    "MambaConfig",
    "MambaLM",
    "attribute",
    "conservation_error",
    "contributions",
    "load",
    "open_results",
    "shard",
    "__version__",
]
