"""Step metrics reduced over micro-batches and data-parallel ranks.

Three kinds, matching how ``megatron_rl.algorithms`` reports them:

* ``sum``: shares of the step loss (already divided by the step's counts);
  the step value is their sum over micro-batches and DP ranks;
* ``mean``: means over a shard's valid tokens; weighted by the shard's token
  count, summed, divided by the total count (a token mean over the step);
* ``max``: maxima over a shard; the step value is the maximum.

Values live on the last pipeline stage; :meth:`MetricsAccumulator.reduce`
reduces over DP there and broadcasts the dict to the other pipeline stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.parallel.device import select_device

MAX_METRICS = frozenset({"ratio_max", "mismatch_abs_max"})


class MetricsAccumulator:
    """Collects per-micro-batch metric tensors without reading them; reduces them once per step.

    Nothing here converts a tensor to a Python number before :meth:`reduce`, so a GPU step
    synchronises with the host once for its metrics, not once per micro-batch.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._means: dict[str, torch.Tensor] = {}
        self._maxima: dict[str, torch.Tensor] = {}
        self._tokens: torch.Tensor | None = None

    def add(self, sums: dict[str, torch.Tensor], means: dict[str, torch.Tensor], num_tokens: torch.Tensor) -> None:
        """Add one micro-batch: loss shares ``sums``, token means ``means`` over ``num_tokens`` tokens (0-dim)."""
        tokens = num_tokens.detach().to(torch.float64)
        for name, value in sums.items():
            self._sums[name] = self._sums.get(name, 0.0) + value.detach().to(torch.float64)
        for name, value in means.items():
            value = value.detach().to(torch.float64)
            if name in MAX_METRICS:
                self._maxima[name] = value if name not in self._maxima else torch.maximum(self._maxima[name], value)
            else:
                self._means[name] = self._means.get(name, 0.0) + value * tokens
        self._tokens = tokens if self._tokens is None else self._tokens + tokens

    def reduce(self) -> dict[str, float]:
        """Step values, identical on every rank of the model (all ranks must call it)."""
        result: list[dict[str, float] | None] = [None]
        if parallel_state.is_pipeline_last_stage():
            result[0] = self._reduce_over_dp()
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(
                result,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return dict(result[0] or {})

    def _reduce_over_dp(self) -> dict[str, float]:
        group = parallel_state.get_data_parallel_group()
        sum_names, mean_names, max_names = sorted(self._sums), sorted(self._means), sorted(self._maxima)
        device = select_device()
        zero = torch.zeros((), dtype=torch.float64, device=device)
        parts = [self._sums[n] for n in sum_names] + [self._means[n] for n in mean_names]
        summed = torch.stack(
            [torch.as_tensor(p, dtype=torch.float64).to(device) for p in parts]
            + [zero if self._tokens is None else self._tokens.to(device)]
        )
        maxima = torch.stack([self._maxima[n].to(device) for n in max_names]) if max_names else zero.new_zeros(0)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(summed, group=group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        tokens = max(float(summed[-1]), 1.0)
        values = dict(zip(sum_names, summed[: len(sum_names)].tolist(), strict=True))
        values |= {n: float(v) / tokens for n, v in zip(mean_names, summed[len(sum_names) : -1], strict=True)}
        values |= dict(zip(max_names, maxima.tolist(), strict=True))
        return values | {"tokens": float(summed[-1])}
