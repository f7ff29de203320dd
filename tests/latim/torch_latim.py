"""An independent, plainly written PyTorch LaTIM (float64, explicit loops, everything materialised).

It reads each layer's input and mixer output from a transformers model through forward hooks and
rebuilds the decomposition from the module's own weights, following docs/method.md literally. It
shares no code with latim_jax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def capture(model, ids):
    """Run the transformers model; return per-layer (block input h, mixer input xhat, mixer output o),
    the stream entering the final norm, and the logits."""
    seen = []
    hooks = []
    for block in model.backbone.layers:
        rec = {}
        seen.append(rec)
        hooks.append(
            block.register_forward_pre_hook(lambda m, a, rec=rec: rec.__setitem__("h", a[0].detach()))
        )
        hooks.append(
            block.mixer.register_forward_hook(
                lambda m, a, o, rec=rec: rec.update(xhat=a[0].detach(), o=o.detach())
            )
        )
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    return seen, out.hidden_states[-2].detach(), out.logits.detach()


def _conv(u, weight, bias):
    """c[t] = b + sum_k weight[:, 0, k] * u[t - K + 1 + k] (zeros before the start). u (L, C)."""
    L, K = u.shape[0], weight.shape[-1]
    c = torch.zeros_like(u) + (0 if bias is None else bias)
    for t in range(L):
        for k in range(K):
            src = t - K + 1 + k
            if src >= 0:
                c[t] += weight[:, 0, k] * u[src]
    return c


def _gate(act, c):
    return {"silu": torch.sigmoid(c), "relu": (c > 0).double(), "identity": torch.ones_like(c)}[act]


def _act(act, c):
    return {"silu": F.silu(c), "relu": F.relu(c), "identity": c}[act]


def decompose_layer(mixer, xhat, act=None, mode="exact"):
    """T (L, L, d), bias (L, d), output (L, d) for one prompt's mixer input xhat (L, d), float64.

    act: the post-conv activation; default the mixer's own (transformers' ``hidden_act``)."""
    act = act or mixer.activation
    d64 = lambda t: None if t is None else t.detach().double()  # noqa: E731
    x = xhat.double()
    W_in, W_out = d64(mixer.in_proj.weight), d64(mixer.out_proj.weight)
    b_in, b_out = d64(mixer.in_proj.bias), d64(mixer.out_proj.bias)
    conv_w, conv_b = d64(mixer.conv1d.weight), d64(mixer.conv1d.bias)
    K = conv_w.shape[-1]
    proj = x @ W_in.T + (0 if b_in is None else b_in)
    L = x.shape[0]
    mamba2 = hasattr(mixer, "dt_bias")
    if not mamba2:
        e = W_in.shape[0] // 2
        u_full, z = proj[:, :e], proj[:, e:]
        u_bias = None if b_in is None else b_in[:e]
        c = _conv(u_full, conv_w, conv_b)
        v = _act(act, c)
        R = mixer.time_step_rank
        N = mixer.ssm_state_size
        dbc = v @ d64(mixer.x_proj.weight).T
        dt, Bm, Cm = dbc[:, :R], dbc[:, R : R + N], dbc[:, R + N :]
        delta = F.softplus(dt @ d64(mixer.dt_proj.weight).T + d64(mixer.dt_proj.bias))  # (L, e)
        A = -torch.exp(d64(mixer.A_log))  # (e, N)
        M = torch.zeros(L, L, e, dtype=torch.float64)
        for i in range(L):
            for t in range(i + 1):
                seg = delta[t + 1 : i + 1].sum(0)  # (e,)
                M[i, t] = (Cm[i] * Bm[t] * torch.exp(A * seg[:, None])).sum(-1) * delta[t]
            M[i, i] += d64(mixer.D)
        G = F.silu(z)
        s = _gate(act, c)
        value_w, value_b = conv_w, conv_b
    else:
        e = mixer.intermediate_size
        H, P, Gn, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
        z = proj[:, :e]
        xbc = proj[:, e : e + e + 2 * Gn * N]
        dt = proj[:, e + e + 2 * Gn * N :]
        c_all = _conv(xbc, conv_w, conv_b)
        v_all = _act(act, c_all)
        Bm = v_all[:, e : e + Gn * N].reshape(L, Gn, N)
        Cm = v_all[:, e + Gn * N :].reshape(L, Gn, N)
        delta = F.softplus(dt + d64(mixer.dt_bias))  # (L, H)
        A = -torch.exp(d64(mixer.A_log))  # (H,)
        Mh = torch.zeros(L, L, H, dtype=torch.float64)
        for i in range(L):
            for t in range(i + 1):
                seg = delta[t + 1 : i + 1].sum(0)
                for h in range(H):
                    g = h // (H // Gn)
                    Mh[i, t, h] = (Cm[i, g] @ Bm[t, g]) * delta[t, h] * torch.exp(A[h] * seg[h])
            Mh[i, i] += d64(mixer.D)
        M = Mh.repeat_interleave(P, dim=-1)  # per channel
        c = c_all[:, :e]
        v = v_all[:, :e]
        u_full = xbc[:, :e]
        u_bias = None if b_in is None else b_in[e : 2 * e]
        y = torch.einsum("ite,te->ie", M, v)
        q = y * F.silu(z)
        rms = torch.sqrt(
            q.reshape(L, Gn, e // Gn).pow(2).mean(-1, keepdim=True) + mixer.norm.variance_epsilon
        )
        G = d64(mixer.norm.weight) * F.silu(z) / rms.expand(L, Gn, e // Gn).reshape(L, e)
        s = _gate(act, c)
        value_w = conv_w[:e]
        value_b = None if conv_b is None else conv_b[:e]
    u_tok = u_full if u_bias is None else u_full - u_bias
    T = torch.zeros(L, L, W_out.shape[0], dtype=torch.float64)
    bias = torch.zeros(L, W_out.shape[0], dtype=torch.float64) + (0 if b_out is None else b_out)
    for i in range(L):
        for j in range(i + 1):
            acc = torch.zeros(e, dtype=torch.float64)
            for t in range(j, min(i, j + K - 1) + 1):
                w = value_w[:, 0, K - 1 - (t - j)]
                if mode == "exact":
                    acc += M[i, t] * s[t] * w * u_tok[j]
                else:
                    extra = value_b if (t == j and value_b is not None) else 0.0
                    acc += M[i, t] * _act(act, w * u_full[j] + extra)
            T[i, j] = W_out @ (G[i] * acc)
        if mode == "exact":
            cb = torch.zeros(L, e, dtype=torch.float64)
            for t in range(L):
                cb[t] = 0 if value_b is None else value_b.clone()
                if u_bias is not None:
                    for lag in range(K):
                        if t - lag >= 0:
                            cb[t] += value_w[:, 0, K - 1 - lag] * u_bias
            bias[i] += W_out @ (G[i] * sum(M[i, t] * s[t] * cb[t] for t in range(i + 1)))
    out = torch.einsum("ite,te->ie", M, v) * G @ W_out.T + (0 if b_out is None else b_out)
    return T, bias, out


def hidden_attention(mixer, xhat, act=None, aggregation="minmax"):
    """Ali et al.'s hidden attention without the D term, aggregated over channels (Mamba-1) / heads
    (Mamba-2): "signed" = mean, "abs" = mean of |M|, "minmax" = (mean - min) / (max - min) with min and
    max over the whole per-channel tensor's causal entries. (L, L), float64."""
    M = channel_attention(mixer, xhat, act)  # (L, L, C), zero above the diagonal
    L = M.shape[0]
    if aggregation == "signed":
        return M.mean(-1)
    if aggregation == "abs":
        return M.abs().mean(-1)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    entries = M[causal]  # (pairs, C)
    lo, hi = entries.min(), entries.max()
    return torch.where(causal, (M.mean(-1) - lo) / (hi - lo), torch.zeros(L, L, dtype=torch.float64))


def channel_attention(mixer, xhat, act=None):
    """The per-channel (Mamba-1) / per-head (Mamba-2) hidden attention without D: (L, L, C), float64."""
    act = act or mixer.activation
    x = xhat.double()
    d64 = lambda t: t.detach().double()  # noqa: E731
    proj = x @ d64(mixer.in_proj.weight).T + (0 if mixer.in_proj.bias is None else d64(mixer.in_proj.bias))
    L = x.shape[0]
    if not hasattr(mixer, "dt_bias"):
        e = proj.shape[1] // 2
        v = _act(act, _conv(proj[:, :e], d64(mixer.conv1d.weight), d64(mixer.conv1d.bias)))
        R, N = mixer.time_step_rank, mixer.ssm_state_size
        dbc = v @ d64(mixer.x_proj.weight).T
        dt, Bm, Cm = dbc[:, :R], dbc[:, R : R + N], dbc[:, R + N :]
        delta = F.softplus(dt @ d64(mixer.dt_proj.weight).T + d64(mixer.dt_proj.bias))
        A = -torch.exp(d64(mixer.A_log))
        out = torch.zeros(L, L, e, dtype=torch.float64)
        for i in range(L):
            for t in range(i + 1):
                seg = delta[t + 1 : i + 1].sum(0)
                out[i, t] = (Cm[i] * Bm[t] * torch.exp(A * seg[:, None])).sum(-1) * delta[t]
        return out
    e = mixer.intermediate_size
    H, Gn, N = mixer.num_heads, mixer.n_groups, mixer.ssm_state_size
    xbc = proj[:, e : e + e + 2 * Gn * N]
    dt = proj[:, e + e + 2 * Gn * N :]
    v = _act(act, _conv(xbc, d64(mixer.conv1d.weight), d64(mixer.conv1d.bias)))
    Bm = v[:, e : e + Gn * N].reshape(L, Gn, N)
    Cm = v[:, e + Gn * N :].reshape(L, Gn, N)
    delta = F.softplus(dt + d64(mixer.dt_bias))
    A = -torch.exp(d64(mixer.A_log))
    out = torch.zeros(L, L, H, dtype=torch.float64)
    for i in range(L):
        for t in range(i + 1):
            seg = delta[t + 1 : i + 1].sum(0)
            for h in range(H):
                g = h // (H // Gn)
                out[i, t, h] = (Cm[i, g] @ Bm[t, g]) * delta[t, h] * torch.exp(A[h] * seg[h])
    return out


def rollout(maps, method, direct=None, alti=None):
    """Across-layer aggregation of per-layer maps (list of (L, L), float64), written out plainly:
    alti: R = C^n ... C^1; hidden_attention: the same product of (A + I) / rowsum; logit: input
    attribution sum_l C^l R^{l-1} (R^0 = I, R^l the alti rollout) plus ``direct`` on the diagonal."""
    L = maps[0].shape[0]
    eye = torch.eye(L, dtype=torch.float64)
    if method == "logit":
        total, R = torch.diag(direct), eye
        for c, a in zip(maps, alti, strict=True):
            total = total + c @ R
            R = a @ R
        return total
    R = eye
    for m in maps:
        if method == "hidden_attention":
            m = (m + eye) / (m + eye).sum(-1, keepdim=True)
        R = m @ R
    return R


def scores(T, h, o, method, direction=None):
    """l2 / l1 / alti / logit scores (L, L) from a materialised T (L, L, d), float64."""
    L = T.shape[0]
    if method == "l2":
        return T.norm(dim=-1)
    if method == "l1":
        return T.abs().sum(-1)
    if method == "logit":
        return torch.einsum("ijd,id->ij", T, direction)
    hout = h + o
    out = torch.zeros(L, L, dtype=torch.float64)
    for i in range(L):
        for j in range(i + 1):
            Tp = T[i, j] + (h[i] if i == j else 0)
            out[i, j] = max(0.0, float(hout[i].abs().sum() - (hout[i] - Tp).abs().sum()))
        if out[i].sum() > 0:
            out[i] /= out[i].sum()
        else:  # no positive score (the bias terms dominate): the library's convention is "all to self"
            out[i, i] = 1.0
    return out


def logit_direction(model, h_final, logits, b):
    """(L, d): the direction whose dot product with a position's stream gives its predicted token's
    logit, RMSNorm_f's scale held at the forward's values (prompt ``b``), float64."""
    target = logits[b].argmax(-1)
    r = torch.rsqrt(h_final[b].double().pow(2).mean(-1, keepdim=True) + model.config.layer_norm_epsilon)
    head = model.lm_head.weight.detach().double()
    return model.backbone.norm_f.weight.detach().double() * head[target] * r


def reference_maps(model, seen, h_final, logits, method, mode, aggregation=None):
    """Per prompt, per layer: the reference's (L, L) map of ``method``, from :func:`capture`'s records;
    plus, per prompt, the logit's direct (embedding) term (L,)."""
    maps, direct = [], []
    for b in range(seen[0]["h"].shape[0]):
        direction = logit_direction(model, h_final, logits, b)
        per_layer = []
        for layer, rec in enumerate(seen):
            mixer = model.backbone.layers[layer].mixer
            if method == "hidden_attention":
                per_layer.append(hidden_attention(mixer, rec["xhat"][b], aggregation=aggregation))
            else:
                T, _, o = decompose_layer(mixer, rec["xhat"][b], mode=mode)
                per_layer.append(scores(T, rec["h"][b].double(), o, method, direction))
        maps.append(per_layer)
        direct.append((seen[0]["h"][b].double() * direction).sum(-1))
    return maps, direct
