"""Pre-emption: SIGTERM or SIGUSR1 asks the driver to checkpoint at the next step boundary and exit 0.

Slurm sends ``SIGUSR1`` ahead of a time limit when the job asks for it
(``#SBATCH --signal=B:USR1@<seconds>`` in ``slurm/train.sbatch``, forwarded to the
driver by ``slurm/ray_cluster.sh``) and ``SIGTERM`` when it pre-empts or cancels a
job. The handler only records the signal; the driver finishes the step it is in
(generation, training, weight sync, validation, metrics), saves a checkpoint unless
that step just saved one, and returns. Started again (``--requeue`` does it on
Slurm), the run resumes from that checkpoint as from any other, bitwise-exact on CPU.
A second signal changes nothing: the step still ends and the checkpoint is still
written, so nothing on disk is left half done.

Whether a start stopped early or reached ``train.steps`` (a signal can land in the last
step) decides whether a requeue has work to do: the driver writes its stop notice to the
file named by ``MEGATRON_RL_STOPPED_EARLY_FILE`` (set by ``slurm/ray_cluster.sh``) only
when steps remain, and the script requeues the job only when that file is not empty.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
STOPPED_EARLY_FILE_ENV = "MEGATRON_RL_STOPPED_EARLY_FILE"


class PreemptionRequest:
    """Whether a pre-emption signal arrived, and which (``None`` until one does)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        """True once SIGTERM or SIGUSR1 arrived."""
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            print(f"# {self.signal_name} received: checkpointing at the end of this step, then stopping", flush=True)


@contextmanager
def preemption_requests() -> Iterator[PreemptionRequest]:
    """Record SIGTERM / SIGUSR1 while the block runs (previous handlers restored after it).

    Signal handlers can only be set from the main thread; elsewhere (a driver run from a
    worker thread, as some tests do) nothing is installed and the request never fires.
    """
    request = PreemptionRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request._handle) for sig in PREEMPTION_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.stdout.flush()


def record_stopped_early(notice: str) -> None:
    """Write ``notice`` to the file named by ``MEGATRON_RL_STOPPED_EARLY_FILE``, when that variable is set.

    Only a start that stopped with steps left calls this; the notice in the file is what tells
    ``slurm/ray_cluster.sh`` to requeue the job.
    """
    path = os.environ.get(STOPPED_EARLY_FILE_ENV)
    if path:
        Path(path).write_text(notice + "\n")
