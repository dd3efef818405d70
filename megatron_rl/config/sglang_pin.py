"""The facts about the one SGLang version megatron-rl is pinned to, each with the reason the code depends on it.

Every name here is SGLang 0.5.23's (``srt/server_args.py``, ``srt/entrypoints/http_server.py``); a new pin
rechecks them: ``tests/unit/test_sglang_protocol.py`` holds the flags to SGLang's own argument parser, and
``tests/sglang/`` runs a real server. It lives in ``config`` (it imports nothing) so that the recipe checks,
preflight and the engine driver all read the same facts.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
"""The SGLang release the engines run (pyproject's ``gpu`` extra, ``launch/requirements-sglang.lock``); preflight
refuses another, since the protocol, flags and refusals below are this release's."""

CONFIG_FLAG = "--config"
"""A YAML file SGLang merges into its arguments (``ConfigArgumentMerger``): the API key goes there, off the command
line every user of the node can read."""
CONFIG_FILE_NAME = "server.yaml"
"""The private ``--config`` file of an engine with an API key (SGLang accepts only .yaml/.yml)."""
CONFIG_API_KEY = "api-key"
"""``--api-key`` as a key of that file: SGLang takes the key as this flag only, with no environment variable."""

MEMORY_SAVER_FLAGS = ("--enable-memory-saver", "--disable-prefill-cuda-graph")
"""Colocated engines on CUDA: release/resume of weights and KV cache around training; the memory saver needs the
prefill CUDA graph off (slime does the same)."""
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""Routing replay (R3): the engine returns each token's routed experts with the generation."""
DETERMINISTIC_INFERENCE_FLAG = "--enable-deterministic-inference"
"""Batch-invariant kernels and the seeded sampler: the only mode in which SGLang reads a request's
``sampling_seed`` (``srt/sampling/sampling_batch_info.py``)."""

CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle", "--disable-radix-cache")
"""Flags of a CPU engine: SGLang's CPU device, its torch-native attention (the CPU backends need AMX
kernels), an idle scheduler that waits on its sockets instead of spinning a core the trainer needs, and no
prefix cache, so a weight sync has nothing to flush (a CPU flush is a ``gc.collect()`` of about 0.5 s; RL
reuses no prefix across weight versions, and a group's samples are prefilled together)."""
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
"""Set to ``1`` for a CPU engine: SGLang's CPU path (without it SGLang imports ``vllm``)."""

LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch")
"""A LoRA run's engines: LoRA on, the recipe's rank as the largest accepted, its targets, its adapter slots per batch
(the flags SGLang needs without ``--lora-paths``, ``srt/arg_groups/lora_hook.py:150-153``). The default LoRA
kernel backend (``csgmv``, Triton) is the GPU's."""
EXPERTS_SHARED_OUTER_FLAG = "--experts-shared-outer-loras"
"""Force shared outer expert matrices (``lora.experts_shared_outer``); unset, SGLang infers it from the adapter."""
CPU_LORA_FLAGS = ("--lora-backend", "torch_native")
"""A CPU engine's LoRA kernels: every other backend of ``srt/lora/backend/lora_registry.py`` is Triton's (or Ascend's);
``torch_native`` (``srt/lora/backend/torch_backend.py``) runs the adapters of attention and dense MLPs with torch.
Routed experts have no such path (``srt/lora/layers.py:1075,1125``: the Triton MoE runner), so a CPU engine adapts
no experts; and SGLang's LoRA code pins host memory, a no-op on CPU only through ``engines/native/cpu_site``."""
LORA_NOT_BY_BROADCAST = (
    "SGLang 0.5.23 loads a LoRA adapter from tensors (/load_lora_adapter_from_tensors) or from a directory "
    "(/load_lora_adapter), not by broadcast"
)
"""Why an adapter sync has no ``distributed`` transport: ``auto`` takes tensors when colocated, a directory when
disaggregated (``weight_sync/lora_sync.lora_delivery_kind``)."""
