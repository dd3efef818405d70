"""Errors of the rank launchers, importable without torch (the CLI catches them)."""


class RankFailedError(RuntimeError):
    """A local rank raised; ``traceback`` holds its full traceback text."""

    def __init__(self, rank: int, traceback: str) -> None:
        last_line = traceback.strip().splitlines()[-1] if traceback.strip() else "unknown error"
        super().__init__(f"rank {rank} failed: {last_line}")
        self.rank = rank
        self.traceback = traceback
