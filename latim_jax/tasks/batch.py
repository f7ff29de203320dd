"""One padded batch of a synthetic task, and how a generator finishes one (targets, scored rows)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Batch:
    """One padded batch (numpy arrays, all of shape (b, l) unless said).

    tokens: int32 ids; targets: tokens shifted left (targets[:, i] = tokens[:, i + 1], padding at the
    end); loss_mask: bool, True on scored rows; gold: int32 gold source per row (-1 off the scored
    rows); lengths: (b,) int32 true sequence lengths.
    """

    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    gold: np.ndarray
    lengths: np.ndarray


def finish_batch(tokens: np.ndarray, gold: np.ndarray, *, lengths) -> Batch:
    """The Batch of ``tokens`` (b, l) with gold sources ``gold`` (b, l) (-1 off the scored rows): targets
    are the tokens shifted left, the scored rows are where a gold source exists."""
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    return Batch(
        tokens=tokens,
        targets=targets.astype(np.int32),
        loss_mask=gold >= 0,
        gold=gold,
        lengths=np.asarray(lengths, np.int32),
    )
