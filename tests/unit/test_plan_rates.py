"""`megatron-rl plan RECIPE --rates REPORT.json`: measured rates replace the assumed ones in the GPU figures.

Each expected figure is the module's formula (docs in megatron_rl/plan/estimates.py) worked with the
measured value; the reports are written here as `megatron-rl preflight` writes them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.plan.estimates import (
    ASSUMED,
    EXPORT_MICROSECONDS_PER_TENSOR,
    FS_READ_GBPS,
    GENERATION_MFU,
    NETWORK_GBPS,
    NVLINK_GBPS,
    PEAK_BF16_TFLOPS,
    TRAINING_MFU,
    estimate_sync,
    forward_flops_per_token,
    gathered_bytes_per_gpu,
    with_measured,
)
from megatron_rl.plan.param_count import synced_model_bytes
from megatron_rl.plan.rates import RATE_NAMES, Rate
from tests.unit.test_memory_plan import ARCH_30B, RECIPE

ASYNC = RECIPE.with_name("qwen3_30b_a3b_dapo_async.yaml")  # disaggregated, distributed transport
DATE = "2025-06-01T12:00:00+00:00"
MODEL_BYTES = synced_model_bytes(ARCH_30B, None)  # bf16: both recipes sync the whole model in bf16
SOURCES = {
    "gemm_tflops": "devices: 8192^3 bf16 GEMM, slowest of 32 GPUs",
    "intra_node_gbps": "devices: all-gather of 1 GiB over 8 GPUs",
    "inter_node_gbps": "devices: broadcast of 1 GiB from node 0",
    "sync_gbps": "engines: the recipe's transport into 2 engines, model cut to 2 layers",
    "fs_write_gbps": "storage: 4 GiB written to runs/x",
    "fs_read_gbps": "storage: 4 GiB read from runs/x",
}


def _report(tmp_path: Path, rates: dict[str, float], name: str = "report.json", **fields: object) -> Path:
    """A report.json as preflight writes it, with ``rates`` (name -> value) measured."""
    units = {name: "TFLOP/s" if name == "gemm_tflops" else "GB/s" for name in RATE_NAMES}
    data = {
        "passed": True,
        "recipe": str(RECIPE),
        "overrides": [],
        "steps": [{"name": "install", "passed": True, "seconds": 0.5}],
        "not_reached": [],
        "rates": {n: {"value": v, "unit": units[n], "source": SOURCES[n]} for n, v in rates.items()},
        "date": DATE,
        **fields,
    }
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _plan(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["plan", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _seconds(out: str, title: str = "weight sync") -> tuple[float, float]:
    """The seconds a ``~ weight sync (...)`` line prints."""
    found = re.search(rf"~ {title} \(\w+\): .* -> ([\d.,]+)-([\d.,]+) s", out)
    assert found is not None, out
    low, high = found.groups()
    return float(low.replace(",", "")), float(high.replace(",", ""))


def _tokens_per_second(out: str) -> tuple[float, float]:
    found = re.search(r"~ tokens/s/GPU: ([\d,]+)-([\d,]+) ", out)
    assert found is not None, out
    low, high = found.groups()
    return float(low.replace(",", "")), float(high.replace(",", ""))


def _step_flops(recipe: Path) -> tuple[float, float, float]:
    """Tokens of one step per GPU of the cluster, trainer and engine: (tokens / 32, forward FLOPs per token,
    training forwards)."""
    cfg = load_recipe(recipe, [], require_files=False)[0]
    mean = (cfg.rollout.max_prompt_length + cfg.rollout.max_response_length) / 2
    tokens = cfg.train.prompts_per_step * cfg.rollout.n_samples_per_prompt * mean
    return tokens / 32, forward_flops_per_token(ARCH_30B, mean / 2), 5  # no KL, full recompute


def test_a_measured_sync_and_gemm_rate_set_the_colocated_recipes_figures(tmp_path, capsys):
    sync_gbps, gemm_tflops = 20.0, 600.0
    code, out, err = _plan(
        capsys, RECIPE, "--rates", _report(tmp_path, {"sync_gbps": sync_gbps, "gemm_tflops": gemm_tflops})
    )
    plain_code, plain, _ = _plan(capsys, RECIPE)
    assert code == plain_code and not err
    sync = MODEL_BYTES / (sync_gbps * 1e9)  # the whole sync: the model's bytes at the measured rate
    assert f"~ weight sync (tensor): {MODEL_BYTES / 1e9:.2f} GB into the engines at the rate preflight measured" in out
    assert _seconds(out) == pytest.approx((sync, sync), abs=0.005)
    # beside it, the tensor transport as modelled with every rate assumed
    assert _seconds(out, "weight sync modelled") == _seconds(plain)
    per_gpu, flops, forwards = _step_flops(RECIPE)  # colocated: generation and training on all 32 GPUs
    peak = gemm_tflops * 1e12
    fastest = per_gpu * flops / (GENERATION_MFU.value.high * peak) + per_gpu * flops * forwards / (
        TRAINING_MFU.value.high * peak
    )
    slowest = per_gpu * flops / (GENERATION_MFU.value.low * peak) + per_gpu * flops * forwards / (
        TRAINING_MFU.value.low * peak
    )
    assert _tokens_per_second(out) == pytest.approx((per_gpu / (slowest + sync), per_gpu / (fastest + sync)), abs=0.5)
    assert _tokens_per_second(out)[1] < _tokens_per_second(plain)[1]  # 600 of 989 TFLOP/s, a slower sync
    assert f"generation MFU: 0.02-0.08 of {gemm_tflops:g} TFLOP/s measured (" in out
    assert f": {gemm_tflops:g} TFLOP/s (measured by preflight: {SOURCES['gemm_tflops']})" in out
    assert f"weight sync into the engines: {sync_gbps:g} GB/s (measured by preflight: {SOURCES['sync_gbps']}" in out


def test_halving_the_measured_sync_rate_doubles_the_sync(tmp_path, capsys):
    fast = 40.0
    _, full, _ = _plan(capsys, RECIPE, "--rates", _report(tmp_path, {"sync_gbps": fast}, "full.json"))
    _, half, _ = _plan(capsys, RECIPE, "--rates", _report(tmp_path, {"sync_gbps": fast / 2}, "half.json"))
    assert _seconds(full)[0] == pytest.approx(MODEL_BYTES / (fast * 1e9), abs=0.005)
    assert _seconds(half)[0] == pytest.approx(2 * MODEL_BYTES / (fast * 1e9), abs=0.005)
    cfg = load_recipe(RECIPE, [], require_files=False)[0]
    fast_sync, slow_sync = (with_measured({"sync_gbps": Rate(r, "GB/s", "engines")}) for r in (fast, fast / 2))
    seconds = [estimate_sync(cfg, ARCH_30B, assumptions=a).seconds for a in (fast_sync, slow_sync)]
    assert seconds[1].low == pytest.approx(2 * seconds[0].low) and seconds[1].high == seconds[1].low
    # the rate stands for the recipe's own transport: a transport named is still modelled
    assert estimate_sync(cfg, ARCH_30B, "disk", assumptions=slow_sync) == estimate_sync(cfg, ARCH_30B, "disk")


def test_a_measured_nvlink_rate_sets_the_tensor_transports_gathers(tmp_path, capsys):
    nvlink = NVLINK_GBPS.value.low / 2  # half the assumed range's slow end
    _, out, _ = _plan(capsys, RECIPE, "--rates", _report(tmp_path, {"intra_node_gbps": nvlink}))
    gathered = gathered_bytes_per_gpu(ARCH_30B, load_recipe(RECIPE, [], require_files=False)[0].parallel)
    gathers = gathered / (nvlink * 1e9)  # twice the slowest assumed all-gathers
    assert f"all-gathers ({gathered / 1e9:.2f} GB) {gathers:.2f}-{gathers:.2f} s" in out
    _, plain, _ = _plan(capsys, RECIPE)
    assert _seconds(out)[1] > _seconds(plain)[1] and _tokens_per_second(out)[1] < _tokens_per_second(plain)[1]
    assert f"NVLink copy per GPU: {nvlink:g} GB/s (measured by preflight: {SOURCES['intra_node_gbps']})" in out
    assert EXPORT_MICROSECONDS_PER_TENSOR.line() in out and NETWORK_GBPS.line() in out  # still assumed
    assumed = ", ".join(name for name in RATE_NAMES if name != "intra_node_gbps")
    assert f"  rates: measured by preflight in {tmp_path / 'report.json'} ({DATE}) for intra_node_gbps; " in out
    assert f"; assumed: {assumed}\n" in out
    assert "  assumptions (measured ones say so; the rest assumed):" in out


def test_a_measured_network_rate_sets_the_distributed_sync(tmp_path, capsys):
    network = NETWORK_GBPS.value.low / 2
    _, out, err = _plan(capsys, ASYNC, "--rates", _report(tmp_path, {"inter_node_gbps": network}))
    assert not err
    broadcast = MODEL_BYTES / (network * 1e9)  # the whole model through one sender's NIC
    assert f"~ weight sync (distributed): {MODEL_BYTES / 1e9:.2f} GB through one sender's NIC" in out
    assert _seconds(out) == pytest.approx((broadcast, broadcast), abs=0.005)
    assert f"network per sending GPU: {network:g} GB/s (measured by preflight: {SOURCES['inter_node_gbps']})" in out
    # the pipelined step: the longer of generation (16 engine GPUs) and training (16 trainer GPUs), + sync
    per_gpu, flops, forwards = _step_flops(ASYNC)
    peak = PEAK_BF16_TFLOPS * 1e12
    generation = 2 * per_gpu * flops / (GENERATION_MFU.value.high * peak)
    training = 2 * per_gpu * flops * forwards / (TRAINING_MFU.value.high * peak)
    assert _tokens_per_second(out)[1] == pytest.approx(per_gpu / (max(generation, training) + broadcast), abs=0.5)
    # halving the rate again doubles the sync
    _, slower, _ = _plan(capsys, ASYNC, "--rates", _report(tmp_path, {"inter_node_gbps": network / 2}, "slow.json"))
    assert _seconds(slower)[0] == pytest.approx(2 * broadcast, abs=0.01)
    assert _tokens_per_second(slower)[1] < _tokens_per_second(out)[1]


def test_measured_filesystem_rates_set_the_disk_sync(tmp_path, capsys):
    write, read = 4.0, 8.0
    path = _report(tmp_path, {"fs_write_gbps": write, "fs_read_gbps": read})
    _, out, _ = _plan(capsys, RECIPE, "weight_sync.transport=disk", "--rates", path)
    disk = MODEL_BYTES / (write * 1e9) + MODEL_BYTES / (read * 1e9)
    assert _seconds(out) == pytest.approx((disk, disk), abs=0.005)
    assert f"shared filesystem read per node: {read:g} GB/s (measured by preflight: {SOURCES['fs_read_gbps']})" in out
    assert FS_READ_GBPS.line() not in out


def test_a_report_without_rates_changes_no_figure(tmp_path, capsys):
    path = _report(tmp_path, {}, date=None)
    code, out, _ = _plan(capsys, RECIPE, "--rates", path)
    plain_code, plain, _ = _plan(capsys, RECIPE)
    rates = f"  rates: measured by preflight in {path} for none; assumed: {', '.join(RATE_NAMES)}"
    assert rates in out.splitlines()  # no date in the report, none printed
    assert out.splitlines()[0] == f"# megatron-rl plan {RECIPE} --rates {path}"
    assert [line for line in out.splitlines()[1:] if line != rates] == plain.splitlines()[1:] and code == plain_code
    assert with_measured({}) == ASSUMED


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (json.dumps({"rates": {"bogus_gbps": {"value": 1.0, "unit": "GB/s", "source": "x"}}}), "unknown rates"),
        ("not json {", "is not a preflight report.json"),
        (json.dumps({"recipe": "x"}), "is not a preflight report.json"),
    ],
)
def test_a_bad_report_is_an_error_naming_the_file(tmp_path, capsys, text, says):
    path = tmp_path / "bad.json"
    path.write_text(text)
    code, out, err = _plan(capsys, RECIPE, "--rates", path)
    assert code == 1 and not out
    assert err.startswith(f"error: {path}") and says in err


def test_a_missing_report_is_an_error_naming_the_file(tmp_path, capsys):
    code, _, err = _plan(capsys, RECIPE, "--rates", tmp_path / "absent.json")
    assert code == 1 and err.startswith(f"error: {tmp_path / 'absent.json'} is not a preflight report.json")
