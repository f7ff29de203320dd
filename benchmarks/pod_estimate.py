"""The pod estimate (issue 43 item 3): one long prompt's forward (the logits) over a TPU v5p slice with
the length split over the mesh's "seq" axis and the channels over "model" (data = 1), for a 7B-shaped
Mamba-2 and a Nemotron-H-8B-shaped hybrid at L = 128k and 1M tokens, on v5p-64 and v5p-256.

    python benchmarks/pod_estimate.py        # writes benchmarks/results/pod_estimate.{json,md} (< 1 s)

Pure arithmetic: nothing is compiled, nothing runs. Per (model, L, slice, seq x model split) it gives

- memory per device: parameters (bf16; the Mamba layers' and the embedding / head's split over "model",
  attention and MLP weights whole on every device, as ``latim_jax.model.sharding.shard`` lays them out)
  + the logits output (fp32, L/seq x V/model) + the largest layer's working set. A working set has a
  part per local token (falls as 1/seq) and, for attention, a part over the whole length (the row tile
  of scores over every key and the gathered K/V), for Mamba-2 a few state summaries (the log-depth
  prefix holds its own, the one received and their composition). XLA reuses one layer's temporaries
  for the next, so the peak is the largest layer's, not a sum.
- bytes crossing devices per layer, what ``latim_jax.parallel.sequence`` moves: the conv halo (k-1
  rows of the conv input, one collective-permute), the log-depth prefix over the shards' (Delta sums,
  final state) summaries (ceil(log2 seq) collective-permutes of one summary, one more to shift it, and
  a psum of the last shard's state), attention's all-gather of K, V (2 L G a x 4 bytes) and
  the mask, and the Mamba out_proj all-reduce over "model" (the stream, L/seq x d x 4 bytes).
- time: compute-bound (FLOPs at an assumed MXU utilisation of the published bf16 peak), HBM-bound (the
  bytes a layer must at least write and read, at the published HBM bandwidth) and communication (the
  bytes above at an assumed per-device ring bandwidth derived from the published ICI figure, plus a
  per-step latency); a layer takes max(compute, HBM) + communication (no overlap assumed).

What is measured and what is assumed (``ASSUMPTIONS``, written into the results):

- Measured (``benchmarks/results/sequence_axis.json``, XLA:CPU compiled memory of 130m-wide 2-3 layer
  models at L = 32k over seq = 8): the temporaries per local token. ``calibrate`` divides them by a
  count of the fp32 arrays per token the layer makes (``mamba2_words``, ``attention_words``): the ratio
  (about 1.2) is how many copies XLA keeps beyond that count, applied to the large shapes. The per-device
  temporaries at seq = 8 were 0.12x one device's (1/8 = 0.125), which is what makes the per-token part
  fall as 1/seq. The attention calibration subtracts the whole-length part first (two fp32 (H, 256, L)
  row tiles, ``latim_jax.model.attention.attention_memory``, and the gathered K/V and mask). The
  measured collectives (the conv halo's and the prefix's collective-permutes per Mamba-2 layer;
  attention's K/V gather) fix which arrays cross; ``check_against_measurement`` recomputes their bytes at the
  measured shape. MLP layers reuse the Mamba-2 copy factor (no MLP-only program was measured).
- Published (Cloud TPU v5p page, docs.cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16 per chip,
  95 GiB HBM at 2765 GB/s, ICI 4800 Gbps = 600 GB/s per chip each way (1200 GB/s bidirectional) over the
  6 links of the 3D torus; a slice's name counts TensorCores, 2 per chip, and one chip is one jax
  device (megacore): v5p-64 = 32 chips, v5p-256 = 128 chips.
- Assumed: 50% MXU utilisation; a ring collective along one mesh axis gets 2 links' worth, 200 GB/s in
  per device; 2 us per ring step; activations fp32 as measured (the measured programs were fp32; bf16
  activations would halve the working sets and the gathers); parameters bf16 as stored; one prompt.

Not modelled: the softmax's exponentials on the vector unit (H L^2 / seq per attention layer per
device), compute and communication overlapping, collectives sharing links with each other. The "seq"
axis splits the forward only: ``attribute`` over "seq" is refused today, so the attribution figure is
an extrapolation (``ATTRIBUTION_RATIO``), labelled as such.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GiB = 1 << 30
F32 = 4  # activations, gathers and logits: fp32, as measured
BF16 = 2  # parameters, as stored


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    ici_bytes_per_s: float  # per chip, each way, all links together
    links: int


V5P = Chip("v5p", 95 * GiB, 2765e9, 459e12, 4800e9 / 8, 6)
SLICES = {"v5p-64": 32, "v5p-256": 128}  # chips = TensorCores / 2 (one jax device per chip)
LENGTHS = {"128k": 128 * 1024, "1M": 1024 * 1024}

ASSUMPTIONS = {
    "mxu_utilisation": 0.5,
    "ring_links": 2,  # a ring along one mesh axis: 2 of the chip's 6 links
    "step_latency_s": 2e-6,
    "activation_bytes": F32,
    "parameter_bytes": BF16,
    "batch": 1,
    "model_splits": (1, 2, 4, 8),
}
# last-row attribution / the forward alone, same host (benchmarks/results/scale_out.json, Mamba-2 130m,
# 24 layers, L = 1k / 4k / 16k: 0.91 / 0.82 / 0.79): used only for the labelled extrapolation
ATTRIBUTION_RATIO = (0.79, 0.91)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's widths. ``pattern``: one letter a layer, M Mamba-2, * attention, - MLP."""

    name: str
    source: str
    pattern: str
    d: int
    vocab: int
    tied: bool
    e: int = 0  # Mamba-2 inner width (heads x head_dim)
    heads: int = 0
    head_dim: int = 0
    groups: int = 0
    state: int = 0
    conv: int = 4
    chunk: int = 256
    attn_heads: int = 0
    kv_heads: int = 0
    attn_head_dim: int = 0
    mlp_width: int = 0
    mlp_gated: bool = False

    def count(self, kind: str) -> int:
        return self.pattern.count(kind)


MAMBA2_7B = Shape(
    name="7B Mamba-2 (Codestral Mamba widths)",
    source="mistralai/Mamba-Codestral-7B-v0.1 params.json: d_model 4096, 64 layers, expand 2, d_state 128, "
    "head_dim 64, n_groups 8, conv 4, vocab 32768, untied head (the count below, 7.285e9, is its published "
    "7.3B); chunk 256 (mamba_ssm's default)",
    pattern="M" * 64, d=4096, vocab=32768, tied=False, e=8192, heads=128, head_dim=64, groups=8,
    state=128, conv=4, chunk=256,
)  # fmt: skip
NEMOTRON_H_8B = Shape(
    name="Nemotron-H-8B-shaped hybrid",
    source="nvidia/Nemotron-H-8B-Base-8K config.json: hidden 4096, 52 layers "
    "'M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-' (24 Mamba-2, 4 attention, 24 MLP), "
    "mamba 128 heads x 64, n_groups 8, state 128, conv 4, chunk 128; attention 32 heads, 8 KV heads of "
    "128; MLP relu^2 21504 wide, not gated; vocab 131072, untied",
    pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", d=4096, vocab=131072, tied=False,
    e=8192, heads=128, head_dim=64, groups=8, state=128, conv=4, chunk=128, attn_heads=32, kv_heads=8,
    attn_head_dim=128, mlp_width=21504, mlp_gated=False,
)  # fmt: skip
# the 130m-wide models benchmarks/bench_sequence_axis.py measured (bench_collectives.configs)
MEASURED_MAMBA2 = Shape(
    name="130m-wide Mamba-2", source="bench_collectives.configs", pattern="MM", d=768, vocab=512,
    tied=True, e=1536, heads=24, head_dim=64, groups=1, state=128, chunk=256,
)  # fmt: skip
MEASURED_HYBRID = dataclasses.replace(
    MEASURED_MAMBA2, name="130m-wide hybrid", pattern="M*-", attn_heads=12, kv_heads=4,
    attn_head_dim=64, mlp_width=2048, mlp_gated=True,
)  # fmt: skip
ROW_TILE = 256  # latim_jax.model.attention.ROW_TILE


# ---------------------------------------------------------------- parameters


def layer_params(s: Shape, kind: str) -> int:
    """Parameters of one layer of ``kind`` (its pre-norm included)."""
    if kind == "M":
        conv_w = s.e + 2 * s.groups * s.state
        in_w = 2 * s.e + 2 * s.groups * s.state + s.heads
        return s.d * in_w + s.e * s.d + conv_w * (s.conv + 1) + 3 * s.heads + s.e + s.d
    if kind == "*":
        H, G, a = s.attn_heads, s.kv_heads, s.attn_head_dim
        return s.d * (H + 2 * G) * a + H * a * s.d + s.d
    if kind == "-":
        return (3 if s.mlp_gated else 2) * s.d * s.mlp_width + s.d
    raise ValueError(kind)


def params(s: Shape) -> dict:
    """Parameter counts: per kind (all its layers) and in all."""
    per_kind = {k: s.count(k) * layer_params(s, k) for k in "M*-" if s.count(k)}
    embed = s.vocab * s.d * (1 if s.tied else 2)
    return {"per_kind": per_kind, "embedding_and_head": embed, "total": sum(per_kind.values()) + embed + s.d}


def params_per_device(s: Shape, model: int) -> float:
    """Bytes of parameters on one device: Mamba layers and the vocabulary split over "model", attention
    and MLP whole (not split over "model" yet)."""
    p = params(s)
    split = p["per_kind"].get("M", 0) + p["embedding_and_head"]
    whole = p["per_kind"].get("*", 0) + p["per_kind"].get("-", 0) + s.d
    return (split / model + whole) * ASSUMPTIONS["parameter_bytes"]


# ---------------------------------------------------------------- working sets (fp32 words per token)


def mamba2_words(s: Shape, model: int = 1) -> dict:
    """fp32 words per token a Mamba-2 layer makes: the channel part (split over "model": in_proj's
    output, the conv's, SSD's intra-chunk (h, Q) decay/score rows and its chunk states, y and the gated
    norm's output) and the stream part (out_proj's partial sums and the residual, whole on each device)."""
    gn = 2 * s.groups * s.state
    channel = (2 * s.e + gn + s.heads) + (s.e + gn) + s.heads * s.chunk + s.e * s.state // s.chunk + 2 * s.e
    return {"channel": channel / model, "stream": 2 * s.d}


def attention_words(s: Shape) -> dict:
    """fp32 words per local token of an attention layer: q, the local k and v, the output, its
    projection, the rows' log-sum-exp, the residual (not split over "model")."""
    H, G, a = s.attn_heads, s.kv_heads, s.attn_head_dim
    return {"channel": 2 * H * a + 2 * G * a + H, "stream": 2 * s.d}


def mlp_words(s: Shape) -> dict:
    """fp32 words per token of an MLP layer: the hidden (and gate), the activation, the output, the
    residual (not split over "model")."""
    return {"channel": (3 if s.mlp_gated else 2) * s.mlp_width, "stream": 2 * s.d}


def attention_whole_length(s: Shape, L: int, seq: int) -> dict:
    """Bytes of an attention layer's working set that span the whole length on every device: the two
    fp32 (H, row tile, L) arrays of a row tile (scores and weights) and the gathered K, V and mask."""
    tile = min(ROW_TILE, L // seq)
    return {
        "row_tile": 2 * s.attn_heads * tile * L * F32,
        "kv_gathered": kv_gather_bytes(s, L),
        "mask_gathered": L,  # bool
    }


def kv_gather_bytes(s: Shape, L: int) -> int:
    """The all-gathered K and V of one attention layer (fp32): 2 L G a x 4 bytes."""
    return 2 * L * s.kv_heads * s.attn_head_dim * F32


def summary_bytes(s: Shape, model: int) -> int:
    """One shard's (Delta sums, final state) of one Mamba-2 layer on one device: the (h/model) Delta sums
    and (h/model, p, n) final states, fp32."""
    h = s.heads // model
    return (h + h * s.head_dim * s.state) * F32


def prefix_rounds(seq: int) -> int:
    """The log-depth prefix's rounds over ``seq`` shards (``latim_jax.parallel.sequence.prefix``)."""
    return max(seq - 1, 0).bit_length()


# the summaries a device holds at once in the prefix: its own, the one received, their composition, and
# the shifted (entering) and last-shard results
PREFIX_HELD = 5


def calibrate(path: Path = RESULTS / "sequence_axis.json") -> dict:
    """Copies XLA keeps per counted word (``mamba2_words`` / ``attention_words``), from the measured
    per-device temporaries of the split forward (module docstring)."""
    rows = {r["model"]: r for r in json.loads(path.read_text())["forward"]}
    m2 = rows["mamba2"]
    local = m2["L"] // m2["seq"]
    per_token = m2["split"]["temp_mib"] * 2**20 / local
    w = mamba2_words(MEASURED_MAMBA2)
    k_mamba = per_token / ((w["channel"] + w["stream"]) * F32)
    hy = rows["hybrid"]
    local = hy["L"] // hy["seq"]
    whole = sum(attention_whole_length(MEASURED_HYBRID, hy["L"], hy["seq"]).values())
    w = attention_words(MEASURED_HYBRID)
    k_attention = (hy["split"]["temp_mib"] * 2**20 - whole) / local / ((w["channel"] + w["stream"]) * F32)
    return {
        "mamba2_copies": k_mamba,
        "attention_copies": k_attention,
        "mamba2_bytes_per_token_measured": per_token,
        "one_device_over_split_temp": m2["temp_ratio"],
        "source": str(path.relative_to(HERE.parent)),
        "measured_at": {"L": m2["L"], "seq": m2["seq"], "d_model": MEASURED_MAMBA2.d},
    }


def layer_memory(s: Shape, kind: str, L: int, seq: int, model: int, cal: dict) -> dict:
    """One layer's working set on one device: ``per_token`` (bytes that fall as 1/seq), ``whole`` (bytes
    over the whole length or every shard: attention's row tile and gathers, Mamba-2's summaries)."""
    local = L // seq
    if kind == "M":
        w, k = mamba2_words(s, model), cal["mamba2_copies"]
        whole = {"summaries_prefix": PREFIX_HELD * summary_bytes(s, model) if seq > 1 else 0}
    elif kind == "*":
        w, k = attention_words(s), cal["attention_copies"]
        whole = attention_whole_length(s, L, seq)
    else:
        w, k = mlp_words(s), cal["mamba2_copies"]
        whole = {}
    per_token = k * (w["channel"] + w["stream"]) * F32 * local
    return {"per_token": per_token, "whole": whole, "total": per_token + sum(whole.values())}


def memory(s: Shape, L: int, seq: int, model: int, cal: dict) -> dict:
    """Bytes per device: parameters + logits output + the largest layer's working set (module docstring)."""
    layers = {k: layer_memory(s, k, L, seq, model, cal) for k in "M*-" if s.count(k)}
    peak_kind = max(layers, key=lambda k: layers[k]["total"])
    p = params_per_device(s, model)
    logits = L // seq * (s.vocab // model) * F32
    total = p + logits + layers[peak_kind]["total"]
    return {"params": p, "logits": logits, "layers": layers, "peak_kind": peak_kind, "total": total}


# ---------------------------------------------------------------- communication


def ring_bytes_per_s(chip: Chip = V5P) -> float:
    return chip.ici_bytes_per_s / chip.links * ASSUMPTIONS["ring_links"]


def layer_comm(s: Shape, kind: str, L: int, seq: int, model: int, chip: Chip = V5P) -> dict:
    """What one layer moves per device: {collective: {"bytes": size as XLA's HLO counts it (the gathered
    result, the permuted or reduced array), "received": bytes arriving at a device, "s": time}}."""
    bw, lat, local = ring_bytes_per_s(chip), ASSUMPTIONS["step_latency_s"], L // seq
    out = {}

    def gather(name, nbytes, count=1):  # ``count`` all-gathers in a ring over seq, nbytes in all
        got = nbytes * (seq - 1) / seq
        out[name] = {"bytes": nbytes, "received": got, "s": got / bw + count * (seq - 1) * lat}

    if kind == "M":
        if seq > 1:
            halo = (s.conv - 1) * (s.e + 2 * s.groups * s.state) // model * F32
            out["conv_halo_permute"] = {"bytes": halo, "received": halo, "s": halo / (bw / 2) + lat}
            one, steps = summary_bytes(s, model), prefix_rounds(seq) + 1  # the rounds, then the shift
            out["summaries_prefix_permute"] = {"bytes": steps * one, "received": steps * one,
                                               "s": steps * (one / (bw / 2) + lat)}  # fmt: skip
            # (carry_in's psum of the last shard's state is not in the logits' program: nothing reads it)
        if model > 1:
            stream = local * s.d * F32
            moved = 2 * (model - 1) / model * stream
            out["out_proj_all_reduce"] = {"bytes": stream, "received": moved,
                                          "s": moved / bw + 2 * (model - 1) * lat}  # fmt: skip
    elif kind == "*" and seq > 1:
        gather("kv_all_gather", kv_gather_bytes(s, L))
        gather("mask_all_gather", L)
    return out


# ---------------------------------------------------------------- compute and HBM


def layer_flops(s: Shape, kind: str, L: int, seq: int, model: int) -> float:
    """Forward FLOPs of one layer on one device. Mamba-2: in_proj, out_proj, conv, SSD (per chunk Q:
    C B^T per group, the masked (Q, Q) product per head, chunk states and the output from them) and the
    carry correction (C_t . h_in per head); split over seq and model. Attention: projections and, per
    local row, scores and values against every key (the row tile spans all L keys, masked, not halved);
    MLP: its two or three matmuls; attention and MLP are whole on every "model" device."""
    local = L // seq
    if kind == "M":
        gn = 2 * s.groups * s.state
        proj = 2 * s.d * (2 * s.e + gn + s.heads) + 2 * s.e * s.d
        hpn = s.heads * s.head_dim * s.state
        ssd = 2 * s.chunk * s.groups * s.state + 2 * s.chunk * s.e + 4 * hpn + 2 * s.conv * (s.e + gn)
        carry = 2 * hpn if seq > 1 else 0
        return local * (proj + ssd + carry) / model
    if kind == "*":
        H, G, a = s.attn_heads, s.kv_heads, s.attn_head_dim
        return local * (2 * s.d * (H + 2 * G) * a + 2 * H * a * s.d + 4 * H * a * L)
    return local * 2 * s.d * s.mlp_width * (3 if s.mlp_gated else 2)


def layer_hbm_bytes(s: Shape, kind: str, L: int, seq: int, model: int, cal: dict) -> float:
    """The least a layer reads and writes in HBM on one device: its parameters once, its per-token
    working set written and read once; attention also its (H, local, L) scores and weights (each written
    and read once) and the whole K/V once per row tile."""
    per_device = layer_params(s, kind) * ASSUMPTIONS["parameter_bytes"] / (model if kind == "M" else 1)
    mem = layer_memory(s, kind, L, seq, model, cal)
    traffic = per_device + 2 * mem["per_token"]
    if kind == "*":
        local = L // seq
        traffic += 4 * s.attn_heads * local * L * F32 + math.ceil(local / ROW_TILE) * kv_gather_bytes(s, L)
    return traffic


def layer_time(s: Shape, kind: str, L: int, seq: int, model: int, cal: dict, chip: Chip = V5P) -> dict:
    compute = layer_flops(s, kind, L, seq, model) / (chip.bf16_flops * ASSUMPTIONS["mxu_utilisation"])
    hbm = layer_hbm_bytes(s, kind, L, seq, model, cal) / chip.hbm_bytes_per_s
    comm = sum(c["s"] for c in layer_comm(s, kind, L, seq, model, chip).values())
    return {"compute_s": compute, "hbm_s": hbm, "comm_s": comm, "s": max(compute, hbm) + comm}


def head_time(s: Shape, L: int, seq: int, model: int, chip: Chip = V5P) -> float:
    """The final norm and the LM head: its matmul, and writing the (L/seq, V/model) fp32 logits."""
    local = L // seq
    flops = 2 * local * s.d * s.vocab / model
    written = local * s.vocab // model * F32 + s.vocab // model * s.d * ASSUMPTIONS["parameter_bytes"]
    return max(flops / (chip.bf16_flops * ASSUMPTIONS["mxu_utilisation"]), written / chip.hbm_bytes_per_s)


# ---------------------------------------------------------------- the estimate


def estimate(s: Shape, L: int, chips: int, seq: int, model: int, cal: dict, chip: Chip = V5P) -> dict:
    """One (shape, length, slice, split): memory per device, bytes per layer, time of the forward."""
    assert seq * model == chips, (seq, model, chips)
    mem = memory(s, L, seq, model, cal)
    kinds = [k for k in "M*-" if s.count(k)]
    per_layer = {}
    for k in kinds:
        comm = layer_comm(s, k, L, seq, model, chip)
        per_layer[k] = {
            "layers": s.count(k),
            "comm": comm,
            "comm_bytes": sum(c["bytes"] for c in comm.values()),
            "received_bytes": sum(c["received"] for c in comm.values()),
            "flops": layer_flops(s, k, L, seq, model),
            "time": layer_time(s, k, L, seq, model, cal, chip),
        }
    layers_s = sum(v["layers"] * v["time"]["s"] for v in per_layer.values())
    head_s = head_time(s, L, seq, model, chip)
    comm_s = sum(v["layers"] * v["time"]["comm_s"] for v in per_layer.values())
    return {
        "model": s.name,
        "L": L,
        "chips": chips,
        "seq": seq,
        "model_axis": model,
        "fits": mem["total"] <= chip.hbm_bytes,
        "memory": mem,
        "per_layer": per_layer,
        "forward_s": layers_s + head_s,
        "forward_comm_s": comm_s,
        "head_s": head_s,
    }


def splits(chips: int, s: Shape, L: int) -> list[tuple[int, int]]:
    """(seq, model) pairs over ``chips`` devices: model divides the Mamba heads and groups and the
    vocabulary; seq divides L and leaves at least conv-1 positions a shard."""
    out = []
    for m in ASSUMPTIONS["model_splits"]:
        seq = chips // m
        if chips % m or s.heads % m or s.groups % m or s.vocab % m or L % seq or L // seq < s.conv - 1:
            continue
        out.append((seq, m))
    return out


def choose(rows: list[dict]) -> dict:
    """The split a run would pick: the fastest that fits in HBM; else the smallest memory."""
    good = [r for r in rows if r["fits"]]
    if good:
        return min(good, key=lambda r: r["forward_s"])
    return min(rows, key=lambda r: r["memory"]["total"])


def check_against_measurement() -> dict:
    """The collective bytes this model predicts at the measured shape (130m-wide, L = 32k, seq = 8), in
    the streams ``bench_sequence_axis.py`` reports (bytes / (L/seq d fp32)) per layer, beside the
    measured ones (Mamba-2 collective-permutes 0.252: the halo's and the prefix's; the hybrid's
    all-gathers 1.778 averaged over its 3 layers)."""
    L, seq = 32768, 8
    stream = L // seq * 768 * F32
    m = layer_comm(MEASURED_MAMBA2, "M", L, seq, 1)
    a = layer_comm(MEASURED_HYBRID, "*", L, seq, 1)
    return {
        "mamba2_permute_streams": (m["conv_halo_permute"]["bytes"] + m["summaries_prefix_permute"]["bytes"])
        / stream,
        "hybrid_all_gather_streams_per_layer": (a["kv_all_gather"]["bytes"] + a["mask_all_gather"]["bytes"])
        / stream
        / 3,
    }


def run(cal: dict | None = None) -> dict:
    cal = calibrate() if cal is None else cal
    rows, chosen = [], []
    for s in (MAMBA2_7B, NEMOTRON_H_8B):
        for lname, L in LENGTHS.items():
            for slice_name, chips in SLICES.items():
                options = [estimate(s, L, chips, q, m, cal) | {"slice": slice_name, "length": lname}
                           for q, m in splits(chips, s, L)]  # fmt: skip
                rows += options
                best = choose(options)
                chosen.append({"model": s.name, "length": lname, "slice": slice_name,
                               "seq": best["seq"], "model_axis": best["model_axis"]})  # fmt: skip
    shapes = {s.name: {"source": s.source, "params": params(s)["total"]} for s in (MAMBA2_7B, NEMOTRON_H_8B)}
    chip = dataclasses.asdict(V5P) | {"slices_chips": SLICES, "ring_bytes_per_s": ring_bytes_per_s()}
    return {
        "shapes": shapes,
        "chip": chip,
        "assumptions": ASSUMPTIONS,
        "calibration": cal,
        "check_against_measurement": check_against_measurement(),
        "attribution_ratio_extrapolated": ATTRIBUTION_RATIO,
        "rows": rows,
        "chosen": chosen,
    }


# ---------------------------------------------------------------- output


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:.3g}" if x < 2**30 else f"{x / 2**20:,.0f}"


def _t(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.2f} s"


def markdown(res: dict) -> str:
    by_key = {(r["model"], r["length"], r["slice"], r["seq"], r["model_axis"]): r for r in res["rows"]}
    chosen = [by_key[(c["model"], c["length"], c["slice"], c["seq"], c["model_axis"])] for c in res["chosen"]]
    cal, chip, a = res["calibration"], res["chip"], res["assumptions"]
    lines = [
        '# Pod estimate: one prompt\'s forward (logits) over a v5p slice, length over "seq" x channels '
        'over "model"',
        "",
        "Arithmetic from `benchmarks/pod_estimate.py` (nothing compiled or run). Shapes:",
        "",
    ]
    for name, v in res["shapes"].items():
        lines.append(f"- {name}: {v['params'] / 1e9:.2f}e9 parameters; {v['source']}")
    lines += [
        "",
        f"Chip (published): {chip['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, {chip['hbm_bytes'] / GiB:.0f} GiB "
        f"HBM at {chip['hbm_bytes_per_s'] / 1e9:.0f} GB/s, ICI {chip['ici_bytes_per_s'] / 1e9:.0f} GB/s per "
        f"chip each way over {chip['links']} links; v5p-64 = 32 chips, v5p-256 = 128 (a slice's name "
        "counts TensorCores). Assumed: "
        f"{a['mxu_utilisation']:.0%} MXU utilisation, {res['chip']['ring_bytes_per_s'] / 1e9:.0f} GB/s per "
        f"device for a ring collective ({a['ring_links']} links), {a['step_latency_s'] * 1e6:.0f} us per "
        "ring step, fp32 activations / gathers / logits (as measured), bf16 parameters, one prompt. "
        f"Measured: {cal['mamba2_bytes_per_token_measured'] / 1024:.1f} KiB of temporaries per local token "
        f"for the 130m-wide Mamba-2 at L = 32k over seq = 8 ({cal['source']}), "
        f"{cal['mamba2_copies']:.2f}x the fp32 words per token counted for a Mamba-2 layer; "
        f"attention {cal['attention_copies']:.2f}x after its whole-length part. MLP reuses the Mamba-2 "
        "factor (assumed).",
        "",
        "## The split a run would pick (the fastest that fits)",
        "",
        "| model | L | slice | seq x model | params GiB | logits GiB | largest layer GiB (per-token + "
        "whole-length) | total GiB / 95 | forward | of which comm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    short = {"M": "Mamba-2", "*": "attention", "-": "MLP"}
    for r in chosen:
        m = r["memory"]
        lay = m["layers"][m["peak_kind"]]
        fit = "" if r["fits"] else " (does not fit)"
        lines.append(
            f"| {r['model']} | {r['length']} | {r['slice']} | {r['seq']} x {r['model_axis']} "
            f"| {_gib(m['params'])} | {_gib(m['logits'])} | {short[m['peak_kind']]}: {_gib(lay['total'])} "
            f"({_gib(lay['per_token'])} + {_gib(sum(lay['whole'].values()))}) | {_gib(m['total'])}{fit} "
            f"| {_t(r['forward_s'])} | {_t(r['forward_comm_s'])} |"
        )
    lines += [
        "",
        "## Per layer on one device (the chosen splits): bytes crossing devices, time",
        "",
        "Bytes as XLA's HLO counts them (the gathered result, the permuted / reduced array), MiB; "
        "time = max(compute, HBM) + communication.",
        "",
        "| model | L | slice | layer | conv halo | summaries prefix | K/V all-gather | out_proj "
        "all-reduce | compute | HBM | comm | layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in chosen:
        for k, v in r["per_layer"].items():
            c = v["comm"]

            def b(name, c=c):
                return _mib(c[name]["bytes"]) if name in c else "-"

            t = v["time"]
            lines.append(
                f"| {r['model']} | {r['length']} | {r['slice']} | {short[k]} x {v['layers']} "
                f"| {b('conv_halo_permute')} | {b('summaries_prefix_permute')} | {b('kv_all_gather')} "
                f"| {b('out_proj_all_reduce')} | {_t(t['compute_s'])} | {_t(t['hbm_s'])} | {_t(t['comm_s'])} "
                f"| {_t(t['s'])} |"
            )
    lines += [
        "",
        "## Every split",
        "",
        "| model | L | slice | seq x model | total GiB | fits | forward | comm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['model']} | {r['length']} | {r['slice']} | {r['seq']} x {r['model_axis']} "
            f"| {_gib(r['memory']['total'])} | {'yes' if r['fits'] else 'no'} | {_t(r['forward_s'])} "
            f"| {_t(r['forward_comm_s'])} |"
        )
    chk = res["check_against_measurement"]
    lo, hi = res["attribution_ratio_extrapolated"]
    lines += [
        "",
        "Check at the measured shape (130m-wide, L = 32k, seq = 8), streams per layer: Mamba-2 "
        f"collective-permutes {chk['mamba2_permute_streams']:.3f} (measured 0.252), hybrid all-gathers "
        f"{chk['hybrid_all_gather_streams_per_layer']:.3f} (1.778).",
        "",
        "## Extrapolation, not a supported run: last-row attribution",
        "",
        '`attribute` over "seq" runs, but gathers each scored layer\'s factors whole (not estimated here; '
        "docs/performance.md). If its factors stayed where the forward built them, the last row's "
        f"attribution would cost about {lo}-{hi}x a forward: the ratio of last-row "
        "alti to the forward alone measured on CPU for the 130m Mamba-2 at L = 1k-16k "
        "(benchmarks/results/scale_out.json). Scaled from the forward times above:",
        "",
        "| model | L | slice | seq x model | forward | last-row attribution (extrapolated) |",
        "|---|---|---|---|---|---|",
    ]
    for r in (r for r in chosen if r["fits"]):
        lines.append(
            f"| {r['model']} | {r['length']} | {r['slice']} | {r['seq']} x {r['model_axis']} "
            f"| {_t(r['forward_s'])} | {_t(lo * r['forward_s'])} - {_t(hi * r['forward_s'])} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS / "pod_estimate.json")
    args = p.parse_args(argv)
    res = run()
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
