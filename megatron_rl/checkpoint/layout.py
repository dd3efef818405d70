"""Every name inside a run checkpoint, in one place.

Under ``checkpoint.dir`` (the root)::

    latest                     name of the newest committed checkpoint, written last (:mod:`.commit`)
    .staging_step_000040/      a checkpoint being written; never read
    step_000020/
        trainer_state.json     the driver's state: step, sampler position, weight version, layout
        hf_metadata/           config.json, generation config and tokenizer files of the model
        megatron/              torch_dist shards: model weights and distributed-optimizer state
        scheduler.pt           the LR / weight-decay schedule (rank 0)
        rng/rank_00003.pt      each rank's generator states, Megatron's model-parallel ones included
        hf/                    optional (``checkpoint.export_hf``): a Hugging Face model directory
        carried_over.pt        with ``train.max_staleness`` > 0: the rollouts generated, not yet trained;
                               with partial rollouts: the groups whose responses are still generating

``megatron-rl convert hf-to-mcore`` writes the same ``hf_metadata/`` beside its torch_dist
files, so ``convert mcore-to-hf`` reads both kinds of directory (:func:`model_weight_dirs`).
This module imports nothing heavy: the CLI and the driver use it without torch or Megatron.
"""

from __future__ import annotations

from pathlib import Path

LATEST_FILE = "latest"
TRAINER_STATE_FILE = "trainer_state.json"
HF_METADATA_DIR = "hf_metadata"
MEGATRON_DIR = "megatron"
SCHEDULER_FILE = "scheduler.pt"
RNG_DIR = "rng"
HF_EXPORT_DIR = "hf"
CARRIED_OVER_FILE = "carried_over.pt"
MEGATRON_RNG_TRACKER_KEY = "megatron_rng_tracker"
"""Key of Megatron's model-parallel generator states among the extra states of a rank's RNG file."""


def rng_state_path(checkpoint_dir: str | Path, rank: int) -> Path:
    """``<checkpoint>/rng/rank_00003.pt``: one file per global rank."""
    return Path(checkpoint_dir) / RNG_DIR / f"rank_{rank:05d}.pt"


def model_weight_dirs(path: str | Path) -> tuple[Path, Path | None]:
    """(torch_dist weights, HF metadata or None for ``<weights>/hf_metadata``) of a checkpoint path.

    ``path`` is ``convert hf-to-mcore``'s output, a run checkpoint (``step_*``, weights under
    ``megatron/``), or a run's checkpoint root (its ``latest`` is used).
    """
    from megatron_rl.checkpoint.commit import latest_checkpoint

    checkpoint = Path(path)
    if (latest := latest_checkpoint(checkpoint)) is not None:
        checkpoint = latest
    if (checkpoint / MEGATRON_DIR).is_dir():
        return checkpoint / MEGATRON_DIR, checkpoint / HF_METADATA_DIR
    return checkpoint, None
