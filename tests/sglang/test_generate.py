"""``/generate`` on the real SGLang 0.5.23 (CPU, fp32) against transformers and against our reference engine."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from megatron_rl.engines.protocol import AbortRequest, GenerateRequest, GenerateResult, SamplingParams
from tests.sglang.transformers_decode import greedy, load_model

PROMPTS = [[5, 17, 42], [3, 9, 27, 81, 43, 29], [64]]
NEW_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
"""fp32 engine against an fp64 softmax of fp32 logits: both sum ~100 terms of ~1e-7 relative error."""


def _greedy(prompt: list[int], max_new_tokens: int = NEW_TOKENS, **params: Any) -> GenerateRequest:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **params)
    return GenerateRequest(prompt, sampling)


@pytest.fixture(scope="module")
def hf_model(moe_dir):
    return load_model(moe_dir)


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
def test_greedy_tokens_and_logprobs_equal_transformers(sglang, hf_model, prompt):
    (result,) = sglang.generate(_greedy(prompt))
    tokens, logprobs = greedy(hf_model, prompt, NEW_TOKENS)
    assert result.output_ids == tokens
    assert result.output_logprobs == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
    assert result.prompt_tokens == len(prompt) and result.finish_reason.type == "length"


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
def test_greedy_answers_equal_the_reference_engines(sglang, reference, prompt):
    """Differential: the same request to both engines gives the same tokens, log-probs and fields."""
    (ours,) = reference.generate(_greedy(prompt))
    (theirs,) = sglang.generate(_greedy(prompt))
    assert ours.output_ids == theirs.output_ids
    assert ours.output_logprobs == pytest.approx(theirs.output_logprobs, abs=LOGPROB_TOLERANCE)
    assert (ours.prompt_tokens, ours.finish_reason, ours.weight_version) == (
        theirs.prompt_tokens,
        theirs.finish_reason,
        theirs.weight_version,
    )


def test_a_stop_token_ends_the_sample_the_same_way_on_both_engines(sglang, reference):
    (free,) = sglang.generate(_greedy(PROMPTS[0]))
    stop = free.output_ids[3]
    first = free.output_ids.index(stop)
    request = GenerateRequest(
        PROMPTS[0], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=[stop])
    )
    answers = [engine.generate(request)[0] for engine in (sglang, reference)]
    for answer in answers:
        assert answer.output_ids == free.output_ids[: first + 1]  # no_stop_trim: the stop token is kept
        assert answer.finish_reason.type == "stop" and answer.finish_reason.matched == stop
    assert answers[0].output_logprobs == pytest.approx(answers[1].output_logprobs, abs=LOGPROB_TOLERANCE)


def test_n_samples_come_back_as_n_results_on_both_engines(sglang, reference):
    request = GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=6, temperature=1.0, n=4), rid="grp")
    for engine in (sglang, reference):
        results = engine.generate(request)
        assert [r.rid for r in results] == ["grp_0", "grp_1", "grp_2", "grp_3"]
        assert all(len(r.output_ids) == len(r.output_logprobs) <= 6 for r in results)
        assert all(r.prompt_tokens == len(PROMPTS[1]) for r in results)


def test_each_sample_of_a_group_is_reached_by_its_own_abort_on_both_engines(sglang, reference):
    """A group goes as a batch of one-sample requests ``{rid}_{i}`` (``GenerateRequest.to_json``): aborting one
    id ends that sample only; ``abort(rid)`` ends them all."""
    one = SamplingParams(max_new_tokens=800, temperature=1.0, ignore_eos=True, n=3)
    for engine in (sglang, reference):
        thread, answers = _generate_in_thread(engine, GenerateRequest([7, 8], one, rid="one"))
        time.sleep(RUNNING_S)
        engine.request("/abort_request", AbortRequest(rid="one_1").to_json())
        thread.join(REQUEST_TIMEOUT_S)
        assert [r.finish_reason.type for r in answers[0]] == ["length", "abort", "length"], engine.name
        thread, answers = _generate_in_thread(engine, GenerateRequest([7, 8], replace(LONG, n=3), rid="all"))
        time.sleep(RUNNING_S)
        engine.abort("all")
        thread.join(REQUEST_TIMEOUT_S)
        assert all(r.aborted and len(r.output_ids) < LONG.max_new_tokens for r in answers[0]), engine.name


def test_parallel_sampling_gets_fresh_ids_that_no_abort_reaches_on_both_engines(sglang, reference):
    """SGLang 0.5.23 (tokenizer_manager, parallel sampling) gives each of n > 1 samples of one prompt a new
    uuid and drops the rid, so neither it nor ``{rid}_{i}`` reaches them: why our client sends a batch."""
    body = {"input_ids": [7, 8], "rid": "par", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "n": 2}}
    for engine in (sglang, reference):
        answers: list = []
        thread = threading.Thread(
            target=lambda e=engine, a=answers: a.append(e.request("/generate", body, timeout_s=600))
        )
        thread.start()
        time.sleep(RUNNING_S)
        for rid in ("par", "par_0", "par_1"):
            engine.request("/abort_request", AbortRequest(rid=rid).to_json())
        thread.join(REQUEST_TIMEOUT_S)
        samples = answers[0]
        assert [a["meta_info"]["finish_reason"]["type"] for a in samples] == ["length", "length"], engine.name
        assert not any(a["meta_info"]["id"].startswith("par") for a in samples), engine.name


def test_sampled_logprobs_are_those_of_the_full_softmax(sglang, hf_model):
    """Temperature 1, no top-p/top-k: each sampled token's log-prob is transformers' log-softmax at that step."""
    import torch

    (result,) = sglang.generate(GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=1.0)))
    ids = PROMPTS[0] + result.output_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[len(PROMPTS[0]) - 1 : -1].gather(
        1, torch.tensor(result.output_ids)[:, None]
    )
    assert result.output_logprobs == pytest.approx(expected[:, 0].tolist(), abs=LOGPROB_TOLERANCE)


def _generate_in_thread(engine, request: GenerateRequest) -> tuple[threading.Thread, list[list[GenerateResult]]]:
    answers: list[list[GenerateResult]] = []
    thread = threading.Thread(target=lambda: answers.append(engine.generate(request)))
    thread.start()
    return thread, answers


LONG = SamplingParams(max_new_tokens=1900, temperature=1.0, ignore_eos=True)
"""About 10 s of decoding on CPU (about 5 ms a token here), so a request is still running when acted on."""
RUNNING_S = 1.0
REQUEST_TIMEOUT_S = 600
"""Time for a request to reach the engine before the test acts on it (an unknown rid is ignored)."""


def test_abort_by_rid_ends_the_request_with_finish_abort(sglang):
    thread, answers = _generate_in_thread(sglang, GenerateRequest([7, 8], LONG, rid="to-abort"))
    time.sleep(RUNNING_S)
    sglang.abort("to-abort")
    thread.join(REQUEST_TIMEOUT_S)
    (result,) = answers[0]
    assert result.aborted and len(result.output_ids) < LONG.max_new_tokens


def test_pause_with_abort_aborts_running_requests_and_continue_serves_again(sglang):
    thread, answers = _generate_in_thread(sglang, GenerateRequest([7, 8], LONG, rid="paused"))
    time.sleep(RUNNING_S)
    sglang.pause_generation("abort")
    thread.join(REQUEST_TIMEOUT_S)
    assert answers[0][0].aborted
    sglang.continue_generation()
    assert not sglang.generate(_greedy([7, 8], 3))[0].aborted


def test_pause_with_retract_holds_requests_until_continue(sglang):
    params = SamplingParams(max_new_tokens=800, temperature=1.0, ignore_eos=True)  # still running at the pause
    thread, answers = _generate_in_thread(sglang, GenerateRequest([7, 8], params, rid="held"))
    time.sleep(RUNNING_S)
    sglang.pause_generation("retract")
    sglang.flush_cache()  # accepted while paused with retract: what a weight sync does
    time.sleep(0.5)
    assert thread.is_alive() and not answers
    sglang.continue_generation()
    thread.join(REQUEST_TIMEOUT_S)
    (result,) = answers[0]
    assert not result.aborted and len(result.output_ids) == params.max_new_tokens
