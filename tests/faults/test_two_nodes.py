"""Two Ray nodes on one host: trainer ranks on one, the engine on the other, weights by broadcast between them;
and colocated engines on both, each fed by its own node's trainer rank (the tensor transport).

The test starts a Ray cluster of its own: a head on 127.0.0.2 and a second raylet on 127.0.0.3
(Linux routes all of 127/8 to the loopback interface), each with one CPU, on free ports (not
Ray's defaults, which other clusters on the machine may hold), in a temporary directory of its
own. Not 127.0.0.1: Ray 2.60 replaces that address (and ``localhost``) by the machine's outward
address wherever it reads one, unless its cluster mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
what a one-node run does), and with cluster mode off ``ray start --address`` refuses to add a node. A detached stand-in actor holds 0.6 of the second node's CPU, so the run's three 0.4-CPU
bundles fit only as two on the head (the trainer ranks, which take the first positions in node
order) and one on the second node (the engine). The tiny DAPO recipe runs there with
``cluster.nodes=2``, ``cluster.network_interface=lo``, a disaggregated engine and
``weight_sync.transport=distributed``, and the same recipe runs on one node (its own local Ray
on 127.0.0.1) at the same time.

Asserted: the run reports its trainer ranks on 127.0.0.2 and its engine at 127.0.0.3; the engine
served on 127.0.0.3 and joined the trainer ranks' broadcast groups at 127.0.0.2 (the weights
crossed between the nodes' addresses); the two runs log identical metrics (all but wall-clock
ones). Teardown kills only the processes this test started (the two ``ray start --block``
processes and everything below them), never ``ray stop``, which would stop every Ray on the
machine.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from megatron_rl.engines.reference.node_group import NODE_LOST_EXIT_CODE
from tests.e2e.tiny_runs import RUN, TWO_STEPS, read_metrics, run_env, train_command, without_wall_clock
from tests.ray_processes import RAY, free_ports, kill_tree, node_ports, ray_probe, wait_for_nodes
from tests.tiny_checkpoints import save_tiny_moe

HEAD_IP, SECOND_IP = "127.0.0.2", "127.0.0.3"
STAND_IN_CPUS = 0.6
NODE_UP_S = 100
OVERRIDES = [
    *TWO_STEPS,
    "logging.sinks=[jsonl]",
    "rollout.placement=disaggregated",
    "weight_sync.transport=distributed",
    "cluster.network_interface=lo",
]
pytestmark = pytest.mark.slow


@contextmanager
def _two_node_cluster(*, hold_second_node: bool = True) -> Iterator[dict[str, str]]:
    """A head on 127.0.0.2 and a raylet on 127.0.0.3 (with the stand-in holding 0.6 of its CPU, unless
    ``hold_second_node`` is False); yields the environment that reaches it."""
    temp_dir = tempfile.mkdtemp(prefix="mrl2n-")  # short: Ray's socket paths live under it
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    common = ["--num-cpus=1", "--num-gpus=0", "--object-store-memory=300000000", "--temp-dir", temp_dir]
    common += ["--disable-usage-stats", "--block"]
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, temp_dir, ignore_errors=True)  # runs last, once every process is gone
        address = _start_node(stack, env, Path(temp_dir), "head", lambda: _head_command(common), count=1)
        second = [RAY, "start", f"--address={address}", f"--node-ip-address={SECOND_IP}", *common]
        second += ['--resources={"second_node": 1}']
        _start_node(stack, env, Path(temp_dir), "second", lambda: ([*second, *node_ports()], address), count=2)
        if hold_second_node:
            _hold_second_node_cpus(env | {"RAY_ADDRESS": address})
        yield env | {"RAY_ADDRESS": address}


def _head_command(common: list[str]) -> tuple[list[str], str]:
    """The ``ray start`` line of a head on 127.0.0.2 on fresh ports, and the address it will serve."""
    gcs_port, client_port = free_ports(2)
    command = [RAY, "start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={gcs_port}"]
    command += ["--include-dashboard=false", f"--ray-client-server-port={client_port}", *node_ports(), *common]
    return command, f"{HEAD_IP}:{gcs_port}"


def _start_node(
    stack: ExitStack,
    env: dict[str, str],
    temp_dir: Path,
    name: str,
    launch: Callable[[], tuple[list[str], str]],
    *,
    count: int,
) -> str:
    """Start the node ``launch`` describes (its command line on fresh ports, and the cluster address it makes
    or joins) and return that address once the cluster has ``count`` live nodes. A node not up within
    NODE_UP_S (seen in CI for the head, every ray.init hanging for minutes, and for the second raylet, never
    joining) is killed and started once more on other ports; the second failure fails the test with the
    node's own output."""
    attempt = 0
    while True:
        attempt += 1
        command, address = launch()
        log = temp_dir / f"{name}-{attempt}.log"
        with log.open("w") as output:
            node = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            wait_for_nodes(env | {"RAY_ADDRESS": address}, count, timeout_s=NODE_UP_S)
        except AssertionError as error:
            kill_tree(node)
            if attempt == 2:
                raise AssertionError(f"{error}; the {name} node's output:\n{log.read_text()[-3000:]}") from error
            continue
        stack.callback(kill_tree, node)
        return address


def _hold_second_node_cpus(env: dict[str, str]) -> None:
    """A detached actor on the second node holding 0.6 CPU: only one 0.4-CPU bundle fits there."""
    code = f"""
@ray.remote(num_cpus={STAND_IN_CPUS}, resources={{"second_node": 1}})
class StandIn:
    def node(self):
        return ray.util.get_node_ip_address()
actor = StandIn.options(name="stand_in", lifetime="detached").remote()
print(ray.get(actor.node.remote()))
"""
    result = ray_probe(env, code)
    assert result.returncode == 0 and result.stdout.strip().endswith(SECOND_IP), result.stderr[-2000:]


def _start_run(cwd: Path, env: dict[str, str], *overrides: str, base: Sequence[str] = OVERRIDES) -> subprocess.Popen:
    cwd.mkdir()
    return subprocess.Popen(
        train_command([*base, *overrides]),
        cwd=cwd,
        env=env | {"PYTHONPATH": run_env()["PYTHONPATH"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _learned(cwd: Path) -> list[dict[str, float]]:
    return without_wall_clock(read_metrics(cwd / RUN))


def _finish(runs: dict[str, subprocess.Popen]) -> dict[str, tuple[str, str]]:
    outputs = {}
    for name, process in runs.items():
        try:
            outputs[name] = process.communicate(timeout=900)
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 0, f"{name}: {outputs[name][1][-4000:]}"
    return outputs


@pytest.mark.full
def test_ranks_on_one_node_the_engine_on_another_learn_as_on_one_node(tmp_path: Path) -> None:
    one_node_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with _two_node_cluster() as cluster_env:
        two_nodes = _start_run(tmp_path / "two_nodes", cluster_env, "cluster.nodes=2")
        one_node = _start_run(tmp_path / "one_node", one_node_env, "cluster.nodes=1")
        outputs = _finish({"two_nodes": two_nodes, "one_node": one_node})

    stdout = outputs["two_nodes"][0]
    placed = re.search(
        r"# network: interface lo; trainer ranks on ([\d.]+) x2; engines: reference0 at ([\d.]+):(\d+)", stdout
    )
    assert placed, stdout
    assert placed.group(1) == HEAD_IP and placed.group(2) == SECOND_IP  # ranks and engine on different nodes
    assert "# network: loopback (127.0.0.1); trainer ranks on 127.0.0.1 x2" in outputs["one_node"][0]

    log = (tmp_path / "two_nodes" / "runs" / "tiny-moe-cpu-dapo" / "logs" / "reference0.log").read_text()
    assert f"on http://{SECOND_IP}:{placed.group(3)} (API key required)" in log
    groups = re.findall(r"joining weight update group '(\w+)' at ([\d.]+):\d+", log)
    assert groups and {address for _, address in groups} == {HEAD_IP}, groups  # hosted by the ranks' node

    two, one = _learned(tmp_path / "two_nodes"), _learned(tmp_path / "one_node")
    assert [r["step"] for r in two] == [0, 1, 2]
    assert two == one


COLOCATED = [
    *TWO_STEPS,
    "logging.sinks=[jsonl]",
    "weight_sync.transport=tensor",
    "cluster.network_interface=lo",
    "cluster.cpu_engines=2",
    "parallel.ep=1",
]
FEED = re.compile(r"(reference\d) <- rank (\d) \(pid (\d+), ([\d.]+)\)")


@pytest.mark.full
def test_colocated_engines_on_two_nodes_are_fed_by_their_own_nodes_ranks_and_learn_as_on_one(tmp_path: Path) -> None:
    """The tiny colocated recipe with the tensor transport, one trainer rank and one engine per node (4
    bundles of 0.4 CPU on two 1-CPU nodes: two fit each): each engine's weights come only from the trainer
    rank on its own node (the engine logs the process its shared memory belongs to), and the run logs the
    same metrics as the same layout on one node. EP is 1 here so each node's rank holds every expert; the
    EP all-gather is proven in tests/distributed/test_full_model_export.py."""
    one_node_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with _two_node_cluster(hold_second_node=False) as cluster_env:
        two_nodes = _start_run(tmp_path / "two_nodes", cluster_env, "cluster.nodes=2", base=COLOCATED)
        one_node = _start_run(tmp_path / "one_node", one_node_env, "cluster.nodes=1", base=COLOCATED)
        outputs = _finish({"two_nodes": two_nodes, "one_node": one_node})

    stdout = outputs["two_nodes"][0]
    engines = dict(re.findall(r"(reference\d) at ([\d.]+):\d+", stdout))
    feeds = FEED.findall(stdout)
    assert [(name, int(rank)) for name, rank, _, _ in feeds] == [("reference0", 0), ("reference1", 1)], stdout
    assert {engines[name] for name in engines} == {HEAD_IP, SECOND_IP}
    logs = tmp_path / "two_nodes" / "runs" / "tiny-moe-cpu-dapo" / "logs"
    for name, _, pid, node in feeds:
        assert engines[name] == node  # the engine sits on its feeder's node
        senders = re.findall(r"weights for TP rank 0 come from process (\d+)", (logs / f"{name}.log").read_text())
        assert senders == [pid], (name, senders)  # every sync of the run came from that rank alone

    two, one = _learned(tmp_path / "two_nodes"), _learned(tmp_path / "one_node")
    assert [r["step"] for r in two] == [0, 1, 2]
    assert two == one


def test_an_engine_spanning_both_nodes_generates_syncs_and_restarts_whole(tmp_path: Path) -> None:
    """One reference engine of two node processes, one per Ray node (SGLang's --nnodes/--node-rank/--dist-init-addr
    launch, node 0 serving HTTP): its generations equal a one-node engine's for the same seeds; a distributed
    weight sync reaches both processes (each joined the broadcast group at its own rank and the nodes agree on
    the weight); SIGKILL of the second node's process fails the engine at once, naming the lost node, and a
    restart brings both processes back, generating as before (tests/faults/multinode_engine_scenario.py)."""
    model = save_tiny_moe(tmp_path / "moe")
    with _two_node_cluster(hold_second_node=False) as cluster_env:
        result = subprocess.run(
            [sys.executable, "-m", "tests.faults.multinode_engine_scenario", str(model), str(tmp_path / "logs")],
            env=cluster_env | {"PYTHONPATH": run_env()["PYTHONPATH"]},
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["nodes"] == [HEAD_IP, SECOND_IP] and seen["address"] == HEAD_IP  # node 0 serves HTTP
    assert seen["same_as_one_node"] is True
    assert seen["synced"] == [[0.25] * len(row) for row in seen["synced"]] and len(seen["synced"]) == 2
    assert f"exited with code {NODE_LOST_EXIT_CODE}" in seen["crash_error"], seen["crash_error"]
    assert "engine node 1 is gone" in seen["crash_error"]
    assert seen["new_pids_differ"] is True and seen["after_restart_same"] is True
    logs = tmp_path / "logs"
    node_logs = {path.name: path.read_text() for path in logs.glob("ref0*.log")}
    joined = re.findall(
        r"joining weight update group 'sync' at [\d.]+:\d+ as rank (\d) of 3", "".join(node_logs.values())
    )
    assert sorted(joined) == ["1", "2"], node_logs.keys()  # each node joined at rank_offset + its node rank
