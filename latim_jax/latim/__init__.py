"""The LaTIM maths and its API: each layer kind's token decomposition, the one block loop, the scores and
baselines, the memory estimate, and attribute / contributions / conservation_error / attribute_dataset."""

from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.attribution import Contributions, attribute, conservation_error, contributions
from latim_jax.latim.dataset import attribute_dataset, open_results
from latim_jax.latim.generated import attribute_generated

__all__ = [
    "Blocks",
    "Contributions",
    "attribute",
    "attribute_dataset",
    "attribute_generated",
    "conservation_error",
    "contributions",
    "open_results",
]
