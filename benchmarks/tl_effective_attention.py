"""TransformerLens's Gated DeltaNet "effective attention" beside latim-jax's exact map, on the same tiny
random Qwen3-Next checkpoint (issue 42, item 5). A benchmark script, not a test dependency.

Per value head of a Gated DeltaNet layer, with q_t, k_t L2-normalised (q_t also scaled by d_k^-1/2),
the decay g_t <= 0 and the rate beta_t held at their forward values, the recurrence output is exactly

    o_t = sum_{j <= t} M[t, j] v_j,   M[t, j] = beta_j q_t^T A_t ... A_{j+1} k_j,
    A_t = (I - beta_t k_t k_t^T) e^{g_t}                                  (docs/method.md, section 15)

with v_j the post-conv values. TransformerLens's ``GatedDeltaNetBridge.compute_effective_attention``
(transformer_lens/model_bridge/generalized_components/gated_delta_net.py) returns, in its own docstring's
words an "interpretability heuristic, not a faithful output decomposition",

    E[t, j] = (q_t . k_j) beta_j prod_{s=j+1}^{t} e^{g_s}

from its cached hook_q / hook_k: the conv outputs BEFORE the L2 norm (and without the d_k^-1/2 scale),
and without the key removal (I - beta_t k_t k_t^T). Three maps act on the same v_j here:

    tl_effective_attention   TransformerLens's own function on its own cache (when it imports), else
                             our reimplementation of the formula above from latim-jax's intermediates
    heuristic_normalised     the same formula on the normalised, scaled q and k (ours): what is left of
                             the heuristic's error once the L2-norm gap is closed, i.e. the key removal
    latim_exact              latim-jax's M (latim_jax.kernels.delta_rule.m_tile)

and each is scored on (a) how well sum_j A[t, j] v_j rebuilds the recurrence output o_t (TransformerLens's
hook_recurrence_out: before the gated RMSNorm and out_proj) and the mixer output (hook_linear_attn_out:
after them, once with the gated norm's scale 1/rms(o_t) and gate held at the forward's values as latim-jax
holds them, once with the norm recomputed on the rebuilt o_t), and (b) how the maps differ from M: rank
correlation per target row (signed values and magnitudes), agreement of each row's strongest source,
the largest difference, the mass on the diagonal, the share of negative entries and of entries whose
sign differs from M's.

TransformerLens is not a dependency of latim-jax. Install it beside the repo's venv without touching it
(it needs torch >= 2.6 and transformers >= 5.9; no other torch is downloaded with --no-deps):

    pip install --target /tmp/tlpkgs --no-deps transformer-lens==4.3.0 einops fancy-einsum jaxtyping \\
        beartype typeguard wadler-lindig datasets accelerate pyarrow dill multiprocess xxhash fsspec pandas
    PYTHONPATH=/tmp/tlpkgs python benchmarks/tl_effective_attention.py      # ~40 s on 2 CPU cores

Without it the script still runs, with our reimplementation in the first row, and says so in its output.
Output: --out (default benchmarks/results/tl_effective_attention.json) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import rankdata

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/families.py: the tiny transformers builders

import latim_jax  # noqa: E402
from latim_jax.latim.kinds import layer_factors  # noqa: E402
from latim_jax.model.layers import activation  # noqa: E402

MAPS = ("tl_effective_attention", "heuristic_normalised", "latim_exact")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="the checkpoint's seed (tests/families.py)")
    p.add_argument("--token-seed", type=int, default=1)
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "tl_effective_attention.json"
    )
    return p.parse_args(argv)


def heuristic(q, k, g, beta):
    """E[t, j] = (q_t . k_j) beta_j exp(sum_{s=j+1}^{t} g_s) for j <= t, 0 above: (b, H, l, l) float64 from
    q, k (b, l, H, dk), g, beta (b, l, H). Our reimplementation of the formula in TransformerLens's
    ``compute_effective_attention`` docstring (the gated-linear-attention form, no key removal)."""
    q, k, g, beta = (np.asarray(x, np.float64) for x in (q, k, g, beta))
    qk = np.einsum("bthd,bjhd->bhtj", q, k)
    cg = np.cumsum(g, axis=1).transpose(0, 2, 1)  # (b, H, l)
    length = q.shape[1]
    causal = np.tril(np.ones((length, length), bool))
    decay = np.where(causal, np.exp(np.where(causal, cg[..., :, None] - cg[..., None, :], 0.0)), 0.0)
    return qk * beta.transpose(0, 2, 1)[:, :, None, :] * decay


def l2n(x, eps=1e-6):
    """The FLA / transformers l2norm in float64."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def rel(a, b) -> float:
    """||a - b|| / ||b||."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def row_stats(A, M) -> dict:
    """How the map A (b, H, l, l) differs from the exact M, over the causal entries of every target row.
    Entries of M below 1e-6 max|M| (decays that underflow fp32, e^{g} ~ e^-10 a step) are left out of the
    rank correlations and the sign comparison: both maps are ~0 there and their signs mean nothing."""
    b, H, length, _ = M.shape
    tol_m, tol_a = 1e-6 * np.max(np.abs(M)), 1e-6 * np.max(np.abs(A))
    spear, spear_abs, top1 = [], [], []
    diag_a, diag_m = [], []
    for bi in range(b):
        for h in range(H):
            for t in range(1, length):
                a, m = A[bi, h, t, : t + 1], M[bi, h, t, : t + 1]
                diag_a.append(abs(a[t]) / np.abs(a).sum())
                diag_m.append(abs(m[t]) / np.abs(m).sum())
                top1.append(int(np.argmax(np.abs(a)) == np.argmax(np.abs(m))))
                keep = np.abs(m) > tol_m
                if keep.sum() >= 3:  # a rank correlation needs three sources
                    a, m = a[keep], m[keep]
                    spear.append(np.corrcoef(rankdata(a), rankdata(m))[0, 1])
                    spear_abs.append(np.corrcoef(rankdata(np.abs(a)), rankdata(np.abs(m)))[0, 1])
    low = np.tril(np.ones((length, length), bool))
    off = np.tril(np.ones((length, length), bool), -1)
    a_low, m_low = A[:, :, low], M[:, :, low]
    a_off, m_off = A[:, :, off], M[:, :, off]
    seen = np.abs(m_off) > tol_m
    return dict(
        spearman_mean=float(np.mean(spear)),
        spearman_min=float(np.min(spear)),
        spearman_abs_mean=float(np.mean(spear_abs)),
        spearman_rows=len(spear),
        top1_agreement=float(np.mean(top1)),
        max_abs_diff=float(np.max(np.abs(A - M))),
        max_abs_diff_rel=float(np.max(np.abs(A - M)) / np.max(np.abs(M))),
        map_rel_diff=rel(a_low, m_low),
        offdiag_rel_diff=rel(a_off, m_off),
        diag_mass=float(np.mean(diag_a)),
        diag_mass_exact=float(np.mean(diag_m)),
        negative_fraction=float(np.mean(a_low[np.abs(a_low) > tol_a] < 0)),
        negative_fraction_exact=float(np.mean(m_low[np.abs(m_low) > tol_m] < 0)),
        sign_disagreement_offdiag=float(np.mean(np.sign(a_off[seen]) != np.sign(m_off[seen]))),
        sign_compared_offdiag=int(seen.sum()),
    )


def load_tl():
    """(TransformerBridge, version) or (None, the reason it is missing)."""
    try:
        from importlib.metadata import version

        from transformer_lens.model_bridge import TransformerBridge
        from transformer_lens.model_bridge.generalized_components.gated_delta_net import GatedDeltaNetBridge

        del GatedDeltaNetBridge
    except Exception as err:  # noqa: BLE001 - any import failure means: no bridge here
        return None, f"{type(err).__name__}: {err}"
    return TransformerBridge, version("transformer-lens")


VARIANTS = {
    "as_built": "tests/families.py qwen3_next(seed=SEED) unchanged: transformers' A_log init (A in (0, 16)), "
    "so e^{g_t} ~ e^-10 per step and the maps are nearly diagonal",
    "long_memory": "the same checkpoint with every Gated DeltaNet A_log set to log U(0.01, 0.1) before "
    "save_pretrained (e^{g_t} ~ 0.9-0.99 per step: sources tens of tokens back still count)",
}


def build(variant: str, seed: int):
    """The tiny Qwen3-Next of tests/families.py, and for "long_memory" a slower decay."""
    import torch
    from families import qwen3_next

    model = qwen3_next(seed=seed)
    if variant == "long_memory":
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("linear_attn.A_log"):
                    p.copy_(torch.log(0.01 + 0.09 * torch.rand(p.shape, generator=g)))
    return model


def run(args) -> dict:
    import torch
    import transformers

    Bridge, tl_version = load_tl()
    tokens = np.random.default_rng(args.token_seed).integers(0, 48, (args.prompts, args.length))
    result = dict(
        checkpoint=f"tests/families.py qwen3_next(seed={args.seed}): Qwen3NextForCausalLM, d_model 16, "
        "4 layers (gdn, attention, gdn, attention), 2 key heads x 8, 4 value heads x 6, random weights",
        prompts=args.prompts, length=args.length, token_seed=args.token_seed,
        versions=dict(
            python=platform.python_version(), jax=jax.__version__, torch=torch.__version__,
            transformers=transformers.__version__, latim_jax=latim_jax.__version__,
            transformer_lens=tl_version if Bridge is not None else None,
        ),
        transformer_lens_used=Bridge is not None,
        transformer_lens_missing=None if Bridge is not None else tl_version,
        variants={},
    )  # fmt: skip
    for variant, what in VARIANTS.items():
        entry = result["variants"][variant] = dict(
            description=what.replace("SEED", str(args.seed)), layers=[]
        )
        with tempfile.TemporaryDirectory() as ckpt:
            build(variant, args.seed).save_pretrained(ckpt)
            model = latim_jax.load(ckpt)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt, dtype=torch.float32, use_kernels=False
            ).eval()
            with torch.no_grad():
                hf_logits = hf(torch.as_tensor(tokens)).logits
            hf_linear = [i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"]
            cache = bridge = None
            if Bridge is not None:
                bridge = Bridge.boot_transformers(ckpt, hf_model=hf, device="cpu")
                with torch.no_grad():
                    logits, cache = bridge.run_with_cache(torch.as_tensor(tokens), use_cache=False)
                entry["bridge_logits_vs_transformers_max_abs"] = float((logits - hf_logits).abs().max())
            out = model.forward(tokens)
            entry["latim_logits_vs_transformers_rel"] = rel(out.logits, hf_logits.numpy())
            gdn = [i for i, k in enumerate(model.config.kinds) if k == "gdn"]
            for li, L in zip(hf_linear, gdn, strict=True):
                entry["layers"].append(one_layer(model, L, out.residuals[L], tokens, cache, bridge, li))
    return result


def one_layer(model, L, h, tokens, cache, bridge, li) -> dict:
    """The three maps of latim layer L (transformers' layer li) and their scores."""
    import torch

    block = model.layers[L]
    mixer = block.mixer
    s = mixer.section
    b, length = tokens.shape
    mask = jnp.ones((b, length), bool)
    inter = mixer.intermediates(block.normed(h), mask=mask)
    f = layer_factors(model, h, L)
    M = np.asarray(f.m_tile(jnp.arange(length), 0, length), np.float64)

    # the public API's hidden attention ("signed": M averaged over the value heads) is the same map
    ha = latim_jax.attribute(model, tokens, method="hidden_attention", aggregation="signed", layers=[L])
    ha_check = rel(np.asarray(ha.scores)[:, 0], M.mean(1))

    # the conv's output before the L2 norm: what TransformerLens's hook_q / hook_k hold
    rep = s.v_heads // s.k_heads
    act = np.asarray(activation(s.activation)(inter.c), np.float64)
    kw = s.key_width
    q_raw = np.repeat(act[..., :kw].reshape(b, length, s.k_heads, s.k_dim), rep, axis=2)
    k_raw = np.repeat(act[..., kw : 2 * kw].reshape(b, length, s.k_heads, s.k_dim), rep, axis=2)
    g, beta = np.asarray(inter.g, np.float64), np.asarray(inter.beta, np.float64)
    ours = heuristic(q_raw, k_raw, g, beta)
    normalised = heuristic(l2n(q_raw) / np.sqrt(s.k_dim), l2n(k_raw), g, beta)

    W_out = np.asarray(mixer.out_proj[...], np.float64)
    G = np.asarray(inter.G, np.float64)  # (b, l, e): w_norm * SiLU(z) / rms_head(o), held
    layer = dict(latim_layer=L, transformers_layer=li, latim_hidden_attention_vs_mean_M_rel=ha_check)
    if cache is not None:
        pre = f"blocks.{li}.linear_attn"
        tl_map = bridge.blocks[li].linear_attn.compute_effective_attention(cache, li).double().numpy()
        v = cache[f"{pre}.hook_v"].double().numpy()
        o = cache[f"{pre}.hook_recurrence_out"].double().numpy()
        z = cache[f"{pre}.hook_gate_input"].float()
        y = cache[f"{pre}.hook_out"].double().numpy()
        tl_q = cache[f"{pre}.hook_q"].double().numpy()
        layer["cross_checks"] = dict(
            our_formula_vs_tl_function_rel=rel(ours, tl_map),
            hook_q_vs_latim_prenorm_q_rel=rel(np.repeat(tl_q, rep, axis=2), q_raw),
            hook_v_vs_latim_v_rel=rel(v, inter.v),
            hook_recurrence_out_vs_latim_o_rel=rel(o, inter.o),
            hook_linear_attn_out_vs_latim_mixer_rel=rel(y, mixer.output(inter)),
            latim_M_times_hook_v_vs_hook_recurrence_out_rel=rel(np.einsum("bhtj,bjhv->bthv", M, v), o),
        )

        def mixer_out(o_hat, held: bool):
            if held:
                return (o_hat.reshape(b, length, -1) * G) @ W_out
            hf_mixer = bridge.blocks[li].linear_attn.original_component
            with torch.no_grad():
                n = hf_mixer.norm(
                    torch.as_tensor(o_hat, dtype=torch.float32).reshape(-1, s.v_dim), z.reshape(-1, s.v_dim)
                )
                return hf_mixer.out_proj(n.reshape(b, length, -1)).double().numpy()
    else:
        tl_map = ours
        v, o = np.asarray(inter.v, np.float64), np.asarray(inter.o, np.float64)
        y = np.asarray(mixer.output(inter), np.float64)

        def mixer_out(o_hat, held: bool):
            gate = G if held else np.asarray(mixer.gate(jnp.asarray(o_hat, jnp.float32), inter.z), np.float64)
            return (o_hat.reshape(b, length, -1) * gate) @ W_out

    qn, kn = np.linalg.norm(q_raw, axis=-1), np.linalg.norm(k_raw, axis=-1)
    layer["prenorm_norms"] = dict(
        q_mean=float(qn.mean()), q_min=float(qn.min()), q_max=float(qn.max()),
        k_mean=float(kn.mean()), k_min=float(kn.min()), k_max=float(kn.max()),
    )  # fmt: skip
    layer["maps"] = {}
    for name, A in zip(MAPS, (tl_map, normalised, M), strict=True):
        o_hat = np.einsum("bhtj,bjhv->bthv", A, v)
        layer["maps"][name] = dict(
            recurrence_out_rel_err=rel(o_hat, o),
            mixer_out_rel_err_norm_held=rel(mixer_out(o_hat, True), y),
            mixer_out_rel_err_norm_recomputed=rel(mixer_out(o_hat, False), y),
            **row_stats(A, M),
        )
    return layer


def markdown(r: dict) -> str:
    v = r["versions"]
    lines = [
        "# TransformerLens's Gated DeltaNet effective attention beside latim-jax's exact map",
        "",
        f"`{'PYTHONPATH=/tmp/tlpkgs ' if r['transformer_lens_used'] else ''}python "
        f"benchmarks/tl_effective_attention.py` ({r['prompts']} random prompts x {r['length']} tokens, token "
        f"seed {r['token_seed']}). Checkpoint: {r['checkpoint']}.",
        "",
        f"Versions: transformer-lens {v['transformer_lens']}, transformers {v['transformers']}, torch "
        f"{v['torch']}, jax {v['jax']}, latim-jax {v['latim_jax']}, Python {v['python']}.",
        "",
    ]
    if r["transformer_lens_used"]:
        lines += [
            "tl_effective_attention is TransformerLens's own "
            "`GatedDeltaNetBridge.compute_effective_attention` on its "
            "`run_with_cache(tokens, use_cache=False)` cache; o_t, v_j and the mixer output are "
            "TransformerLens's hooks (hook_recurrence_out, hook_v, hook_linear_attn_out). "
            "heuristic_normalised is OUR variant of its formula on the L2-normalised, scaled q and k.",
        ]
    else:
        lines += [
            "TransformerLens did not import here (" + str(r["transformer_lens_missing"]) + "): "
            "tl_effective_attention is OUR reimplementation of the formula its docstring gives, "
            "not its code.",
        ]
    lines += [
        "",
        "rel err: ||sum_j A[t, j] v_j - o_t|| / ||o_t|| over all targets, heads and channels; mixer out: "
        "the same through the gated RMSNorm and out_proj (held: its scale and gate at the forward's "
        "values; recomputed: the norm applied to the rebuilt o_t). Against M (causal entries, per value "
        "head; entries of M below 1e-6 max|M| left out of the rank and sign columns): Spearman per target "
        "row (signed; abs: of the magnitudes), top-1: same strongest source, max|A - M| / max|M|, diag: "
        "mean share of a row's |mass| on j = t, neg: share of negative entries, sign !=: off-diagonal "
        "entries whose sign differs from M's.",
    ]
    for variant, entry in r["variants"].items():
        lines += [
            "",
            f"## {variant}",
            "",
            entry["description"] + ". latim-jax's logits vs transformers': "
            f"{entry['latim_logits_vs_transformers_rel']:.1e} relative"
            + (
                f"; the bridge's: {entry['bridge_logits_vs_transformers_max_abs']:.1e} max abs."
                if "bridge_logits_vs_transformers_max_abs" in entry
                else "."
            ),
            "",
            "| layer | map | rel err o_t | mixer out, held | mixer out, recomputed | Spearman | Spearman abs "
            "| top-1 | max diff / max abs M | diag | neg | sign != |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for layer in entry["layers"]:
            for name, m in layer["maps"].items():
                lines.append(
                    f"| {layer['transformers_layer']} | {name} | {m['recurrence_out_rel_err']:.2e} | "
                    f"{m['mixer_out_rel_err_norm_held']:.2e} | "
                    f"{m['mixer_out_rel_err_norm_recomputed']:.2e} | "
                    f"{m['spearman_mean']:.3f} | {m['spearman_abs_mean']:.3f} | {m['top1_agreement']:.3f} | "
                    f"{m['max_abs_diff_rel']:.3f} | {m['diag_mass']:.3f} | {m['negative_fraction']:.3f} | "
                    f"{m['sign_disagreement_offdiag']:.3f} |"
                )
        lines += [
            "",
            "Pre-norm q / k norms (the scale of tl_effective_attention's map) and cross-checks:",
            "",
        ]
        for layer in entry["layers"]:
            n = layer["prenorm_norms"]
            lines.append(
                f"- layer {layer['transformers_layer']} (latim layer {layer['latim_layer']}): |q| "
                f"{n['q_min']:.3f}..{n['q_max']:.3f} (mean {n['q_mean']:.3f}), |k| {n['k_min']:.3f}.."
                f"{n['k_max']:.3f} (mean {n['k_mean']:.3f}); latim's hidden_attention (signed) = M averaged "
                f"over heads to {layer['latim_hidden_attention_vs_mean_M_rel']:.1e}"
            )
            for k, val in layer.get("cross_checks", {}).items():
                lines.append(f"  - {k}: {val:.1e}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse(argv)
    r = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
