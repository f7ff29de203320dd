"""Write the golden files that let the jax-only test leg (Python 3.12, newest jax: no torch there) check
latim-jax against the independent float64 PyTorch reference (tests/latim/torch_latim.py).

    python tests/goldens/make_goldens.py      # needs torch + transformers (the Python 3.11 leg)

For each variant: a tiny random transformers checkpoint (config.json + model.safetensors, written by
``save_pretrained``) in tests/goldens/<name>/, and in tests/goldens/<name>.npz, all computed in float64
by transformers (the model cast to float64) and the reference: the logits; layer 0's contributions T,
bias and output of prompt 0 in both modes; every layer's l2 / alti / logit scores (exact) and l2
(paper); the alti and logit rollouts; and the directional derivative of a weighted sum of layer 0's
l2 scores of prompt 0 with respect to the input embeddings, by central differences of the reference's
forward (``grad_w``, ``grad_v``, ``grad_dir``). tests/latim/test_goldens.py reads them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "latim")]

import torch_latim  # noqa: E402
from conftest import build_hf  # noqa: E402

VARIANTS = {
    "m1": dict(version=1, d_state=4, d_conv=4, use_bias=True, tied=False, seed=1),
    "m2": dict(version=2, d_state=4, d_conv=3, head_dim=4, n_groups=2, seed=2),
}
B, L = 2, 11  # L > the Mamba-2 chunk (8)


def _mixer_input(ref, h):
    """RMSNorm of the block (float64): the mixer input xhat from the block input h (L, d)."""
    norm = ref.backbone.layers[0].norm
    var = h.pow(2).mean(-1, keepdim=True)
    return h * torch.rsqrt(var + norm.variance_epsilon) * norm.weight.detach().double()


def main() -> None:
    for name, kw in VARIANTS.items():
        ref = build_hf(**kw)
        out_dir = HERE / name
        ref.save_pretrained(out_dir)  # fp32 safetensors: what latim_jax.load reads
        ref = ref.double()
        tokens = np.random.default_rng(0).integers(0, ref.config.vocab_size, (B, L))
        seen, h_final, logits = torch_latim.capture(ref, torch.from_numpy(tokens))
        g = {"tokens": tokens, "logits": logits.numpy()}
        for mode in ("exact", "paper"):
            T, bias, o = torch_latim.decompose_layer(
                ref.backbone.layers[0].mixer, seen[0]["xhat"][0], mode=mode
            )
            g[f"T_{mode}"], g[f"bias_{mode}"], g[f"output_{mode}"] = T.numpy(), bias.numpy(), o.numpy()
        for method, mode in (("l2", "exact"), ("alti", "exact"), ("logit", "exact"), ("l2", "paper")):
            maps, direct = torch_latim.reference_maps(ref, seen, h_final, logits, method, mode)
            g[f"scores_{method}_{mode}"] = np.asarray([[m.numpy() for m in per] for per in maps])
            if mode == "exact" and method in ("alti", "logit"):
                alti = None
                if method == "logit":
                    alti = [[torch.from_numpy(m) for m in per] for per in g["scores_alti_exact"]]
                g[f"rollout_{method}"] = np.stack([
                    torch_latim.rollout(maps[b], method, direct=direct[b],
                                        alti=None if alti is None else alti[b]).numpy()
                    for b in range(B)
                ])  # fmt: skip
        # d/d(embeddings) of sum(w * l2 scores of layer 0, prompt 0) along v: central differences
        rng = np.random.default_rng(1)
        w, v = rng.normal(size=(L, L)), rng.normal(size=(L, ref.config.hidden_size))
        h0 = seen[0]["h"][0]
        mixer = ref.backbone.layers[0].mixer

        def f(h, ref=ref, mixer=mixer, w=w):
            T, _, o = torch_latim.decompose_layer(mixer, _mixer_input(ref, h), mode="exact")
            return float((torch.from_numpy(w) * torch_latim.scores(T, h, o, "l2")).sum())

        eps = 1e-5
        step = torch.from_numpy(v)
        g.update(
            grad_w=w, grad_v=v, grad_dir=np.asarray((f(h0 + eps * step) - f(h0 - eps * step)) / (2 * eps))
        )
        np.savez(HERE / f"{name}.npz", **g)
        print(f"wrote {out_dir} and {name}.npz")


if __name__ == "__main__":
    main()
