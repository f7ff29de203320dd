"""The execution context names what the programs are built for (platform and TPU generation), resolved
once at the API edge; the kernels take it from there, so the library's own programs build for a TPU
from this CPU host without patching jax (lowering only: no libtpu)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import latim_jax
from latim_jax.kernels import lowering
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params
from latim_jax.parallel import chips
from latim_jax.parallel.context import Context, resolve

CONFIGS = {
    1: MambaConfig(version=1, d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=4),
    2: MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, d_state=16, d_conv=4, head_dim=16,
                   n_groups=1, chunk_size=8),
}  # fmt: skip


def test_resolve_follows_the_running_backend_unless_told():
    ctx = resolve("auto")
    assert ctx.platform == jax.default_backend() and ctx.chip is None and ctx.kernels is False
    assert resolve("pallas").interpret is True  # this CPU host: the kernels interpret
    tpu = resolve("pallas", chip="TPU v5 lite")  # a device kind names its generation; chip implies tpu
    assert (tpu.platform, tpu.chip, tpu.interpret, tpu.kernels) == ("tpu", "v5e", False, True)
    assert (
        resolve("auto", platform="tpu").kernels is True and resolve("auto", platform="cuda").platform == "gpu"
    )
    assert tpu.local() == tpu and resolve(tpu) is tpu


def test_resolve_refuses_what_names_no_target():
    with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
        resolve("pallas", chip="v9")
    with pytest.raises(ValueError, match="names a TPU generation, but platform='gpu'"):
        resolve("pallas", platform="gpu", chip="v4")
    with pytest.raises(ValueError, match="platform must be one of"):
        Context(platform="npu")


def test_chip_names_and_the_vmem_table():
    assert [chips.check_chip(x) for x in ("v5litepod", "TPU v6 lite", "tpu v5p", "Trillium", "TPU v4")] == [
        "v5e", "v6e", "v5p", "v6e", "v4",
    ]  # fmt: skip
    for chip in chips.TPU_CHIPS.values():  # the limit the kernels pass stays within the VMEM
        assert chip.default_scoped_bytes <= chip.vmem_limit_bytes <= chip.vmem_bytes
    assert chips.smallest_chip().name == "v4"


@pytest.mark.parametrize("version", [1, 2])
def test_a_models_forward_builds_for_a_named_tpu_from_this_host(version):
    """The model's own forward, given a context resolved for TPU v5e, lowers to Mosaic kernels that
    carry v5e's scoped-VMEM limit: no jax.default_backend() below the API edge decides otherwise."""
    config = CONFIGS[version]
    model = latim_jax.MambaLM(config, init_params(config, 1))
    ctx = resolve("pallas", chip="v5e")
    tokens = np.zeros((1, 16), np.int32)
    forward = lambda t: model(t, impl=ctx)  # noqa: E731
    calls = lowering.pallas_grids(forward, tokens)
    assert len(calls) == config.n_layers
    assert {c["vmem_limit_bytes"] for c in calls} == {chips.TPU_CHIPS["v5e"].vmem_limit_bytes}
    try:
        text = lowering.lower_for_tpu(forward, tokens).as_text()
    except lowering.LoweringUnsupported as err:
        pytest.skip(str(err))
    assert "tpu_custom_call" in text  # (the layers share one lowered kernel function)
