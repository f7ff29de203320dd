"""The interface a layer's factors implement: :class:`Factors`, which every kind's factors class subclasses.

A kind's decomposition (``LayerKind.factors``, :mod:`latim_jax.latim.kinds`) returns an instance for the
stream h entering the layer. The scores, the attribution loop and the conservation checks read only:

    kind                       the kind's name
    length                     l
    h, output, bias            (b, l, d): the stream entering the layer, the sublayer's output o, and
                               beta, the part of o that belongs to no token
    W_out                      (e, d): T_i(x_j) = V_{i,j} @ W_out; None: V_{i,j} is T_i(x_j) (e = d)
    token_total                (b, l, d) sum_j T_i(x_j) in O(l) (when built with with_total), or None
    pair_values(rows, j0, width, blocks, channels_first=False)
                               V (b, r, width, e) for target rows ``rows`` and sources [j0, j0 + width)
    channels_first             the layout pair_values is fastest in ((b, e, r, width) when True)
    tiles(n_rows, blocks)      the kind's default tiles completed with the caller's ``blocks``
    form                       how its pairs are scored, declared by the class (:data:`FORMS`):
      "ssm"                    a hidden attention M: ``ssm`` (:class:`latim_jax.kernels.decay.SSM`), which
                               the hidden-attention baseline and the fused Pallas score kernel read
      "pairs"                  pair values alone; ``attention_map(rows, j0, width)`` (b, r, width) is its
                               map for the hidden-attention baseline (attention: its weights)
      "diagonal"               only (i, i) pairs (a token-wise kind): ``diagonal_scores(method, rows,
                               aux)`` (b, r, l) without tiles, and the identity as ``attention_map``
    parts, replicated          a kind made of parts names the fields holding their factors (the mesh's
                               score stage lays each part out as its own kind); ``replicated`` names its
                               arrays without a batch axis (weights)

tests/latim/test_kinds.py builds every registered kind and checks this interface and its identities.
"""

from __future__ import annotations

from typing import ClassVar

from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.blocking import tiles

FORMS = ("ssm", "pairs", "diagonal")


class Factors:
    """The base of every kind's factors (the module docstring lists the interface). Subclasses are
    frozen dataclasses registered as pytrees; ``form`` is a class-level declaration, not a field. The
    defaults here serve a kind whose factors hold the stream ``h`` and score in Mamba-2's default tiles
    (attention, token-wise, parallel, shared)."""

    form: ClassVar[str] = "pairs"
    parts: ClassVar[tuple[str, ...]] = ()
    replicated: ClassVar[tuple[str, ...]] = ()

    @property
    def length(self) -> int:
        """Sequence length l."""
        return self.h.shape[1]

    def tiles(self, n_rows: int | None, blocks: Blocks | None) -> Blocks:
        """The score tiles for ``n_rows`` target rows (None: all), Mamba-2's defaults completed with
        ``blocks``."""
        return tiles(2, self.length, n_rows, blocks)

    def attention_map(self, rows, j0, width: int):
        """The kind's map for the hidden-attention baseline, (b, r, width) ("pairs" and "diagonal")."""
        raise NotImplementedError(f"{type(self).__name__} ({self.form!r}) gives no attention_map")

    def diagonal_scores(self, method: str, rows, aux=None):
        """The unnormalised scores (b, r, l) of a "diagonal" kind without the tile loop."""
        raise NotImplementedError(f"{type(self).__name__} ({self.form!r}) is not a diagonal kind")
