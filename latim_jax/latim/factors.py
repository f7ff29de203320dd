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
    positions, halo, sequence_local, slot_unit, compacted
                               optional, for a mesh's "seq" axis: ``positions`` maps each per-position
                               field (a dotted path) to (its length axis, its role: "rows", read at
                               target rows; "sources", read at source columns; "both"; "chunks", a
                               per-chunk array of ``slot_unit`` positions each, which the kind's
                               ``compacted`` rebuilds); ``halo`` the source columns past a source
                               that its pair values read (the conv taps: K - 1); ``sequence_local``
                               whether the pair values read positions only through their order and
                               equality, so that one device may score its column window from a
                               compacted sequence of its own sources, the halo and the asked rows
                               (:mod:`latim_jax.latim.source_window`); a kind without it is gathered
                               whole to every device instead

tests/latim/test_kinds.py builds every registered kind and checks this interface and its identities.
"""

from __future__ import annotations

from typing import ClassVar

from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.blocking import tiles

FORMS = ("ssm", "pairs", "diagonal")
ROLES = ("rows", "sources", "both", "chunks")  # how a per-position field is read (``positions``)


class Factors:
    """The base of every kind's factors (the module docstring lists the interface). Subclasses are
    frozen dataclasses registered as pytrees; ``form`` is a class-level declaration, not a field. The
    defaults here serve a kind whose factors hold the stream ``h`` and score in Mamba-2's default tiles
    (attention, token-wise, parallel, shared)."""

    form: ClassVar[str] = "pairs"
    parts: ClassVar[tuple[str, ...]] = ()
    replicated: ClassVar[tuple[str, ...]] = ()
    positions: ClassVar[dict[str, tuple[int, str]] | None] = None

    @property
    def halo(self) -> int:
        """The source columns past a source j that its pair values read (M at j + k for the conv taps);
        a kind made of parts takes its parts' largest."""
        return max([0] + [getattr(self, name).halo for name in self.parts])

    @property
    def slot_unit(self) -> int:
        """The positions of one chunk of the kind's per-chunk factors (1: none): a device's window and
        its compacted slots are whole chunks."""
        return max([1] + [getattr(self, name).slot_unit for name in self.parts])

    def compacted(self, rows, slots, *, width: int, lead: int, seq: str):
        """The kind's own part of the compaction inside ``jax.shard_map`` (its "chunks" fields; the
        per-position ones are done), for the asked ``rows`` (g,) at ``slots``, a window of ``width``
        positions after ``lead`` slots: these factors unchanged for a kind without chunks."""
        del rows, slots, width, lead, seq
        return self

    @property
    def sequence_local(self) -> bool:
        """Whether a device may score its share of the source columns from a compacted sequence (see
        the module docstring): ``positions`` declared here and in every part."""
        return self.positions is not None and all(getattr(self, name).sequence_local for name in self.parts)

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
