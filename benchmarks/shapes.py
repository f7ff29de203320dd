"""Model shapes the benchmarks build with random weights (the field names of latim_jax.MambaConfig).

Real shapes are those of the public checkpoints (state-spaces/mamba-130m-hf, mamba2-130m, and the 370m
ones); "quick" shapes are tiny versions with the same structure for validating the scripts end to end.
"""

from __future__ import annotations

SHAPES = {
    "130m": {
        1: dict(version=1, d_model=768, n_layers=24, vocab_size=50280, d_state=16, d_conv=4, expand=2),
        2: dict(
            version=2,
            d_model=768,
            n_layers=24,
            vocab_size=50288,
            d_state=128,
            d_conv=4,
            expand=2,
            head_dim=64,
            n_groups=1,
            chunk_size=256,
        ),
    },
    "370m": {
        1: dict(version=1, d_model=1024, n_layers=48, vocab_size=50280, d_state=16, d_conv=4, expand=2),
        2: dict(
            version=2,
            d_model=1024,
            n_layers=48,
            vocab_size=50288,
            d_state=128,
            d_conv=4,
            expand=2,
            head_dim=64,
            n_groups=1,
            chunk_size=256,
        ),
    },
    "quick": {
        1: dict(version=1, d_model=64, n_layers=2, vocab_size=256, d_state=16, d_conv=4, expand=2),
        2: dict(
            version=2,
            d_model=64,
            n_layers=2,
            vocab_size=256,
            d_state=32,
            d_conv=4,
            expand=2,
            head_dim=32,
            n_groups=1,
            chunk_size=64,
        ),
    },
}


def shape(name: str, version: int, **changes) -> dict:
    """The shape ``name`` of Mamba-``version`` with ``changes`` (e.g. n_layers=1 for one layer)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    return {**SHAPES[name][version], **changes}


def dims(s: dict) -> dict:
    """Derived sizes: e (inner width), h (heads; Mamba-1: e), n, d, k, g, layers, vocab."""
    e = s.get("expand", 2) * s["d_model"]
    h = e // s["head_dim"] if s["version"] == 2 else e
    return dict(
        e=e,
        h=h,
        n=s.get("d_state", 16),
        d=s["d_model"],
        k=s.get("d_conv", 4),
        g=s.get("n_groups", 1) if s["version"] == 2 else 1,
        layers=s["n_layers"],
        vocab=s["vocab_size"],
    )


def transformers_config(s: dict):
    """A transformers MambaConfig / Mamba2Config of shape ``s`` (random init; nothing downloaded)."""
    import transformers

    common = dict(
        vocab_size=s["vocab_size"],
        hidden_size=s["d_model"],
        state_size=s.get("d_state", 16),
        num_hidden_layers=s["n_layers"],
        conv_kernel=s.get("d_conv", 4),
        expand=s.get("expand", 2),
        hidden_act="silu",
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
    )
    if s["version"] == 1:
        return transformers.MambaConfig(**common)
    return transformers.Mamba2Config(
        num_heads=s.get("expand", 2) * s["d_model"] // s["head_dim"],
        head_dim=s["head_dim"],
        n_groups=s.get("n_groups", 1),
        chunk_size=s.get("chunk_size", 256),
        **common,
    )
