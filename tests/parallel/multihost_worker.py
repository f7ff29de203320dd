"""One process of the two-process jax.distributed test (tests/parallel/test_multihost.py): 4 simulated
CPU devices each, one global mesh of 8 (data 2 x model 4); attribution on the mesh must equal this
process's own single-device run. Usage: python multihost_worker.py PROCESS_ID PORT."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

process_id, port = int(sys.argv[1]), int(sys.argv[2])
# CPU collectives between the processes go through gloo (jax's default CPU collectives)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import latim_jax  # noqa: E402
from latim_jax.model.config import MambaConfig  # noqa: E402
from latim_jax.model.init import init_params  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
cfg = MambaConfig(
    version=2,
    d_model=16,
    n_layers=2,
    vocab_size=32,
    d_state=4,
    d_conv=3,
    head_dim=4,
    n_groups=2,
    chunk_size=4,
)
params = init_params(cfg, 1)
rng = np.random.default_rng(0)
tokens = rng.integers(0, 32, (3, 10))
mask = np.ones((3, 10), bool)
mask[1, :3] = False
alone = latim_jax.attribute(latim_jax.MambaLM(cfg, params), tokens, method="logit", mask=mask, impl="xla")
mesh = jax.make_mesh((2, 4), ("data", "model"))  # spans both processes' devices
model = latim_jax.MambaLM(cfg, params)
got = latim_jax.attribute(model, tokens, method="logit", mask=mask, impl="xla", mesh=mesh)
assert {d.process_index for d in model.layers[0].mixer.in_proj[...].sharding.device_set} == {0, 1}
err = float(np.abs(np.asarray(got.scores) - np.asarray(alone.scores)).max() / np.abs(alone.scores).max())
assert err < 2e-5, err
for key in alone.extra:
    np.testing.assert_allclose(np.asarray(got.extra[key]), np.asarray(alone.extra[key]), rtol=2e-5, atol=2e-6)
print(f"process {process_id}: OK {err:.2e}", flush=True)
