"""Which decoder layers each pipeline stage and virtual chunk holds, as Megatron-core splits them.

Mirrors megatron-core 0.19's ``get_transformer_layer_offset`` and ``TransformerConfig``'s
checks of uneven pipelines. Even: every stage holds ``L / pp`` layers. Uneven
(``parallel.first_stage_layers`` / ``last_stage_layers``, Megatron's
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``): those stages
hold that many and the middle stages share the rest evenly, e.g. Qwen3-235B-A22B's 94 layers
as 11 + 6 x 12 + 11 over 8 stages. With ``vpp`` chunks every stage's layers are cut into
``vpp`` equal chunks, and chunk v of every stage comes before chunk v + 1 of any. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.schema import ParallelConfig


@dataclass(frozen=True)
class PipelineSplit:
    """The layers of a model of ``num_layers`` decoder layers over ``pp`` stages of ``vpp`` chunks (None: 1).

    ``first`` / ``last``: layers of the first / last stage of an uneven split (None: its even share).
    """

    num_layers: int
    pp: int
    vpp: int | None = None
    first: int | None = None
    last: int | None = None

    @property
    def _chunks(self) -> int:
        return self.vpp or 1

    @property
    def _middle_stages(self) -> int:
        return self.pp - (self.first is not None) - (self.last is not None)

    @property
    def _middle_layers(self) -> int:
        return self.num_layers - (self.first or 0) - (self.last or 0)

    def problem(self) -> str | None:
        """Why Megatron cannot split the layers so (naming the recipe fields), or None."""
        chunks = self._chunks
        if self.first is None and self.last is None:
            if self.num_layers % (self.pp * chunks):
                return f"pp ({self.pp}) x vpp ({chunks}) = {self.pp * chunks} does not divide the model's {self.num_layers} layers"
            return None
        if self.pp < 2:
            return "first_stage_layers / last_stage_layers split a pipeline unevenly: they need pp >= 2"
        for name, layers in (("first_stage_layers", self.first), ("last_stage_layers", self.last)):
            if layers is not None and layers % chunks:
                return f"{name} ({layers}) must be a multiple of vpp ({chunks})"
        middle, stages = self._middle_layers, self._middle_stages
        if self.vpp is not None and not stages:
            return "with vpp, an uneven pipeline needs a middle stage (megatron-core divides by their number)"
        if middle < 0 or bool(middle) != bool(stages):
            return (
                f"{middle} layers are left for {stages} middle stage(s) of the {self.num_layers}: first_stage_layers "
                "and last_stage_layers must leave layers exactly when stages are left"
            )
        if stages and middle % (stages * chunks):
            return (
                f"the {middle} layers between the first and last stages do not split evenly over {stages} middle "
                f"stage(s) x vpp ({chunks})"
            )
        return None

    def chunk_layers(self, pp_rank: int, vp_stage: int = 0) -> range:
        """Global (0-based) indices of the layers chunk ``vp_stage`` of stage ``pp_rank`` holds.

        Raises:
            ValueError: the split has a :meth:`problem`.
        """
        if (reason := self.problem()) is not None:
            raise ValueError(reason)
        chunks = self._chunks
        if self.first is None and self.last is None:
            per_chunk = self.num_layers // (self.pp * chunks)
            start = vp_stage * (self.num_layers // chunks) + pp_rank * per_chunk
            return range(start, start + per_chunk)
        first_chunk = (self.first or 0) // chunks
        last_chunk = (self.last or 0) // chunks
        middle_chunk = self._middle_layers // chunks // self._middle_stages if self._middle_stages else 0
        per_vp_stage = first_chunk + middle_chunk * self._middle_stages + last_chunk
        if pp_rank == 0 and self.first is not None:
            start, size = vp_stage * per_vp_stage, first_chunk
        elif pp_rank == self.pp - 1 and self.last is not None:
            start, size = (vp_stage + 1) * per_vp_stage - last_chunk, last_chunk
        else:
            middle_rank = pp_rank - (self.first is not None)
            start, size = vp_stage * per_vp_stage + first_chunk + middle_rank * middle_chunk, middle_chunk
        return range(start, start + size)


def pipeline_split(num_layers: int, parallel: ParallelConfig) -> PipelineSplit:
    """The split of ``num_layers`` decoder layers at the recipe's ``parallel`` section."""
    return PipelineSplit(num_layers, parallel.pp, parallel.vpp, parallel.first_stage_layers, parallel.last_stage_layers)
