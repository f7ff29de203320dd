"""The Attribution result: scores, rollout across layers, and atomic save/load to one .npz file."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "latim-jax-attribution/1"
ROLLOUT_METHODS = ("alti", "hidden_attention", "logit")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Attribution:
    """Scores of one attribution call.

    scores: (B, n_layers, R, L) float32 (R = L, or the requested rows); tokens (B, L);
    extra: method-specific arrays - "targets" (B, L) vocabulary entries for logit/grad_input;
    for "logit": "direct" (B, R) embedding term, "bias" (B, n_layers, R) bias terms, "logit" (B, R) the
    model's logit, "alti" (B, n_layers, L, L) for the rollout; for mode "paper":
    "approximation_error" (n_layers,) = mean_i ||o_i - b_out - sum_j T_i(x_j)|| / ||o_i||.
    """

    scores: jax.Array
    tokens: jax.Array
    extra: dict
    method: str = dataclasses.field(metadata=dict(static=True))
    mode: str = dataclasses.field(metadata=dict(static=True))
    layers: tuple = dataclasses.field(metadata=dict(static=True))
    rows: tuple | None = dataclasses.field(metadata=dict(static=True))
    model: str = dataclasses.field(metadata=dict(static=True))

    def check_finite(self) -> None:
        """Raise FloatingPointError naming the layers whose scores hold NaN/inf (concrete inputs only)."""
        if isinstance(self.scores, jax.core.Tracer):
            return
        bad = ~np.isfinite(np.asarray(self.scores))
        if bad.any():
            layers = [self.layers[i] for i in np.unique(np.nonzero(bad)[1])]
            raise FloatingPointError(f"non-finite {self.method} scores at layer(s) {layers}")

    def rollout(self, per_layer: bool = False):
        """Aggregate across layers (needs all layers and all rows).

        alti: R^1 = C^1, R^l = C^l R^{l-1} (row-stochastic). hidden_attention: the same product of
        (A + I) / rowsum. logit: input attribution sum_l sum_j c^l_ij R^{l-1}_jk (R^0 = I) plus the
        embedding term at k = i, so that rows sum to the logit minus the layers' bias terms
        (``extra["bias"].sum(1)``). Returns (B, L, L), or (B, n_layers, L, L) with ``per_layer``.
        """
        if self.method not in ROLLOUT_METHODS:
            raise ValueError(f"rollout is defined for {ROLLOUT_METHODS}, not {self.method!r}")
        if self.rows is not None or self.layers != tuple(range(len(self.layers))):
            raise ValueError(
                "rollout needs every layer and every row (call attribute with layers=None, rows=None)"
            )
        L = self.scores.shape[-1]
        eye = jnp.eye(L, dtype=jnp.float32)
        if self.method == "logit":
            mats = self.extra["alti"]
            R = jnp.broadcast_to(eye, mats[:, 0].shape)
            total = self.extra["direct"][..., None] * eye
            steps = []
            for layer in range(mats.shape[1]):
                total = total + jnp.einsum("bij,bjk->bik", self.scores[:, layer], R)
                R = jnp.einsum("bij,bjk->bik", mats[:, layer], R)
                steps.append(total)
        else:
            mats = self.scores
            if self.method == "hidden_attention":
                mats = mats + eye
                mats = mats / mats.sum(-1, keepdims=True)
            R = mats[:, 0]
            steps = [R]
            for layer in range(1, mats.shape[1]):
                R = jnp.einsum("bij,bjk->bik", mats[:, layer], R)
                steps.append(R)
        return jnp.stack(steps, 1) if per_layer else steps[-1]

    def save(self, path) -> None:
        """Write one self-describing .npz (arrays + JSON metadata) atomically."""
        from latim_jax import __version__

        meta = {
            "format": FORMAT,
            "method": self.method,
            "mode": self.mode,
            "layers": list(self.layers),
            "rows": None if self.rows is None else list(self.rows),
            "model": self.model,
            "library_version": __version__,
            "extra_keys": sorted(self.extra),
        }
        arrays = {"scores": np.asarray(self.scores), "tokens": np.asarray(self.tokens)}
        arrays.update({f"extra__{k}": np.asarray(v) for k, v in self.extra.items()})
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        write_npz_atomic(path, arrays)

    @classmethod
    def load(cls, path) -> Attribution:
        """Read a file written by :meth:`save`."""
        path = os.fspath(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if meta.get("format") != FORMAT:
                    raise KeyError(f"format {meta.get('format')!r}")
                extra = {k: jnp.asarray(z[f"extra__{k}"]) for k in meta["extra_keys"]}
                return cls(
                    scores=jnp.asarray(z["scores"]),
                    tokens=jnp.asarray(z["tokens"]),
                    extra=extra,
                    method=meta["method"],
                    mode=meta["mode"],
                    layers=tuple(meta["layers"]),
                    rows=None if meta["rows"] is None else tuple(meta["rows"]),
                    model=meta["model"],
                )
        except (KeyError, OSError, EOFError, ValueError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: cannot read a latim-jax attribution file ({err})") from err


def write_npz_atomic(path, arrays: dict) -> None:
    """np.savez into memory, then :func:`write_bytes_atomic`: no half-written file is ever left."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_bytes_atomic(path, buf.getvalue())


def write_bytes_atomic(path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place.

    The file gets the permissions a plain ``open(path, "w")`` would give (0o666 minus the umask),
    not mkstemp's private 0o600.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc/self/status);
    elsewhere set and restored at once."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
