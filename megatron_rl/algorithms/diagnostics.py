"""Length-bias diagnostics, logged every step.

Shape legend: B responses.

GRPO's per-sequence length normalisation rewards long wrong answers and short
right ones (Dr. GRPO, arXiv 2503.20783); these numbers show whether a run
drifts that way: how long correct and wrong responses are, how length and
score correlate, and how often the generation budget is hit.
"""

from __future__ import annotations

import math

import torch


def length_bias_metrics(
    lengths: torch.Tensor,
    correct: torch.Tensor,
    scores: torch.Tensor,
    *,
    max_response_length: int | None = None,
    truncated: torch.Tensor | None = None,
) -> dict[str, float]:
    """Length statistics of one step's responses, as Python floats.

    Args:
        lengths: [B] response lengths in tokens.
        correct: [B] bool, whether each response was judged correct.
        scores: [B] float scores.
        max_response_length: generation budget in tokens; a response of at
            least this length counts as truncated when ``truncated`` is absent.
        truncated: [B] bool, whether the engine cut each response off
            (finish reason "length"); preferred when available.

    Returns:
        ``length_mean``, ``length_correct_mean``, ``length_wrong_mean``,
        ``length_wrong_over_correct`` (ratio of the two class means),
        ``length_score_corr`` (Pearson correlation of length and score) and
        ``truncation_rate``. A statistic that is undefined is ``nan``, never an
        error and never a made-up 0: a class mean when the class is empty; the
        ratio when either class is empty or correct responses average 0
        tokens; the correlation when B < 2 or length or score does not vary;
        everything for B = 0. The key set never changes.

    Raises:
        ValueError: inputs not all [B] with the same B; neither ``truncated``
            nor ``max_response_length`` given; ``max_response_length`` <= 0.
    """
    _check_same_batch(lengths=lengths, correct=correct, scores=scores, truncated=truncated)
    if max_response_length is not None and max_response_length <= 0:
        raise ValueError(f"max_response_length must be > 0 tokens; got {max_response_length!r}")
    lengths_B = lengths.detach().to(device="cpu", dtype=torch.float64)
    scores_B = scores.detach().to(device="cpu", dtype=torch.float64)
    correct_B = correct.detach().to(device="cpu", dtype=torch.bool)
    truncated_B = _truncation_flags(lengths_B, truncated, max_response_length)

    correct_mean = _mean(lengths_B[correct_B])
    wrong_mean = _mean(lengths_B[~correct_B])
    return {
        "length_mean": _mean(lengths_B),
        "length_correct_mean": correct_mean,
        "length_wrong_mean": wrong_mean,
        "length_wrong_over_correct": wrong_mean / correct_mean if correct_mean > 0 else math.nan,
        "length_score_corr": _pearson(lengths_B, scores_B),
        "truncation_rate": _mean(truncated_B.to(torch.float64)),
    }


def _truncation_flags(
    lengths_B: torch.Tensor, truncated: torch.Tensor | None, max_response_length: int | None
) -> torch.Tensor:
    if truncated is not None:
        return truncated.detach().to(device="cpu", dtype=torch.bool)
    if max_response_length is not None:
        return lengths_B >= max_response_length
    raise ValueError("pass truncated (preferred) or max_response_length to measure the truncation rate")


def _mean(values: torch.Tensor) -> float:
    return values.mean().item() if values.numel() > 0 else math.nan


def _pearson(x_B: torch.Tensor, y_B: torch.Tensor) -> float:
    """Pearson correlation; nan when fewer than two points or either side is constant."""
    if x_B.numel() < 2:
        return math.nan
    dx_B = x_B - x_B.mean()
    dy_B = y_B - y_B.mean()
    denominator = (dx_B.square().sum() * dy_B.square().sum()).sqrt().item()
    return (dx_B * dy_B).sum().item() / denominator if denominator > 0 else math.nan


def _check_same_batch(**tensors: torch.Tensor | None) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if any(len(shape) != 1 for shape in shapes.values()) or len(set(shapes.values())) > 1:
        raise ValueError(f"inputs must all be [B] with the same B; got shapes {shapes}")
