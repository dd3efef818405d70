"""Which plain ops give a row other bits when other rows are computed with it, on this device.

The reference engine's forward must be batch-invariant (``megatron_rl/engines/reference/invariant_ops.py``):
it runs every op over rows in calls of a fixed row count. This probe shows why, per device and
library version: for the engine's op shapes it computes three watched rows alone, then with 1 to
5,000 other rows after them, and lists the other-row counts at which the watched rows' bits change.
Compared: ``F.linear`` (the plain layer), ``torch.bmm`` of 16-row blocks (the engine's way on CPU
with one thread), RMS norm's mean of squares, the attention score ``matmul``, and the engine's own
``row_invariant_linear`` / ``rms_norm`` (which must never differ).

    PYTHONPATH=. .venv/bin/python scripts/probe_row_invariance.py [--device cuda] [--threads 1]

Prints one line per op and shape: ``differs at [counts]`` (empty: invariant at every count tried).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from megatron_rl.engines.reference.invariant_ops import blocked_bmm_linear, rms_norm, row_invariant_linear

COUNTS = [1, 2, 13, 16, 17, 100, 255, 600, 5000]


def differing_counts(op: Callable[[torch.Tensor], torch.Tensor], row_shape: tuple[int, ...], device: str) -> list[int]:
    """The counts of other rows (after three watched rows) at which ``op`` changes the watched rows' output."""
    generator = torch.Generator().manual_seed(0)
    watched = torch.randn(3, *row_shape, generator=generator).to(device)
    alone = op(watched)
    differing = []
    for count in COUNTS:
        others = torch.randn(count, *row_shape, generator=generator).to(device)
        if not torch.equal(op(torch.cat([watched, others]))[:3], alone):
            differing.append(count)
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    args = parser.parse_args()
    device = args.device
    torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}, {args.threads} intra-op thread(s)")
    generator = torch.Generator().manual_seed(1)
    for k, n in [(64, 64), (64, 32), (512, 1000), (1024, 1024), (2048, 512)]:
        weight = (0.1 * torch.randn(n, k, generator=generator)).to(device)
        for label, op in (
            ("F.linear", lambda x, w=weight: torch.nn.functional.linear(x, w)),
            ("bmm of 16-row blocks", lambda x, w=weight: blocked_bmm_linear(x, w)),
            ("row_invariant_linear", lambda x, w=weight: row_invariant_linear(x, w)),
        ):
            print(f"{label:>22} K={k:<5} N={n:<5} differs at {differing_counts(op, (k,), device)}")
    for dim in (16, 64, 2048):
        weight = torch.ones(dim, device=device)
        print(
            f"{'mean of squares':>22} D={dim:<5}         differs at "
            f"{differing_counts(lambda x: x.pow(2).mean(-1), (dim,), device)}"
        )
        print(
            f"{'rms_norm':>22} D={dim:<5}         differs at "
            f"{differing_counts(lambda x, w=weight: rms_norm(x, w, 1e-6), (dim,), device)}"
        )
    keys = torch.randn(2, 16, 64, generator=generator).to(device)
    print(
        f"{'attention scores':>22} [2,2,16]x[2,16,64] differs at "
        f"{differing_counts(lambda q: torch.matmul(q, keys), (2, 2, 16), device)}"
    )


if __name__ == "__main__":
    main()
