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
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


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
