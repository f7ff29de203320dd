"""``python -m latim_jax.cli``: the ``latim-jax`` command."""

import sys

from latim_jax.cli.main import main

sys.exit(main())
