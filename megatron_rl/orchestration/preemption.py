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

``ray.init`` takes SIGTERM for itself (a ``sys.exit`` handler, and abseil's failure handler in the
driver's core worker, which chains to it): the driver's Ray start runs inside
:func:`handlers_kept_through_ray_init`, so SIGTERM reaches the request as SIGUSR1 does, whether Ray
starts locally or joins the cluster at ``RAY_ADDRESS``.

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


@contextmanager
def handlers_kept_through_ray_init() -> Iterator[None]:
    """SIGTERM and SIGUSR1 keep, through a ``ray.init`` in the block, the handlers they had before it.

    Ray 2.60's ``ray.init`` (``ray/_private/worker.py``, ``init``) first sets SIGTERM to ``sys.exit``
    through ``ray._private.utils.set_sigterm_handler``; the driver's core worker it then creates puts
    abseil's failure handler in front (in C, where Python does not see it), which prints a stack trace
    and calls the handler before it. Mid-step, that exit aborts the driver (exit 134, no checkpoint).
    Here Ray's ``sys.exit`` handler is never set (a signal during ``ray.init`` reaches the handler
    already there), and after the block the kept handlers are set again, ahead of abseil's. Off the
    main thread, where ``ray.init`` sets no handler either, the block runs as is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from ray._private import utils as ray_utils  # the driver's Ray; the rest of this module needs none

    # A handler set outside Python reads as None and cannot be set again from here.
    kept = {sig: handler for sig in PREEMPTION_SIGNALS if (handler := signal.getsignal(sig)) is not None}
    set_sigterm_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = _leave_sigterm_alone
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = set_sigterm_handler
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def _leave_sigterm_alone(handler: object) -> None:
    """Stands in for Ray's ``set_sigterm_handler`` during ``ray.init``: the handler in place stays."""


def record_stopped_early(notice: str) -> None:
    """Write ``notice`` to the file named by ``MEGATRON_RL_STOPPED_EARLY_FILE``, when that variable is set.

    Only a start that stopped with steps left calls this; the notice in the file is what tells
    ``slurm/ray_cluster.sh`` to requeue the job.
    """
    path = os.environ.get(STOPPED_EARLY_FILE_ENV)
    if path:
        Path(path).write_text(notice + "\n")
