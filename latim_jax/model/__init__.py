"""The models: configuration, stateless layers, the Mamba mixers (one layer kind each), the language model,
its parameter layout on a mesh, initialisation and generation; reads kernels through the scan dispatcher."""

from latim_jax.model.config import MambaConfig
from latim_jax.model.lm import Block, Inputs, MambaLM, ModelOutput, block_forward
from latim_jax.model.sharding import context, shard

__all__ = ["Block", "Inputs", "MambaConfig", "MambaLM", "ModelOutput", "block_forward", "context", "shard"]
