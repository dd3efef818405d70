"""A real one-node Slurm cluster for tests: munge, slurmctld and slurmd from Debian's packages.

Needs root and the packages ``munge slurmctld slurmd slurm-client`` (``.ci/run`` installs them).
Configuration, state and logs live in a temporary directory; ports are free ones picked at start.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def missing_requirements() -> str | None:
    """Why a local cluster cannot start here, or None when it can."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root"
    missing = [
        name for name in REQUIRED_BINARIES if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()
    ]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install munge slurmctld slurmd slurm-client"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ensure_munged() -> None:
    if subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode == 0:
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)


def _write_config(directory: Path, host: str) -> Path:
    for sub in ("state", "spool", "log"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    config = directory / "slurm.conf"
    # cred_expire: a requeued job may start again only after it (default 120 s). MinJobAge: `sbatch --wait`
    # polls after 2, 8, then 32 s each time, unless the poll interval reaches MinJobAge / 2 first (then 8 s).
    config.write_text(
        f"""ClusterName=local
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
MinJobAge=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd.log
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ReturnToService=2
SelectType=select/cons_tres
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    )
    return config


@contextmanager
def local_slurm(directory: Path, timeout_s: float = 60.0) -> Iterator[dict[str, str]]:
    """Start the cluster; yield the environment (``SLURM_CONF``) that Slurm commands need; stop it."""
    _ensure_munged()
    host = socket.gethostname().split(".")[0]
    config = _write_config(directory, host)
    env = os.environ | {"SLURM_CONF": str(config)}
    subprocess.run(["slurmctld", "-f", str(config)], env=env, check=True)
    subprocess.run(["slurmd", "-f", str(config)], env=env, check=True)
    try:
        deadline = time.monotonic() + timeout_s
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm node not idle within {timeout_s} s; logs in {directory / 'log'}")
            time.sleep(0.5)
        yield {"SLURM_CONF": str(config)}
    finally:
        for daemon in ("slurmd", "slurmctld"):
            pid_file = directory / f"{daemon}.pid"
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], check=False)
