"""Seeded sampling on the real SGLang 0.5.23 (CPU): what is and is not reproducible there.

SGLang reads a request's ``sampling_seed`` only under ``--enable-deterministic-inference``
(``srt/sampling/sampling_batch_info.py``; ``rollout.deterministic_inference``), which it refuses on
this CPU: its CPU attention backend (``torch_native``) is not among the deterministic ones, and its
batch-invariant ops need CUDA or XPU even with another backend named. So here the rollout manager's
per-sample seeds reach the server and are ignored. That the seeds make samples distinct and repeatable
is tested on SGLang's own sampler in ``tests/unit/test_sglang_protocol.py``; on a GPU see
``docs/reliability.md`` (seeded sampling).
"""

from __future__ import annotations

import pytest

from megatron_rl.engines.engine import EngineStartupError
from megatron_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.partial import sample_seeds
from tests.sglang.conftest import start_sglang

N = 4


def _seeded(rid: str) -> GenerateRequest:
    """A group as the rollout manager sends it to SGLang: one sampling_params per sample, each seeded."""
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=N, ignore_eos=True)
    return GenerateRequest([5, 17, 42], params, rid=rid, sample_seeds=sample_seeds(1234 * 2**32 + 7, N))


# Full tier: it starts a server of its own to document a refusal of the pinned SGLang; runs never ask for it on CPU.
@pytest.mark.full
def test_deterministic_inference_is_refused_by_sglang_on_cpu(moe_dir, tmp_path):
    with pytest.raises(EngineStartupError, match="attention backends are supported for deterministic inference"):
        start_sglang(moe_dir, tmp_path, name="sglang-deterministic", api_key=None, deterministic_inference=True)


def test_per_sample_seeds_reach_sglang_and_without_deterministic_inference_do_not_repeat(sglang):
    """The per-sample body is served (one result per sample, each under its own id), but the same seeds drawn
    twice give other tokens: without deterministic inference SGLang samples from its own generator."""
    first = sglang.generate(_seeded("seeded-a"))
    second = sglang.generate(_seeded("seeded-b"))
    assert [r.rid for r in first] == [f"seeded-a_{i}" for i in range(N)]
    assert all(len(r.output_ids) == 8 and r.finish_reason.type == "length" for r in first + second)
    assert [r.output_ids for r in first] != [r.output_ids for r in second]
