"""The rollout batch the actor consumes, and the padding the schedules need.

Shape legend: B sequences, S tokens per sequence (prompt + response, right
padded), L decoder layers of the model, K experts per token (MoE top-k).

Alignment: every per-token tensor is indexed like ``input_ids``. A log-prob at
position t is log p(input_ids[t] | input_ids[:t]); position 0 has no
prediction and holds 0. ``response_mask[b, t]`` marks the tokens that enter
the loss (response tokens; overlong-filtered responses are simply unmarked).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_PER_TOKEN_FIELDS = ("old_log_probs", "rollout_log_probs", "ref_log_probs")


@dataclass(frozen=True)
class ActorBatch:
    """Token ids, masks and per-token values of B sequences.

    Attributes:
        input_ids: [B, S] int64, prompt followed by response, right padded.
        lengths: [B] int64, valid tokens of each row (prompt + response), >= 1
            for real rows; 0 marks a padding row added to even out micro-batches.
        response_mask: [B, S] bool, True at tokens that enter the loss.
        advantages: [B] or [B, S] float, or None (needed only for training).
        old_log_probs: [B, S] float, the trainer's log-probs before the update.
        rollout_log_probs: [B, S] float, the engine's log-probs (mismatch, TIS).
        ref_log_probs: [B, S] float, the reference policy's log-probs (KL loss).
        routed_experts: [B, S, L, K] int64, the experts the engine routed each
            token to in each decoder layer (entries of dense layers are ignored).
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S]; got shape {tuple(self.input_ids.shape)}")
        shape = tuple(self.input_ids.shape)
        if tuple(self.lengths.shape) != shape[:1]:
            raise ValueError(f"lengths must be [B] = {shape[:1]}; got {tuple(self.lengths.shape)}")
        if tuple(self.response_mask.shape) != shape or self.response_mask.dtype != torch.bool:
            raise ValueError(
                f"response_mask must be bool {shape}; got {self.response_mask.dtype} {tuple(self.response_mask.shape)}"
            )
        for name in _PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name} must be [B, S] = {shape}; got {tuple(value.shape)}")
        if self.advantages is not None and tuple(self.advantages.shape) not in (shape[:1], shape):
            raise ValueError(f"advantages must be [B] or [B, S] = {shape}; got {tuple(self.advantages.shape)}")
        if self.routed_experts is not None and (
            self.routed_experts.dim() != 4 or tuple(self.routed_experts.shape[:2]) != shape
        ):
            raise ValueError(
                f"routed_experts must be [B, S, L, K] with [B, S] = {shape}; got {tuple(self.routed_experts.shape)}"
            )

    @property
    def num_sequences(self) -> int:
        """B, padding rows included."""
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        """S, the padded length."""
        return self.input_ids.shape[1]

    @property
    def prompt_mask(self) -> torch.Tensor:
        """[B, S] bool: valid tokens that are not response tokens."""
        positions = torch.arange(self.seq_length, device=self.input_ids.device)
        return (positions < self.lengths.unsqueeze(-1)) & ~self.response_mask

    def replace(self, **fields: torch.Tensor | None) -> ActorBatch:
        """A copy with ``fields`` replaced (validated again)."""
        changes: dict[str, Any] = fields  # Any: a None in a required field fails __post_init__
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> ActorBatch:
        """The batch with every tensor on ``device``."""
        return self._map(lambda _, value: value.to(device))

    def select(self, indices: Sequence[int]) -> ActorBatch:
        """The rows ``indices``, in that order."""
        index = torch.as_tensor(list(indices), dtype=torch.long, device=self.input_ids.device)
        return self._map(lambda _, value: value[index])

    def padded(self, num_sequences: int, seq_length: int) -> ActorBatch:
        """Right-pad to ``[num_sequences, seq_length]``.

        Added rows have length 0 and no response token, so they add nothing to
        a loss or a count; added positions hold token 0, mask False, log-prob 0
        and experts 0..K-1 (valid, distinct indices for routing replay).

        Raises:
            ValueError: if the target is smaller than the batch.
        """
        if num_sequences < self.num_sequences or seq_length < self.seq_length:
            raise ValueError(
                f"cannot pad a [{self.num_sequences}, {self.seq_length}] batch to [{num_sequences}, {seq_length}]"
            )
        return self._map(lambda name, value: _pad(name, value, num_sequences, seq_length))

    def _map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> ActorBatch:
        """The batch with ``fn(name, tensor)`` in place of each tensor field; None fields stay None."""
        mapped: dict[str, Any] = {}  # Any: the required fields come out tensors, as they are in self
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            mapped[field.name] = None if value is None else fn(field.name, value)
        return ActorBatch(**mapped)


def _pad(name: str, value: torch.Tensor, num_sequences: int, seq_length: int) -> torch.Tensor:
    rows = num_sequences - value.shape[0]
    if name == "lengths" or (name == "advantages" and value.dim() == 1):
        return torch.cat([value, value.new_zeros(rows)])
    if name == "routed_experts":
        fill = torch.arange(value.shape[-1], dtype=value.dtype, device=value.device)
        padded = fill.expand(num_sequences, seq_length, value.shape[2], -1).clone()
        padded[: value.shape[0], : value.shape[1]] = value
        return padded
    padded = value.new_zeros((num_sequences, seq_length))
    padded[: value.shape[0], : value.shape[1]] = value
    return padded
