"""The real SGLang 0.5.23's ``/weights_checker`` on CPU, and the reference engine's beside it.

On CPU, SGLang's ``compare`` always fails: its comparator moves every chunk with ``.cuda()``
(``srt/utils/weight_checker_comparator.py``), so the answer is a 400 whose message is torch's "Found no
NVIDIA driver on your system...", equal weights or not. Snapshot, reset and checksum work: a CPU preflight
reads its weights back as per-tensor checksums. The reference engine compares on its own device.
The tests run in file order: the first needs SGLang's server without a snapshot (a CPU compare never drops one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_rl.engines.engine import EngineRequestError
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import UpdateWeightsFromDiskRequest
from megatron_rl.engines.sglang_engine import SGLangEngine

NO_DRIVER = "Found no NVIDIA driver on your system"
SKIPPED = "embed_tokens"


def _failure(engine: HttpEngine, action: str) -> dict:
    with pytest.raises(EngineRequestError) as failed:
        engine.check_weights(action)
    assert failed.value.status == 400
    return json.loads(failed.value.body)


@pytest.fixture
def both(restore_weights: SGLangEngine, reference: HttpEngine, moe_dir: Path) -> Iterator[list[HttpEngine]]:
    """The session's two engines, both given the checkpoint's weights back after the test."""
    yield [restore_weights, reference]
    reference.update_weights_from_disk(UpdateWeightsFromDiskRequest(str(moe_dir), weight_version="default"))


def test_a_compare_without_a_snapshot_fails_with_an_empty_message_on_both_engines(sglang, reference):
    assert _failure(sglang, "compare") == _failure(reference, "compare") == {"success": False, "message": ""}


def test_a_snapshot_compares_equal_on_the_reference_engine_and_needs_a_gpu_on_sglang(sglang, reference):
    for engine in (sglang, reference):
        assert engine.check_weights("snapshot") == {"success": True, "message": "Success."}
    assert reference.check_weights("compare") == {"success": True, "message": "Success."}
    assert _failure(sglang, "compare")["message"].startswith(NO_DRIVER)


def test_a_reset_changes_every_checksum_but_the_skipped_and_a_reload_restores_them_on_both_engines(both, moe_dir):
    before = [engine.check_weights("checksum") for engine in both]
    for engine in both:
        engine.check_weights("snapshot")
        assert engine.check_weights("reset_tensors", skip_tensor_list=[SKIPPED]) == {
            "success": True,
            "message": "Success.",
        }
    reset = [engine.check_weights("checksum") for engine in both]
    sglang_failure, reference_failure = (_failure(engine, "compare")["message"] for engine in both)
    assert sglang_failure.startswith(NO_DRIVER)
    header, *lines = reference_failure.split("\n")
    assert header == "check tensor equality failed:" and lines and all(line.startswith("name=") for line in lines)
    for old, new in zip(before, reset, strict=True):
        assert set(old) == set(new) == {"success", "message", "ranks", "per_engine_checksum"}
        (old_rank,), (new_rank,) = old["ranks"], new["ranks"]
        assert not any(pattern in name for name in old_rank["checksums"] for pattern in ("inv_freq", "cos_sin"))
        changed = {name for name, value in old_rank["checksums"].items() if new_rank["checksums"][name] != value}
        assert changed == {name for name in old_rank["checksums"] if SKIPPED not in name}
    assert before[0]["ranks"][0]["parallelism_info"] == before[1]["ranks"][0]["parallelism_info"]
    for engine in both:
        engine.update_weights_from_disk(UpdateWeightsFromDiskRequest(str(moe_dir), weight_version="default"))
    assert [engine.check_weights("checksum") for engine in both] == before
    assert both[1].check_weights("compare") == {"success": True, "message": "Success."}
