"""LaTIM the PyTorch way: a fair, materialising baseline to measure latim-jax against.

Written as the published tools compute LaTIM, on a transformers ``MambaForCausalLM`` /
``Mamba2ForCausalLM``: channel-first tensors, and for each layer

    1. the layer's input h, mixer input xhat and mixer output o, read by forward hooks during one
       transformers forward; u, z, the conv pre-activation c, Delta, B, C recomputed from xhat with the
       module's own weights;
    2. the hidden attention M (b, e, l, l) materialised per channel (Mamba-2: per head, broadcast to
       its channels), decays from a cumulative sum of Delta: exp(A (S_i - S_t));
    3. the conv-corrected weights W_{i,j} = sum_k M_{i,j+k} a_k[j], then V = G_i * W (b, e, l, l);
    4. the contribution tensor T = W_out @ V, (b, d, l, l) (the full square, upper half zeros);
    5. the score, a reduction of T over d (hidden attention: an aggregation of M over channels).

Batched einsums/matmuls and in-place tensor ops throughout; no Python loop over positions (only over
layers, conv taps and, for Mamba-1's per-channel decay, the n state entries, which keeps the
exponential at (b, e, l, l) instead of (b, e, l, l, n)). fp32.

Conventions are the library's (docs/method.md sections 2-5 and 7, latim_jax/latim/mamba.py, scores.py):
  exact:  a_k[j] = w_k s_{j+k} u_j with s = act(c)/c from the full pre-activation (sigmoid for SiLU),
          u without the in_proj bias (conv bias and in_proj bias belong to no token);
  paper:  a_k[j] = f(w_k u_j + [k=0] b_conv) (the published additive approximation, u with its bias);
  G_i = SiLU(z_i) (Mamba-1), w_norm * SiLU(z_i) / rms_group(y_i * SiLU(z_i)) (Mamba-2, grouped gated
  RMSNorm, y the scan output with the D term);
  l2 ||T_ij||_2; alti max(0, ||hout_i||_1 - ||hout_i - T_ij - [i=j] h_i||_1), hout = h + o, rows
  normalised, a row with no positive entry one-hot on j = i; logit T_ij . (g_f * E_{w_i} / r_i) with
  w_i the model's prediction at i; hidden_attention: M without D, aggregated over channels (Mamba-1)
  or heads (Mamba-2) by "minmax" ((M - min) / (max - min) over the layer's causal entries, then the
  mean), "abs" (mean of |M|) or "signed" (mean of M). Every score is exactly 0 above the diagonal.

"fair" (the default) is PyTorch written as fast as plain PyTorch allows: ``torch.set_flush_denormal``
on (XLA flushes denormals already) and the decay exponent clamped at -80 before exp (torch's exp is
5-30x slower where its result is denormal; exp(-80) = 1.8e-35 changes no fp32 score). "plain" is the
same code with neither setting.

    scores = attribute(hf_model, ids, "l2", mode="exact", fair=True)   # (b, n_layers, l, l)
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

METHODS = ("l2", "alti", "logit", "hidden_attention")
MODES = ("exact", "paper")
AGGREGATIONS = ("minmax", "abs", "signed")
CLAMP = -80.0  # the fair variant's floor on the decay exponent


@dataclasses.dataclass(frozen=True)
class Options:
    """How to compute: decomposition mode, fair (flush denormals + clamp) or plain, hidden-attention
    aggregation."""

    mode: str = "exact"
    fair: bool = True
    aggregation: str = "minmax"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, found {self.mode!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, found {self.aggregation!r}")


@dataclasses.dataclass
class Captured:
    """One transformers forward: per layer the block input h, mixer input xhat and mixer output o
    (each (b, l, d)), the stream entering the final norm and the logits."""

    h: list
    xhat: list
    o: list
    h_final: torch.Tensor
    logits: torch.Tensor


@dataclasses.dataclass
class LayerValues:
    """What one mixer computed, channel-first (c = e channels or h heads; see module docstring).

    u: (b, e, l) value input with the in_proj bias; z: (b, e, l) the gate branch; u_bias: (e,) or None;
    c: (b, e, l) conv pre-activation of the value channels; w: (e, k) conv taps in lag order (w[:, k]
    multiplies u_{t-k});
    conv_b: (e,) or None; G: (b, e, l) output multiplier; delta: (b, c, l); A: (e, n) or (h,); D: (c,);
    B, C: (b, n, l) Mamba-1 / (b, g, n, l) Mamba-2; W_out: (d, e); heads: h (Mamba-2) or None.
    """

    u: torch.Tensor
    z: torch.Tensor
    u_bias: torch.Tensor | None
    c: torch.Tensor
    w: torch.Tensor
    conv_b: torch.Tensor | None
    G: torch.Tensor | None
    delta: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    W_out: torch.Tensor
    heads: int | None


@contextlib.contextmanager
def numerics(fair: bool):
    """Flush denormals for the fair variant (restored to torch's default, off, afterwards)."""
    torch.set_flush_denormal(fair)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def capture(model, ids) -> Captured:
    """Run the transformers model once with hooks on every block, mixer and the final norm."""
    h, xhat, o, final = [], [], [], []
    hooks = []

    def first(args, kwargs):
        return args[0] if args else kwargs["hidden_states"]

    def block_in(module, args, kwargs):  # hooks return None: they observe, never replace
        h.append(first(args, kwargs))

    def mixer_io(module, args, kwargs, out):
        xhat.append(first(args, kwargs))
        o.append(out)

    def final_in(module, args):
        final.append(args[0])

    for block in model.backbone.layers:
        hooks.append(block.register_forward_pre_hook(block_in, with_kwargs=True))
        hooks.append(block.mixer.register_forward_hook(mixer_io, with_kwargs=True))
    hooks.append(model.backbone.norm_f.register_forward_pre_hook(final_in))
    try:
        logits = model(ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    return Captured(h=h, xhat=xhat, o=o, h_final=final[0], logits=logits)


def _gate(act: str, c):
    """s = act(c) / c: sigmoid (SiLU), [c > 0] (ReLU), 1 (identity)."""
    if act == "silu":
        return torch.sigmoid(c)
    if act == "relu":
        return (c > 0).to(c.dtype)
    if act in ("linear", "identity"):
        return torch.ones_like(c)
    raise ValueError(f"no exact gate for activation {act!r}")


def layer_values(mixer, xhat) -> LayerValues:
    """Recompute one mixer's quantities from its input xhat (b, l, d) with the module's weights."""
    L = xhat.shape[1]
    conv = mixer.conv1d
    if not hasattr(mixer, "dt_bias"):  # Mamba-1
        u, z = mixer.in_proj(xhat).transpose(1, 2).chunk(2, dim=1)  # (b, e, l) each
        e = u.shape[1]
        c = conv(u)[..., :L]
        v = mixer.act(c)
        r, n = mixer.time_step_rank, mixer.ssm_state_size
        dt, B, C = torch.split(mixer.x_proj(v.transpose(1, 2)), [r, n, n], dim=-1)
        delta = F.softplus(mixer.dt_proj(dt)).transpose(1, 2)  # (b, e, l)
        bias_in = mixer.in_proj.bias
        return LayerValues(
            u=u,
            z=z,
            u_bias=None if bias_in is None else bias_in[:e],
            c=c,
            w=conv.weight[:, 0].flip(-1),
            conv_b=conv.bias,
            G=F.silu(z),
            delta=delta,
            A=-torch.exp(mixer.A_log.float()),
            D=mixer.D.float(),
            B=B.transpose(1, 2),
            C=C.transpose(1, 2),
            W_out=mixer.out_proj.weight,
            heads=None,
        )
    e, h, g, n = mixer.intermediate_size, mixer.num_heads, mixer.n_groups, mixer.ssm_state_size
    z, xbc, dt = mixer.in_proj(xhat).split([e, mixer.conv_dim, h], dim=-1)
    xbc = xbc.transpose(1, 2)  # (b, e + 2gn, l)
    c_all = conv(xbc)[..., :L]
    B, C = mixer.act(c_all[:, e:]).split([g * n, g * n], dim=1)
    lo, hi = mixer.time_step_limit
    delta = F.softplus(dt + mixer.dt_bias).clamp(lo, hi).transpose(1, 2)  # (b, h, l)
    bias_in = mixer.in_proj.bias
    return LayerValues(
        u=xbc[:, :e],
        z=z.transpose(1, 2),
        u_bias=None if bias_in is None else bias_in[e : 2 * e],
        c=c_all[:, :e],
        w=conv.weight[:e, 0].flip(-1),
        conv_b=None if conv.bias is None else conv.bias[:e],
        G=None,  # needs the scan output y: mamba2_gate builds it from M
        delta=delta,
        A=-torch.exp(mixer.A_log.float()),
        D=mixer.D.float(),
        B=B.reshape(B.shape[0], g, n, L),
        C=C.reshape(C.shape[0], g, n, L),
        W_out=mixer.out_proj.weight,
        heads=h,
    )


def hidden_attention(lv: LayerValues, fair: bool, *, with_D: bool = True):
    """M_{i,t} channel-first: (b, e, l, l) Mamba-1, (b, h, l, l) Mamba-2; exactly 0 for t > i."""
    L = lv.delta.shape[-1]
    S = torch.cumsum(lv.delta.double(), -1).float()  # (b, c, l): S_t = sum_{k<=t} Delta_k
    seg = S[..., :, None] - S[..., None, :]  # (b, c, l, l): S_i - S_t
    upper = torch.ones(L, L, dtype=torch.bool).triu_(1)
    seg.masked_fill_(upper, float("inf"))  # A * inf = -inf: exp gives 0 above the diagonal
    causal = (~upper).float()
    if lv.heads is None:  # Mamba-1: M[e] = sum_n C_i[n] B_t[n] exp(A[e, n] (S_i - S_t)) Delta_t[e]
        M = torch.zeros_like(seg)
        tmp = torch.empty_like(seg)
        for k in range(lv.A.shape[1]):
            torch.mul(seg, lv.A[:, k, None, None], out=tmp)
            if fair:
                tmp.clamp_(min=CLAMP)
            tmp.exp_()
            cb = lv.C[:, k, :, None] * lv.B[:, k, None, :] * causal  # (b, l, l): C_i[n] B_t[n], t <= i
            M.addcmul_(tmp, cb[:, None])
        del tmp, seg
    else:  # Mamba-2: M[h] = (C_i . B_t)[g(h)] exp(A[h] (S_i - S_t)) Delta_t[h]
        expo = seg.mul_(lv.A[:, None, None])
        if fair:
            expo.clamp_(min=CLAMP)
        cb = torch.einsum("bgni,bgnt->bgit", lv.C, lv.B) * causal  # (b, g, l, l)
        cb = cb.repeat_interleave(lv.heads // lv.C.shape[1], dim=1)  # head h reads group h // (h/g)
        M = expo.exp_().mul_(cb)
    M.mul_(lv.delta[:, :, None, :])
    if with_D:
        M.diagonal(dim1=-2, dim2=-1).add_(lv.D[:, None])
    return M


def _per_channel(M, lv: LayerValues):
    """View M so it broadcasts against per-channel (b, e, ...) tensors: Mamba-2 (b, h, 1, l, l)."""
    return M if lv.heads is None else M[:, :, None]


def _channels(x, lv: LayerValues):
    """(b, e, ...) -> (b, h, p, ...) for Mamba-2 (unchanged for Mamba-1)."""
    return x if lv.heads is None else x.reshape(x.shape[0], lv.heads, -1, *x.shape[2:])


def tap_values(lv: LayerValues, act, mode: str):
    """a_k (b, e, l) for each conv tap k: exact w_k s_{j+k} u_j; paper f(w_k u_j + [k=0] b_conv)."""
    K, L = lv.w.shape[1], lv.u.shape[-1]
    if mode == "exact":
        s = _gate(act, lv.c)
        u = lv.u if lv.u_bias is None else lv.u - lv.u_bias[:, None]
        s_pad = F.pad(s, (0, K - 1))
        return [lv.w[:, k, None] * s_pad[..., k : k + L] * u for k in range(K)]
    fn = {"silu": F.silu, "relu": F.relu}.get(act, lambda x: x)
    out = []
    for k in range(K):
        pre = lv.w[:, k, None] * lv.u
        if k == 0 and lv.conv_b is not None:
            pre = pre + lv.conv_b[:, None]
        out.append(fn(pre))
    return out


def mamba2_gate(M, lv: LayerValues, mixer):
    """G = w_norm * SiLU(z) / rms_group(y * SiLU(z)), y = the scan output (D term included), (b, e, l)."""
    b, e, L = lv.u.shape
    v = mixer.act(lv.c)  # the value channels after the activation
    y = torch.matmul(M, _channels(v, lv).transpose(-1, -2))  # (b, h, l, p): y_i = sum_t M_it v_t
    y = y.permute(0, 1, 3, 2).reshape(b, e, L)
    gz = F.silu(lv.z)
    q = (y * gz).reshape(b, mixer.n_groups, -1, L)
    rms = torch.sqrt(q.pow(2).mean(2, keepdim=True) + mixer.norm.variance_epsilon)
    return mixer.norm.weight[None, :, None] * gz / rms.expand_as(q).reshape(b, e, L)


def conv_weights(M, lv: LayerValues, a):
    """W (b, e, l, l): W_ij = sum_k M_{i,j+k} a_k[j] (M_{i,t} = 0 for t > i), one pass per conv tap."""
    b, e, L = lv.u.shape
    W = torch.zeros(b, e, L, L)
    Wc, Mc = _channels(W, lv), _per_channel(M, lv)
    for k, a_k in enumerate(a):
        Wc[..., : L - k].addcmul_(Mc[..., k:], _channels(a_k, lv)[..., None, : L - k])
    return W


def project(V, lv: LayerValues):
    """T (b, d, l, l) = W_out @ V for V (b, e, l, l): one (d, e) x (e, l*l) matmul per prompt."""
    b, e, L, _ = V.shape
    return torch.matmul(lv.W_out, V.view(b, e, L * L)).view(b, -1, L, L)


def contributions(mixer, xhat, options: Options):
    """T (b, d, l, l) channel-first: T[:, :, i, j] = T_i(x_j), zero for j > i."""
    lv = layer_values(mixer, xhat)
    M = hidden_attention(lv, options.fair)
    G = lv.G if lv.heads is None else mamba2_gate(M, lv, mixer)
    W = conv_weights(M, lv, tap_values(lv, mixer.activation, options.mode))
    del M
    return project(W.mul_(G[..., None]), lv)  # V_ij = G_i * W_ij, then T = W_out V


def aggregate(M, how: str):
    """One (b, l, l) map from M (b, c, l, l) (no D term): minmax, abs or signed channel mean."""
    if how == "signed":
        return M.mean(1)
    if how == "abs":
        return M.abs_().mean(1)
    L = M.shape[-1]
    upper = torch.ones(L, L, dtype=torch.bool).triu_(1)
    mn = M.masked_fill_(upper, float("inf")).amin((1, 2, 3), keepdim=True)
    mx = M.masked_fill_(upper, -float("inf")).amax((1, 2, 3), keepdim=True)
    span = torch.where(mx > mn, mx - mn, torch.ones_like(mx))
    return M.sub_(mn).div_(span).masked_fill_(upper, 0.0).mean(1)


def layer_scores(
    mixer, h, xhat, o, method: str, options: Options = Options(), direction=None, *, normalise=True
):
    """Scores (b, l, l) of one layer from its block input h, mixer input xhat and output o (b, l, d).

    ``direction`` (b, l, d): the logit direction g_f * E_{w_i} / r_i (method "logit" only).
    ``normalise=False``: alti's unnormalised c_ij (for error analysis).
    """
    if method == "hidden_attention":
        M = hidden_attention(layer_values(mixer, xhat), options.fair, with_D=False)
        return aggregate(M, options.aggregation)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    T = contributions(mixer, xhat, options)  # (b, d, l, l)
    L = T.shape[-1]
    if method == "l2":
        return torch.linalg.vector_norm(T, dim=1)
    if method == "logit":
        return T.mul_(direction.transpose(1, 2)[..., None]).sum(1)
    hout = (h + o).transpose(1, 2)  # (b, d, l); the bias terms are part of o
    full = hout.abs().sum(1)[..., None]  # (b, l, 1): ||hout_i||_1
    X = T.neg_().add_(hout[..., None])  # hout_i - T_ij
    X.diagonal(dim1=-2, dim2=-1).sub_(h.transpose(1, 2))  # ... - [i=j] h_i
    s = (full - X.abs_().sum(1)).clamp_(min=0.0).tril_()
    if not normalise:
        return s
    total = s.sum(-1, keepdim=True)
    eye = torch.eye(L, dtype=s.dtype).expand_as(s)
    return torch.where(total > 0, s / torch.where(total > 0, total, torch.ones_like(total)), eye)


def logit_direction(model, captured: Captured, target=None):
    """v_i = g_f * E_{w_i} / r_i (b, l, d), r_i the final norm's rms; w_i = ``target`` (int ids (b, l))
    or, by default, the model's prediction argmax logits_i."""
    norm = model.backbone.norm_f
    hf = captured.h_final.float()
    r_inv = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    target = captured.logits.argmax(-1) if target is None else target
    return norm.weight * model.get_output_embeddings().weight[target] * r_inv


def attribute(
    model, ids, method: str, mode: str = "exact", layers=None, *, target=None, fair=True, aggregation="minmax"
):
    """Scores (b, n_layers, l, l) for int ids (b, l), every layer (or ``layers``), fp32 torch tensor.

    ``target``: the logit method's vocabulary entries (int ids (b, l)); default the model's prediction.
    """
    options = Options(mode=mode, fair=fair, aggregation=aggregation)
    n = len(model.backbone.layers)
    layers = range(n) if layers is None else [x % n for x in layers]
    with numerics(fair), torch.inference_mode():
        cap = capture(model, ids)
        direction = logit_direction(model, cap, target) if method == "logit" else None
        out = [
            layer_scores(
                model.backbone.layers[i].mixer, cap.h[i], cap.xhat[i], cap.o[i], method, options, direction
            )
            for i in layers
        ]
    return torch.stack(out, 1)
