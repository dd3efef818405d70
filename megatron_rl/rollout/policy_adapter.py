"""Which LoRA adapter a run's generate requests name: the policy's latest synced one.

A LoRA run's engines serve the frozen base weights and load the policy's adapter at every weight sync under a
name of its version (:func:`~megatron_rl.engines.protocol.lora_adapter_name`, ``docs/lora-sync.md``); a request
that names no adapter gets the base model. So every request names the adapter of the version the engines hold.
"""

from __future__ import annotations

from megatron_rl.engines.protocol import lora_adapter_name


class PolicyAdapter:
    """The adapter requests name (``GenerateRequest.lora_path``), shared by every request planner of a run.

    ``name`` is None until the run first syncs: a fresh run's engines hold no adapter yet, and its adapter starts
    at B = 0 (PEFT's initialisation), so the base model is that policy exactly. The run calls :meth:`synced` after
    each sync, before the next request is built (a sync never overlaps a generation: the driver waits for the
    rollout in flight first), so a request names the adapter its engine holds.
    """

    def __init__(self) -> None:
        self.name: str | None = None

    def synced(self, version: int | str) -> None:
        """The engines hold the adapter of weight version ``version`` from now on."""
        self.name = lora_adapter_name(version)
