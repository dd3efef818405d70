"""The batched reference engine: a response does not depend on which requests share its forward passes.

Which requests run together depends on timing, so exact resume and identical metrics between
placements need every response to be a function of its own request. Checked bitwise:

- the forward (``SlotModel``): a sequence's logits and routed experts computed alone equal
  those computed inside calls with other sequences (other slots, lengths, prefills and decodes,
  1 to 100+ tokens per call), on the test checkpoints, the tiny recipe's model and a wider one;
  a prompt fed at once equals it fed token by token (prefill and decode are the same maths);
- the engine (``ReferenceBackend``): each request answered alone equals the same request
  answered while other requests run (greedy and seeded sampling, n > 1, top-p/top-k, stop
  tokens, routed experts), in several arrival orders;
- the batched draw (``sample_rows``) picks, for every request, the tokens
  ``torch.multinomial(probs, 1, generator)`` on its own rows picks.

And the forward computes what transformers' Qwen3 / Qwen3-MoE compute, up to fp32 rounding.

The ops themselves (``invariant_ops``) are checked row by row for many row counts. Everything but the
sampler's tests runs on ``MEGATRON_RL_TEST_DEVICE`` (default cpu): ``scripts/device_check.py`` runs
this file with ``cuda`` on a GPU, where kernels are chosen differently.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.generator import INVALID_PROBABILITIES, RequestState, sample_rows
from megatron_rl.engines.reference.invariant_ops import (
    ROWS_PER_CALL,
    in_fixed_row_calls,
    needs_fixed_row_calls,
    rms_norm,
    row_invariant_linear,
    slot_attention,
)
from megatron_rl.engines.reference.slot_model import SlotModel

CONTEXT = 64
DEVICE = torch.device(os.environ.get("MEGATRON_RL_TEST_DEVICE", "cpu"))


@pytest.fixture(params=[1, 2] if DEVICE.type == "cpu" else [None], ids=lambda threads: f"threads={threads}")
def intra_op_threads(request) -> Iterator[None]:
    """On CPU, torch's intra-op threads: 1 (the blocked forms) and 2 (calls of ROWS_PER_CALL rows)."""
    before = torch.get_num_threads()
    if request.param is not None:
        torch.set_num_threads(request.param)
        assert needs_fixed_row_calls(DEVICE) == (request.param > 1)
    yield
    torch.set_num_threads(before)


def _randomised(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval().to(DEVICE)


def _moe(hidden: int, intermediate: int, experts: int, vocab: int, layers: int, **extra) -> PreTrainedModel:
    # transformers 5 declares no head_dim on Qwen3MoeConfig; it keeps it as an extra attribute, which the model reads
    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * intermediate,
        moe_intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=CONTEXT,
        **extra,
    )
    return _randomised(Qwen3MoeForCausalLM(config), seed=hidden)


MODELS = {
    # the tiny CPU recipe's model (recipes/base/tiny_moe_cpu.yaml)
    "tiny-recipe": lambda: _moe(64, 64, 4, 32, 2, norm_topk_prob=True),
    # the test checkpoints' MoE: a dense layer among sparse ones
    "moe-dense-layer": lambda: _moe(32, 16, 4, 100, 4, norm_topk_prob=True, mlp_only_layers=[1]),
    "wide": lambda: _moe(512, 256, 8, 1000, 2, norm_topk_prob=False),
    "dense-tied": lambda: _randomised(
        Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=100,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                tie_word_embeddings=True,
                max_position_embeddings=CONTEXT,
            )
        ),
        seed=1,
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request) -> torch.nn.Module:
    return MODELS[request.param]()


def _feed(slot_model: SlotModel, calls: list[list[tuple[int, int, int]]], watched_slot: int):
    """Run each call's (slot, position, token) triples; the watched slot's last-token logits and all its routing."""
    logits, routing = [], []
    for call in calls:
        slots, positions, tokens = (torch.tensor(column, device=DEVICE) for column in zip(*call, strict=True))
        mine = (slots == watched_slot).nonzero().flatten()
        mine = mine[positions[mine].argsort()]
        out, routed = slot_model.forward(tokens, slots, positions, mine[-1:])
        logits.append(out[0])
        if routed is not None:
            routing.append(routed[mine.cpu()])
    return logits, routing


def _sequence_calls(slot: int, tokens: list[int], prompt_len: int) -> list[list[tuple[int, int, int]]]:
    """A prefill of the first ``prompt_len`` tokens, then one decode call per further token."""
    prefill = [(slot, p, tokens[p]) for p in range(prompt_len)]
    return [prefill] + [[(slot, p, tokens[p])] for p in range(prompt_len, len(tokens))]


def test_a_sequence_computes_the_same_bits_alone_and_among_others(model, intra_op_threads):
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(vocab, (9,), generator=generator).tolist()
    alone = _feed(SlotModel(model, slots=40, context_length=CONTEXT), _sequence_calls(3, target, 5), watched_slot=3)
    for others, target_slot in ((1, 0), (7, 11), (30, 39)):
        calls = _sequence_calls(target_slot, target, 5)
        free = [s for s in range(40) if s != target_slot]
        for call_index, call in enumerate(calls):
            for other in free[:others]:  # other sequences: prefills of various lengths and single decodes
                length = int(torch.randint(1, 12, (1,), generator=generator))
                start = call_index * 12
                call.extend(
                    (other, start + p, int(torch.randint(vocab, (1,), generator=generator))) for p in range(length)
                )
            order = torch.randperm(len(call), generator=generator).tolist()
            calls[call_index] = [call[i] for i in order]
        together = _feed(SlotModel(model, slots=40, context_length=CONTEXT), calls, watched_slot=target_slot)
        for a, b in zip(alone[0], together[0], strict=True):
            assert torch.equal(a, b), f"logits differ with {others} other sequences"
        for a, b in zip(alone[1], together[1], strict=True):
            assert torch.equal(a, b), f"routed experts differ with {others} other sequences"


def test_a_prompt_fed_at_once_equals_it_fed_token_by_token(model):
    tokens = torch.randint(model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    at_once = _feed(SlotModel(model, slots=2, context_length=CONTEXT), [[(0, p, t) for p, t in enumerate(tokens)]], 0)
    stepwise = _feed(SlotModel(model, slots=2, context_length=CONTEXT), _sequence_calls(0, tokens, 1), 0)
    assert torch.equal(at_once[0][-1], stepwise[0][-1])
    if at_once[1]:
        assert torch.equal(at_once[1][0], torch.cat(stepwise[1]))


def test_the_forward_computes_transformers_logits(model):
    """Same maths as transformers' model, summed in another order: fp32 rounding only.

    Bound: each output is a chain of a few dozen fp32 dot products of <= 1,024 terms of magnitude
    <= ~10 (randomised weights at 0.15 scale); reassociating such a sum moves it by at most
    terms * eps * magnitude ~ 1e3 * 6e-8 * 10 = 6e-4 per operation in the worst case, and
    errors of independent operations do not line up: 1e-3 absolute on logits of magnitude ~10.
    """
    tokens = torch.randint(model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    expected = model(input_ids=tokens).logits[0].float()
    slot_model = SlotModel(model, slots=1, context_length=CONTEXT)
    positions = torch.arange(10, device=DEVICE)
    ours, _ = slot_model.forward(tokens[0], torch.zeros(10, dtype=torch.long, device=DEVICE), positions, positions)
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)


ROW_COUNTS = [1, 2, 3, 16, 17, 100, 127, 128, 129, 255, 256, 257, 600]
"""Rows computed with the watched ones: on both sides of ``ROWS_PER_CALL`` and its multiples."""


def _watched_among_others(watched: torch.Tensor, others: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``watched`` inserted in the middle of ``others`` (dim 0), on DEVICE; and where it starts."""
    at = others.shape[0] // 2
    return torch.cat([others[:at], watched, others[at:]]).to(DEVICE), at


@pytest.mark.parametrize(("k", "n", "bias"), [(64, 64, False), (64, 32, True), (512, 1000, False), (2048, 512, True)])
def test_a_linear_rows_result_does_not_depend_on_the_rows_computed_with_it(
    k: int, n: int, bias: bool, intra_op_threads: None
) -> None:
    generator = torch.Generator().manual_seed(k + n)
    weight = (0.1 * torch.randn(n, k, generator=generator)).to(DEVICE)
    bias_n = torch.randn(n, generator=generator).to(DEVICE) if bias else None
    watched = torch.randn(3, k, generator=generator)
    alone = row_invariant_linear(watched.to(DEVICE), weight, bias_n)
    for rows in ROW_COUNTS:
        x, at = _watched_among_others(watched, torch.randn(rows, k, generator=generator))
        assert torch.equal(row_invariant_linear(x, weight, bias_n)[at : at + 3], alone), f"{rows} other rows"


@pytest.mark.parametrize("shape", [(64,), (4, 16), (2048,)])
def test_a_norms_row_does_not_depend_on_the_rows_computed_with_it(
    shape: tuple[int, ...], intra_op_threads: None
) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=generator)).to(DEVICE)
    watched = torch.randn(3, *shape, generator=generator)
    alone = rms_norm(watched.to(DEVICE), weight, 1e-6)
    for rows in ROW_COUNTS:
        x, at = _watched_among_others(watched, torch.randn(rows, *shape, generator=generator))
        assert torch.equal(rms_norm(x, weight, 1e-6)[at : at + 3], alone), f"{rows} other rows"


def test_an_attention_tokens_result_does_not_depend_on_the_tokens_computed_with_it(intra_op_threads: None) -> None:
    generator = torch.Generator().manual_seed(3)
    slots, kv_heads, heads, dim = 8, 2, 4, 16
    keys, values = (torch.randn(slots, kv_heads, CONTEXT, dim, generator=generator).to(DEVICE) for _ in range(2))

    def tokens(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(count, heads, dim, generator=generator)
        return (
            q,
            torch.randint(slots, (count,), generator=generator),
            torch.randint(CONTEXT, (count,), generator=generator),
        )

    watched = tokens(3)
    watched_q, watched_slots, watched_positions = (t.to(DEVICE) for t in watched)
    alone = slot_attention(watched_q, keys, values, watched_slots, watched_positions, 0.25)
    for rows in ROW_COUNTS:
        others = tokens(rows)
        (q, at), (slot_ids, _), (positions, _) = (
            _watched_among_others(w, o) for w, o in zip(watched, others, strict=True)
        )
        out = slot_attention(q, keys, values, slot_ids, positions, 0.25)
        assert torch.equal(out[at : at + 3], alone), f"{rows} other tokens"


@pytest.mark.parametrize("rows", [0, 1, ROWS_PER_CALL - 1, ROWS_PER_CALL, ROWS_PER_CALL + 1, 600])
def test_fixed_row_calls_return_the_ops_rows(rows: int) -> None:
    """Each call gets exactly ROWS_PER_CALL rows, and every row comes back in place."""
    x = torch.randn(rows, 3, 2, generator=torch.Generator().manual_seed(rows))
    index = torch.arange(rows)
    calls = []

    def op(x_chunk: torch.Tensor, index_chunk: torch.Tensor) -> torch.Tensor:
        calls.append(x_chunk.shape[0])
        return x_chunk.sum(-1) * 2 + index_chunk[:, None]

    assert torch.equal(in_fixed_row_calls(op, x, index), x.sum(-1) * 2 + index[:, None])
    assert calls == [ROWS_PER_CALL] * max(1, -(-rows // ROWS_PER_CALL))


REQUESTS = [
    GenerateRequest([5, 17, 42], SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True), rid="greedy"),
    GenerateRequest([3, 8], SamplingParams(max_new_tokens=6, temperature=1.0, n=4, sampling_seed=11), rid="seeded-n4"),
    GenerateRequest(
        [7, 7, 1, 9, 2, 2, 2],
        SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9, top_k=10, n=3, sampling_seed=5),
        rid="top-p-k",
        return_routed_experts=True,
    ),
    GenerateRequest(
        [1],
        SamplingParams(max_new_tokens=9, temperature=1.0, n=2, sampling_seed=2, stop_token_ids=[3, 4, 5, 6]),
        rid="stops",
        return_routed_experts=True,
        routed_experts_start_len=1,
    ),
]


def _answer_key(answer: dict | list[dict]) -> list:
    answers = answer if isinstance(answer, list) else [answer]
    return [
        (a["output_ids"], a["meta_info"]["output_token_logprobs"], a["meta_info"].get("routed_experts"))
        for a in answers
    ]


def _concurrently(backend: ReferenceBackend, requests: list[GenerateRequest]) -> dict[str, list]:
    answers: dict[str, list] = {}
    start = threading.Barrier(len(requests))

    def run(request: GenerateRequest) -> None:
        start.wait()
        assert isinstance(request.rid, str)  # the test's requests are named
        answers[request.rid] = _answer_key(backend.generate(request))

    threads = [threading.Thread(target=run, args=(r,)) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers


def test_a_response_does_not_depend_on_the_requests_running_with_it():
    backend = ReferenceBackend(MODELS["moe-dense-layer"]())
    alone, steps_alone = {}, {}
    for request in REQUESTS:
        before = backend.slot_model.forward_calls
        alone[request.rid] = _answer_key(backend.generate(request))
        steps_alone[request.rid] = backend.slot_model.forward_calls - before
    assert len({str(v) for v in alone.values()}) == len(REQUESTS)
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3], [2, 0, 3]):
        before = backend.slot_model.forward_calls
        together = _concurrently(backend, [REQUESTS[i] for i in order])
        for rid, key in together.items():
            assert key == alone[rid], f"{rid} differs when run with {[REQUESTS[i].rid for i in order]}"
        steps = backend.slot_model.forward_calls - before
        assert steps < sum(steps_alone[REQUESTS[i].rid] for i in order), "the requests did not share steps"


def test_a_request_with_more_samples_than_slots_runs_alone_on_added_slots():
    """``max_running_requests`` below a request's n: the request waits for the engine to empty, then runs alone."""
    model = MODELS["moe-dense-layer"]()
    small, large = ReferenceBackend(model, max_running_requests=2), ReferenceBackend(model)
    requests = [REQUESTS[1], REQUESTS[0]]  # n = 4, then n = 1
    assert _concurrently(small, requests) == {r.rid: _answer_key(large.generate(r)) for r in requests}
    assert small.slot_model.slots == 4


def _sampling_owners(seed: int) -> list[tuple[RequestState, list[int], int]]:
    """Owners of rows: a greedy request, plain, top-k and top-p sampling, each with its own generator."""
    params = [
        SamplingParams(temperature=0.0, n=2),
        SamplingParams(temperature=1.0, n=5),
        SamplingParams(temperature=0.7, n=3, top_k=4),
        SamplingParams(temperature=1.3, n=4, top_p=0.8),
    ]
    owners = []
    for index, p in enumerate(params):
        generator = torch.Generator().manual_seed(seed * 10 + index)
        state = RequestState(GenerateRequest([1, 2], p), generator, set(), None)
        owners.append((state, list(range(p.n)), p.n))
    return owners


def test_the_batched_draw_is_torch_multinomial_on_each_requests_rows():
    """Bit for bit what one ``torch.multinomial`` per request draws, so responses did not change with batching."""
    for seed in range(20):
        owners, reference = _sampling_owners(seed), _sampling_owners(seed)
        logits = torch.randn(sum(rows for _, _, rows in owners), 32, generator=torch.Generator().manual_seed(seed)) * 3
        for _ in range(3):
            tokens, logprobs = sample_rows(logits, owners)
            expected, offset = [], 0
            for state, _, rows in reference:
                params, block = state.request.sampling_params, logits[offset : offset + rows]
                if params.temperature > 0:
                    scaled = block / params.temperature
                    if params.top_k > 0:
                        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
                        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                    if params.top_p < 1.0:
                        ordered, order = torch.sort(scaled, dim=-1, descending=True)
                        drop = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1) >= params.top_p
                        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
                    expected += torch.multinomial(scaled.softmax(-1), 1, generator=state.generator).squeeze(-1).tolist()
                else:
                    expected += block.argmax(-1).tolist()
                offset += rows
            assert tokens == expected
            temperatures = [s.request.sampling_params.temperature for s, _, rows in owners for _ in range(rows)]
            scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures])
            logp = torch.log_softmax(logits / scale[:, None], -1)
            assert logprobs == logp.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1).tolist()


def test_the_batched_draw_refuses_what_torch_multinomial_refuses():
    owners = _sampling_owners(0)
    logits = torch.zeros(sum(rows for _, _, rows in owners), 32)
    logits[3, 5] = float("nan")
    with pytest.raises(RuntimeError, match="probability tensor contains") as refused:
        sample_rows(logits, owners)
    with pytest.raises(RuntimeError, match="probability tensor contains") as torch_refused:
        torch.multinomial(logits[2:7].softmax(-1), 1)
    assert str(refused.value) == INVALID_PROBABILITIES and INVALID_PROBABILITIES in str(torch_refused.value)
