"""A seeded, exactly resumable sampler of prompt batches.

Epoch ``e`` visits the dataset in the order ``permutation(seed, e)`` (identity without
shuffling), drawn from a NumPy generator seeded with ``(seed, e)``, so any epoch's order can be
recomputed without replaying the ones before it. Batches never span epochs (drop_last): each
epoch yields ``dataset_size // batch_size`` batches of distinct indices and skips the last
``dataset_size % batch_size`` indices of its order; with shuffling those differ from epoch to
epoch, so no prompt is skipped systematically. The state is three integers; a sampler
restored from ``state_dict()`` yields exactly the batches the original would have yielded next.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


class PromptSampler:
    """Yields lists of ``batch_size`` distinct dataset indices, one list per step, forever."""

    def __init__(self, dataset_size: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dataset_size < batch_size:
            raise ValueError(
                f"dataset_size={dataset_size} is smaller than batch_size={batch_size}: no full batch can be drawn; "
                "lower the batch size or add prompts"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._position = 0
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches each epoch yields (the remainder of the order is dropped)."""
        return self.dataset_size // self.batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def epoch_order(self, epoch: int) -> list[int]:
        """The order in which ``epoch`` visits the dataset: a permutation of ``range(dataset_size)``."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        order: list[int] = np.random.default_rng([self._seed, epoch]).permutation(self.dataset_size).tolist()
        return order

    def next_batch(self) -> list[int]:
        """The next batch of indices; advances the state (rolling over to the next epoch when full)."""
        if self._order is None:
            self._order = self.epoch_order(self._epoch)
        batch = self._order[self._position : self._position + self.batch_size]
        self._position += self.batch_size
        self._roll_over_if_exhausted()
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def _roll_over_if_exhausted(self) -> None:
        if self._position + self.batch_size > self.dataset_size:
            self._epoch += 1
            self._position = 0
            self._order = None

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed"}``: the next batch starts at ``position`` in ``epoch_order(epoch)``."""
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore a ``state_dict()``; the seed comes from the state. Raises ValueError on an invalid state."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise ValueError(f"sampler state is missing {sorted(missing)}; got keys {sorted(state)}")
        epoch, position, seed = (int(state[key]) for key in ("epoch", "position", "seed"))
        if epoch < 0 or seed < 0 or not 0 <= position <= self.dataset_size:
            raise ValueError(
                f"invalid sampler state epoch={epoch} position={position} seed={seed} for dataset_size="
                f"{self.dataset_size}: epoch and seed must be >= 0 and 0 <= position <= dataset_size "
                "(was the dataset changed since the checkpoint?)"
            )
        self._epoch, self._position, self._seed = epoch, position, seed
        self._order = None
        self._roll_over_if_exhausted()
