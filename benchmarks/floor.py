"""The floor: the least arithmetic and memory traffic a configuration needs, and how close a time is.

Per layer and prompt, with P = number of causal (target, source) pairs (L(L+1)/2 for every row; the sum
of i + 1 over the requested rows otherwise), e inner width, d model width, n state, h heads, g groups:

    l2 / l1 / alti   P * e * d multiply-adds: T_i(x_j) = V_ij @ W_out over the causal half (the matmul);
    logit            P * e   (the direction folds into W_out first: no projection)
    hidden_attention P * e * n (Mamba-1: the n-sum per channel) / P * g * n (Mamba-2: C_i . B_t)
    decay exponentials, every method: P * e * n (Mamba-1, per channel and state) / P * h (Mamba-2)
    bytes: the scores written (4 * rows * L) + W_out read (4 e d) + the per-token factors read
           (4 * L * (e (k + 2) + 2 c + 2 g n), c = e or h)

plus, for a whole model, the forward: 2 * L * (mixer and head parameters) flops. The floor time is
2 * multiply-adds / (the measured fp32 matmul rate) + exponentials / (the measured exp rate): a time
no implementation on this machine beats without changing the arithmetic. ``fraction`` = floor / measured.
"""

from __future__ import annotations

from shapes import dims

PROJECTED = ("l2", "l1", "alti")


def pairs(length: int, rows=None) -> int:
    """Causal pairs (i, j <= i) over the requested rows (all rows: L(L+1)/2)."""
    if rows is None:
        return length * (length + 1) // 2
    return sum((r % length) + 1 for r in rows)


def layer_work(shape: dict, method: str, length: int, rows=None) -> dict:
    """Multiply-adds, exponentials and bytes of one layer for one prompt."""
    m = dims(shape)
    P = pairs(length, rows)
    v1 = shape["version"] == 1
    exps = P * m["e"] * m["n"] if v1 else P * m["h"]
    if method in PROJECTED:
        macs = P * m["e"] * m["d"]
    elif method == "logit":
        macs = P * m["e"]
    elif method == "hidden_attention":
        macs = P * m["e"] * m["n"] if v1 else P * m["g"] * m["n"]
    else:
        raise ValueError(f"no floor for method {method!r}")
    c = m["e"] if v1 else m["h"]
    n_rows = length if rows is None else len(rows)
    factors = 4 * length * (m["e"] * (m["k"] + 2) + 2 * c + 2 * m["g"] * m["n"])
    return {"macs": macs, "exps": exps, "bytes": 4 * n_rows * length + 4 * m["e"] * m["d"] + factors}


def forward_macs(shape: dict, length: int) -> int:
    """Multiply-adds of the model forward for one prompt (projections and head; the scan is O(L e n))."""
    m = dims(shape)
    e, d, n, h, g = m["e"], m["d"], m["n"], m["h"], m["g"]
    if shape["version"] == 1:
        r = -(-d // 16)
        per_layer = d * 2 * e + e * (r + 2 * n) + r * e + e * d + 2 * e * n
    else:
        per_layer = d * (2 * e + 2 * g * n + h) + e * d + 2 * e * n
    return length * (m["layers"] * per_layer + d * m["vocab"])


def work(shape: dict, method: str, length: int, *, batch: int = 1, rows=None, layers=None) -> dict:
    """Work of ``attribute`` on ``batch`` prompts over ``layers`` layers (default: all of the shape),
    the forward included. ``projection_macs`` is the matmul part alone."""
    n_layers = shape["n_layers"] if layers is None else layers
    lw = layer_work(shape, method, length, rows)
    fwd = forward_macs(shape, length)
    macs = n_layers * lw["macs"] + fwd
    return {
        "macs": batch * macs,
        "projection_macs": batch * n_layers * lw["macs"] if method in PROJECTED else 0,
        "exps": batch * n_layers * lw["exps"],
        "bytes": batch * n_layers * lw["bytes"],
        "arithmetic_intensity": 2 * macs / max(n_layers * lw["bytes"], 1),
    }


def floor_seconds(w: dict, matmul_gflops: float | None, gexp_per_s: float | None) -> float | None:
    """2 * macs / matmul rate + exps / exp rate; None without both rates."""
    if not matmul_gflops or not gexp_per_s:
        return None
    return 2 * w["macs"] / (matmul_gflops * 1e9) + w["exps"] / (gexp_per_s * 1e9)


def fractions(w: dict, seconds: float | None, matmul_gflops, gexp_per_s) -> dict:
    """floor / measured time, and the projection's achieved share of the matmul rate."""
    floor = floor_seconds(w, matmul_gflops, gexp_per_s)
    if not seconds or floor is None:
        return {"floor_s": floor, "floor_fraction": None, "matmul_fraction": None}
    mm = 2 * w["projection_macs"] / seconds / (matmul_gflops * 1e9) if w["projection_macs"] else None
    return {"floor_s": floor, "floor_fraction": floor / seconds, "matmul_fraction": mm}


def best_rates(*measured: dict) -> dict:
    """Per rate, the highest of several measurements (start and end of a job on a shared machine:
    the floor is the least time, so it takes the fastest rate observed)."""
    keys = {k for m in measured for k in m}
    return {k: max((m[k] for m in measured if m.get(k)), default=None) for k in sorted(keys)}


def refloor(obj, rates: dict) -> None:
    """Recompute the floor fractions of every record in ``obj`` (nested dicts/lists) that holds ``work``
    and ``impl``, with ``rates`` (time: the median, else the first call)."""
    if isinstance(obj, list):
        for x in obj:
            refloor(x, rates)
        return
    if not isinstance(obj, dict):
        return
    if "work" in obj and "impl" in obj:
        lib = "jax" if obj["impl"] == "latim-jax" else "torch"
        t = obj.get("median_s") or obj.get("first_s")
        mm, ex = rates.get(f"matmul_{lib}_float32_gflops"), rates.get(f"exp_{lib}_gexp_per_s")
        obj.update(fractions(obj["work"], t, mm, ex))
    for v in obj.values():
        if isinstance(v, dict | list):
            refloor(v, rates)
