"""Reading a Gated DeltaNet sublayer's tensors into latim-jax's "gdn" layout
(:mod:`latim_jax.model.delta_rule`): in_proj [q | k | v | z], ba_proj [b | a], conv_w (K, m), ...

Qwen3-Next stores q, k, v and z interleaved per key head in one matrix (``in_proj_qkvz``: for each key
head, its q (k rows), k (k rows), then the v (rep v rows) and z (rep v rows) of the rep = H / Hk value
heads it serves), and b, a likewise (``in_proj_ba``: per key head, rep b rows then rep a rows).
"""

from __future__ import annotations

import numpy as np

from .errors import CheckpointError


def _expect(name: str, array, shape: tuple[int, ...], file: str) -> np.ndarray:
    array = np.asarray(array)
    if array.shape != shape:
        raise CheckpointError(f"{file}: tensor {name!r} has shape {array.shape}; expected {shape}")
    return array


def qkvz_rows(section) -> np.ndarray:
    """The rows of Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, rep v, rep z) in latim-jax's order
    [q | k | v | z] (value head h = key head h // rep, slot h % rep): in_proj^T = qkvz[qkvz_rows(s)]."""
    Hk, dk, dv = section.k_heads, section.k_dim, section.v_dim
    rep = section.v_heads // Hk
    per = 2 * dk + 2 * rep * dv
    base = np.arange(Hk)[:, None] * per
    parts = [(0, dk), (dk, dk), (2 * dk, rep * dv), (2 * dk + rep * dv, rep * dv)]
    return np.concatenate([(base + start + np.arange(n)[None]).reshape(-1) for start, n in parts])


def ba_rows(section) -> np.ndarray:
    """The rows of Qwen3-Next's ``in_proj_ba`` (per key head: rep b, rep a) in the order [b | a]."""
    rep = section.v_heads // section.k_heads
    base = np.arange(section.k_heads)[:, None] * 2 * rep
    return np.concatenate(
        [(base + np.arange(rep)[None]).reshape(-1), (base + rep + np.arange(rep)[None]).reshape(-1)]
    )


def gated_query_rows(heads: int, head_dim: int) -> np.ndarray:
    """The rows of a gated attention's ``q_proj`` (per head: a query rows, then a gate rows) in the order
    [every query | every gate], so that its first half is q_proj and its second the output gate's."""
    base = np.arange(heads)[:, None] * 2 * head_dim
    q = (base + np.arange(head_dim)[None]).reshape(-1)
    return np.concatenate([q, q + head_dim])


def qwen3_next_gdn(tensors: dict, section, d_model: int, file: str = "checkpoint") -> dict:
    """latim-jax gdn parameters from Qwen3-Next's ``linear_attn`` tensors, read eagerly (the checkpoint
    reader does the same through :func:`qkvz_rows` / :func:`ba_rows` on its lazy tensors). Torch
    orientation, keys relative to the module: in_proj_qkvz.weight, in_proj_ba.weight, conv1d.weight,
    conv1d.bias (if any), dt_bias, A_log, norm.weight, out_proj.weight; ``section`` the kind's
    DeltaRuleConfig. A tensor of the wrong shape is a CheckpointError naming it, its shape and the
    expected one."""
    s, d = section, d_model
    Hk, dk, dv = s.k_heads, s.k_dim, s.v_dim
    rep = s.v_heads // Hk
    per = 2 * dk + 2 * rep * dv
    qkvz = _expect("in_proj_qkvz.weight", tensors["in_proj_qkvz.weight"], (Hk * per, d), file)
    qkvz = qkvz.reshape(Hk, per, d)
    q, k = qkvz[:, :dk], qkvz[:, dk : 2 * dk]
    v, z = qkvz[:, 2 * dk : 2 * dk + rep * dv], qkvz[:, 2 * dk + rep * dv :]
    in_proj = np.concatenate([x.reshape(-1, d) for x in (q, k, v, z)], axis=0).T
    ba = _expect("in_proj_ba.weight", tensors["in_proj_ba.weight"], (Hk * 2 * rep, d), file).reshape(
        Hk, 2 * rep, d
    )
    ba_proj = np.concatenate([ba[:, :rep].reshape(-1, d), ba[:, rep:].reshape(-1, d)], axis=0).T
    m = s.conv_width
    conv = _expect("conv1d.weight", tensors["conv1d.weight"], (m, 1, s.conv), file)
    out = {
        "in_proj": in_proj,
        "ba_proj": ba_proj,
        "conv_w": conv[:, 0, :].T,
        "dt_bias": _expect("dt_bias", tensors["dt_bias"], (s.v_heads,), file),
        "A_log": _expect("A_log", tensors["A_log"], (s.v_heads,), file),
        "norm_w": _expect("norm.weight", tensors["norm.weight"], (dv,), file),
        "out_proj": _expect("out_proj.weight", tensors["out_proj.weight"], (d, s.value_width), file).T,
    }
    if s.conv_bias:
        out["conv_b"] = _expect("conv1d.bias", tensors["conv1d.bias"], (m,), file)
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def kimi_kda(tensors: dict, section, d_model: int, file: str = "checkpoint") -> dict:
    """latim-jax kda parameters from Kimi Linear's ``self_attn`` delta-attention tensors, read eagerly
    (torch orientation, keys relative to the module: q_proj, k_proj, v_proj, conv1d, forget_gate.f_a_proj,
    forget_gate.f_b_proj, forget_gate.dt_bias, forget_gate.A_log, b_proj, g_a_proj, g_b_proj,
    o_norm.weight, o_proj). A tensor of the wrong shape is a CheckpointError naming it."""
    s, d = section, d_model
    H, k = s.k_heads, s.k_dim
    e = s.value_width

    def get(name, shape):
        return _expect(name, tensors[name], shape, file)

    q, kk, v = (get(f"{p}_proj.weight", (H * k, d)) for p in "qkv")
    out = {
        "in_proj": np.concatenate([q, kk, v], axis=0).T,
        "conv_w": get("conv1d.weight", (s.conv_width, 1, s.conv))[:, 0, :].T,
        "decay_a": get("forget_gate.f_a_proj.weight", (k, d)).T,
        "decay_b": get("forget_gate.f_b_proj.weight", (H * k, k)).T,
        "dt_bias": get("forget_gate.dt_bias", (H * k,)),
        "A_log": get("forget_gate.A_log", (1, 1, H, 1)).reshape(H),
        "b_proj": get("b_proj.weight", (H, d)).T,
        "gate_a": get("g_a_proj.weight", (k, d)).T,
        "gate_b": get("g_b_proj.weight", (e, k)).T,
        "norm_w": get("o_norm.weight", (s.v_dim,)),
        "out_proj": get("o_proj.weight", (d, e)).T,
    }
    return {name: np.ascontiguousarray(x) for name, x in out.items()}
