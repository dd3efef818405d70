"""``megatron-rl sandbox-server`` in a process of its own, and the python tool's client speaking SandboxFusion's API to it.

The server is the real command (``python -m megatron_rl.cli sandbox-server``, a free port, an API key); the
client is :func:`megatron_rl.tools.sandbox_service.run_remote` and the python tool pointed at the server. Its
``/health`` counts the runs it served, which proves the code ran there. The last test runs the tools recipe's
episode (``tool_calls`` with ``python``) through the rollout manager and a reference engine with
``rollout.tool_sandbox.url`` set to the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.engines.access import API_KEY_ENV, UNAUTHORIZED_BODY
from megatron_rl.tools.python_tool import LIMITS, python
from megatron_rl.tools.sandbox import SandboxLimits, SandboxResult, StopReason
from megatron_rl.tools.sandbox_service import (
    SandboxService,
    SandboxServiceError,
    result_of_response,
    run_code_request,
    run_code_response,
    run_remote,
    service_in_use,
)
from tests.unit.test_sandbox_hostile import UNDER_A_FILTER

REPO = Path(__file__).resolve().parents[2]
KEY = "test-sandbox-key"
WORKERS = 2
SMALL = SandboxLimits(cpu_time_s=1, wall_time_s=2, memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The base URL of a sandbox server process with WORKERS workers requiring KEY."""
    command = [sys.executable, "-m", "megatron_rl.cli", "sandbox-server", "--port", "0", "--workers", str(WORKERS)]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, API_KEY_ENV: KEY},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # "# sandbox-server: http://127.0.0.1:PORT (...)", printed once it listens
    if not line.startswith("# sandbox-server: http://"):
        process.kill()
        pytest.fail(f"the server did not start: {line!r} {process.communicate()[1][-2000:]}")
    try:
        yield line.split()[2]
    finally:
        process.terminate()
        process.wait(timeout=30)


def _service(url: str, **fields: Any) -> SandboxService:
    return SandboxService(url, **{"timeout_s": 60.0, "retries": 0, "api_key": KEY, **fields})


def _post(url: str, body: dict[str, Any], key: str | None = KEY) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + "/run_code", json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:  # open without a key, as the engines'
        return json.loads(answer.read())


def test_hello_world_in_sandboxfusions_shapes(server: str) -> None:
    status, response = _post(server, run_code_request("print('hello')", SMALL))
    assert status == 200
    assert response["status"] == "Success" and response["message"] == "" and response["compile_result"] is None
    run = response["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 0, "hello\n", "")
    assert run["execution_time"] > 0 and response["files"] == {} and response["stopped"] is None
    assert run_remote("print('hello')", SMALL, _service(server)) == SandboxResult("hello\n", "", 0, None)


def test_a_timeout_is_time_limit_exceeded(server: str) -> None:
    status, response = _post(server, run_code_request("import time; time.sleep(30)", SMALL))
    assert status == 200 and response["status"] == "Failed"
    assert response["run_result"]["status"] == "TimeLimitExceeded" and response["stopped"] == "wall_time"
    assert response["run_result"]["execution_time"] < 10  # the request's run_timeout, not the server's default


STOPS: tuple[StopReason, ...] = ("cpu_time", "wall_time", "memory", "processes", "file_size", "disk", "output")


@pytest.mark.parametrize("stopped", STOPS)
def test_each_stop_maps_onto_sandboxfusions_statuses_and_back(stopped: StopReason) -> None:
    exit_code = {"cpu_time": -24, "wall_time": None, "output": None}.get(stopped, 1)
    result = SandboxResult("out\n", "err\n", exit_code, stopped)
    response = run_code_response(result, 1.5)
    timed_out = stopped in ("cpu_time", "wall_time")
    assert response["status"] == "Failed" and response["run_result"]["return_code"] == exit_code
    assert response["run_result"]["status"] == ("TimeLimitExceeded" if timed_out else "Finished")
    assert result_of_response(json.loads(json.dumps(response))) == result
    sandboxfusions = {key: value for key, value in response.items() if key != "stopped"}  # no field of ours
    expected: StopReason | None = "wall_time" if timed_out else None  # stderr names no limit here
    assert result_of_response(sandboxfusions) == replace(result, stopped=expected)


def test_an_exception_fails_with_its_traceback(server: str) -> None:
    result = run_remote("print('before')\nraise ValueError('boom')", SMALL, _service(server))
    assert (result.stdout, result.exit_code, result.stopped) == ("before\n", 1, None)
    assert result.stderr.endswith("ValueError: boom\n")
    status, response = _post(server, run_code_request("raise ValueError('boom')", SMALL))
    assert (status, response["status"], response["run_result"]["status"]) == (200, "Failed", "Finished")


def test_the_requested_memory_limit_stops_the_code(server: str) -> None:
    result = run_remote("x = bytearray(512 << 20)", SMALL, _service(server))  # over the request's 256 MiB
    assert result.stopped == "memory" and result.stderr.endswith("MemoryError\n")
    assert run_remote("x = bytearray(512 << 20); print(len(x))", LIMITS, _service(server)).stdout == "536870912\n"


def test_a_wrong_or_missing_key_is_refused(server: str) -> None:
    before = _health(server)["served"]
    for key in ("wrong", None):
        assert _post(server, run_code_request("print(1)", SMALL), key=key) == (401, UNAUTHORIZED_BODY)
    with pytest.raises(SandboxServiceError, match="HTTP 401"):
        run_remote("print(1)", SMALL, _service(server, api_key="wrong"))
    assert _health(server)["served"] == before  # nothing ran


def test_another_language_or_request_field_is_a_sandbox_error(server: str) -> None:
    status, response = _post(server, {"code": "int main() {}", "language": "cpp"})
    assert status == 200 and response["status"] == "SandboxError" and "only 'python'" in response["message"]
    assert response["run_result"]["status"] == "Error"
    status, response = _post(server, {**run_code_request("print(1)", SMALL), "files": {"a.txt": "eA=="}})
    assert response["status"] == "SandboxError" and "files" in response["message"]
    assert _post(server, {"language": "python"})[0] == 422


def test_concurrent_requests_run_at_most_workers_at_once(server: str) -> None:
    code = "import time; time.sleep(1); print('done')"
    with ThreadPoolExecutor(3 * WORKERS) as pool:
        results = list(pool.map(lambda _: run_remote(code, SMALL, _service(server)), range(3 * WORKERS)))
    assert all(result == SandboxResult("done\n", "", 0, None) for result in results)
    health = _health(server)
    assert health["workers"] == WORKERS and health["max_running"] == WORKERS and health["running"] == 0


CODES = {
    "prints": "print(sum(range(10)))",
    "raises": "print('partial')\nraise KeyError('k')",
    "memory": "x = bytearray(2 << 30)",
    "output": "print('x' * 40000)",
    "exits": "import sys; sys.stderr.write('bad\\n'); sys.exit(3)",
}


@pytest.mark.parametrize("case", sorted(CODES))
def test_the_python_tool_reads_the_same_through_the_server_as_locally(server: str, case: str) -> None:
    arguments = {"code": CODES[case]}
    local = python(arguments, {})
    served = _health(server)["served"]
    with service_in_use(_service(server)):
        remote = python(arguments, {})
    assert _health(server)["served"] == served + 1  # it ran there
    assert (remote, type(remote)) == (local, type(local))


def test_the_client_retries_a_5xx_and_gives_up_on_a_closed_port(server: str) -> None:
    answers = [(503, b"busy")]
    forwarded: list[bytes] = []

    class Flaky(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            status, data = answers.pop() if answers else _forward(server, body)
            forwarded.append(body)
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with HTTPServer(("127.0.0.1", 0), Flaky) as flaky:
        thread = threading.Thread(target=flaky.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{flaky.server_address[1]}"
        assert run_remote("print(7)", SMALL, _service(url, retries=1)).stdout == "7\n"
        flaky.shutdown()
    assert len(forwarded) == 2
    with pytest.raises(SandboxServiceError, match=r"cannot connect.*after 2 retries"):
        run_remote("print(7)", SMALL, _service(url, retries=2))  # the port is closed now


def _forward(url: str, body: bytes) -> tuple[int, bytes]:
    status, response = _post(url, json.loads(body))
    return status, json.dumps(response).encode()


def test_the_server_refuses_to_start_without_a_key_or_where_the_sandbox_cannot_run() -> None:
    def start(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, *argv, "sandbox-server", "--port", "0"]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)

    no_key = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    refused = start("-m", "megatron_rl.cli", env=no_key)
    assert refused.returncode == 1 and f"needs an API key: ${API_KEY_ENV} is unset" in refused.stderr
    refused = start("-c", UNDER_A_FILTER, env={**no_key, API_KEY_ENV: KEY})
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert "error: the sandbox cannot run on this machine, so it cannot serve it: cannot set up" in refused.stderr


def test_validate_accepts_the_python_tool_where_only_the_service_can_run_it() -> None:
    recipe = ("recipes/tiny_moe_cpu_dapo_tools.yaml", "rollout.tools=[python]")  # its data files exist here
    argv = ["validate", "--strict", *recipe, "rollout.tool_sandbox.url=http://127.0.0.1:9"]
    result = subprocess.run(
        [sys.executable, "-c", UNDER_A_FILTER, *argv], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "cannot run on this machine" not in result.stderr, result.stderr[-2000:]


def test_the_tools_recipes_episodes_run_their_code_on_the_server(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import AddedToken

    from megatron_rl.config import load_recipe
    from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig, ToolSandboxConfig
    from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
    from megatron_rl.engines.reference.backend import ReferenceBackend
    from megatron_rl.rollout.episodes import build_episode
    from megatron_rl.tools.calls import render_tool_responses
    from tests.multi_turn_cases import RecordingEngine
    from tests.qwen3_chat import build_qwen3_like_tokenizer
    from tests.reference_servers import serving
    from tests.rollout_managers import build_manager
    from tests.tiny_checkpoints import chain_model, save_tiny_moe

    recipe, _ = load_recipe(REPO / "recipes/qwen3_30b_a3b_dapo_tools.yaml", [], require_files=False)
    assert (recipe.rollout.episode, recipe.rollout.tools) == ("tool_calls", ["python"])
    tokenizer = build_qwen3_like_tokenizer()
    codes = ("print(6 * 7)", "print(sum(range(5)))")
    calls = [
        '<tool_call>\n{"name": "python", "arguments": ' + json.dumps({"code": code}) + "}\n</tool_call>"
        for code in codes
    ]
    blocks = ["Two runs.\n", calls[0], "\n" + calls[1]]
    tokenizer.add_tokens([AddedToken(block, special=False, normalized=False) for block in blocks])
    prompt = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "6 * 7?"}], add_generation_prompt=True, return_dict=False
        )
    )
    block_ids = tokenizer.convert_tokens_to_ids(blocks)
    assert isinstance(block_ids, list)  # a list of tokens gives a list of ids
    turn = [*block_ids, tokenizer.eos_token_id]
    path = save_tiny_moe(tmp_path / "moe", vocab_size=512, max_position_embeddings=256)
    model = chain_model(path, [prompt[-1], *turn], len(tokenizer))
    rollout = RolloutConfig(
        engine="reference",
        n_samples_per_prompt=2,
        max_response_length=128,
        max_concurrent_requests=2,
        episode=recipe.rollout.episode,
        tools=recipe.rollout.tools,
        tool_timeout_s=recipe.rollout.tool_timeout_s,
        max_tool_calls_per_turn=recipe.rollout.max_tool_calls_per_turn,
        tool_num_workers=2,
        max_turns=2,
        tool_sandbox=ToolSandboxConfig(url=server),
    )
    served = _health(server)["served"]
    monkeypatch.setenv(API_KEY_ENV, KEY)  # the run's key, which the tool workers send
    episode = build_episode(rollout, tokenizer)
    try:
        with serving(ReferenceBackend(model)) as http:
            engine = RecordingEngine(http)
            manager = build_manager(
                [engine],
                PromptDataset([PromptItem(0, prompt, "42", "test")], 0),
                PromptSampler(1, 1, seed=0, shuffle=False),
                rollout,
                OverlongConfig(enable=False),
                DynamicSamplingConfig(enable=False),
                prompts_per_step=1,
                reward="tests.rollout_rewards:first_token_parity",
                reward_num_workers=1,
                reward_timeout_s=30.0,
                decode=lambda ids: str(tokenizer.decode(ids)),
                routing_replay=False,
                seed=3,
                episode=episode,
                recover=lambda failures: [engine],
            )
            try:
                samples = [sample for group in manager.generate_step(1).groups for sample in group.samples]
            finally:
                manager.close()
    finally:
        episode.close()
    reply = tokenizer.encode(render_tool_responses(["42\n", "10\n"]), add_special_tokens=False)
    assert len(samples) == 2
    for sample in samples:
        assert sample.response_ids == [*turn, *reply, *turn]  # the second turn's calls: the last turn, not run
        assert sample.turns == 2 and sample.tools.calls == 2 and sample.tools.errors == 0
    assert _health(server)["served"] == served + 2 * len(codes)  # every call of both samples ran on the server
