"""Generation tokens/s of the batched reference engine against serving one request at a time.

Three ways to generate the same requests, measured in the same run, interleaved (the box is
shared, so only ratios within one run mean anything), median of ``--repeats``:

* ``transformers, 1 at a time``: the engine before batching: one request at a time, its ``n``
  samples as one batch through transformers' own forward with its KV cache (the previous
  ``generate_samples`` loop, reproduced here as the baseline);
* ``batched, 1 at a time``: this engine (``ReferenceBackend``, in process, no HTTP) with one
  request in flight at a time: its batch-invariant forward, no batching across requests;
* ``batched, all in flight``: this engine with every request in flight at once (a thread per
  request, as the rollout manager keeps up to ``max_concurrent_requests`` in flight).

Workloads: the tiny recipe's model (``recipes/base/tiny_moe_cpu.yaml``: 2 layers, width 64, 4
experts top-2, vocabulary 32) and a wider one (width 512, 8 experts, vocabulary 4,096), each
with the recipe's generation settings (8 prompts x 16 samples, temperature 1, 12 new tokens,
prompts of 6-12 tokens) and with its validation's (64 prompts x 1 sample, greedy). EOS is
ignored so that every sample decodes all 12 tokens (a random-init model's lengths would vary
by method otherwise). One torch thread (the engine's default ``--num-threads``).

    PYTHONPATH=. .venv/bin/python benchmarks/reference_engine_batching.py [--repeats 5]

The last line: batched (all in flight) tokens/s over the one-at-a-time transformers engine's, on
the tiny recipe's training generation.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from benchmarks.tables import print_table
from megatron_rl.config import load_recipe
from megatron_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_rl.engines.reference.backend import ReferenceBackend

ROOT = Path(__file__).resolve().parents[1]
_RANDOM_INIT = load_recipe(ROOT / "recipes" / "tiny_moe_cpu_dapo.yaml")[0].model.random_init
assert _RANDOM_INIT is not None, "the tiny recipe builds its model from model.random_init"
TINY = {key: value for key, value in _RANDOM_INIT.items() if key != "architectures"}
"""The tiny recipe's model, as its ``model.random_init`` says."""
WIDE = TINY | dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=8)
MAX_NEW = 12


def _requests(prompts: int, n: int, temperature: float, vocab: int) -> list[GenerateRequest]:
    rng = torch.Generator().manual_seed(prompts * n)
    requests = []
    for index in range(prompts):
        length = int(torch.randint(6, 13, (1,), generator=rng))
        ids = torch.randint(vocab, (length,), generator=rng).tolist()
        params = SamplingParams(
            max_new_tokens=MAX_NEW, temperature=temperature, n=n, sampling_seed=index, ignore_eos=True
        )
        requests.append(GenerateRequest(ids, params, rid=f"r{index}"))
    return requests


@torch.no_grad()
def transformers_one_at_a_time(model: torch.nn.Module, requests: list[GenerateRequest]) -> int:
    """The engine before batching: each request's n samples through transformers' forward, one request at a time."""
    tokens = 0
    for request in requests:
        params = request.sampling_params
        assert params.sampling_seed is not None, "each request carries its seed (_requests)"
        generator = torch.Generator().manual_seed(params.sampling_seed)
        fed = torch.tensor([request.input_ids] * params.n)
        cache = None
        for _ in range(params.max_new_tokens):
            out = model(input_ids=fed, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            logits = out.logits[:, -1].float()
            temperature = params.temperature if params.temperature > 0 else 1.0
            logp = torch.log_softmax(logits / temperature, dim=-1)
            if params.temperature > 0:
                chosen = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator).squeeze(-1)
            else:
                chosen = logits.argmax(-1)
            logp.gather(-1, chosen[:, None]).tolist()
            fed = chosen[:, None]
            tokens += params.n
    return tokens


def engine_one_at_a_time(backend: ReferenceBackend, requests: list[GenerateRequest]) -> int:
    """This engine with one request in flight at a time."""
    tokens = 0
    for request in requests:
        answers = backend.generate(request)
        tokens += sum(len(a["output_ids"]) for a in (answers if isinstance(answers, list) else [answers]))
    return tokens


def engine_all_in_flight(backend: ReferenceBackend, requests: list[GenerateRequest]) -> int:
    """This engine with every request in flight at once (one client thread each)."""
    counts = [0] * len(requests)

    def run(index: int) -> None:
        answers = backend.generate(requests[index])
        counts[index] = sum(len(a["output_ids"]) for a in (answers if isinstance(answers, list) else [answers]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts)


def _timed(run: Callable[[], int]) -> float:
    started = time.perf_counter()
    tokens = run()
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, headline = [], 0.0
    for model_name, fields in (("tiny recipe", TINY), ("width 512", WIDE)):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)).eval()
        backend = ReferenceBackend(model)
        for workload, (prompts, n, temperature) in (("train 8x16", (8, 16, 1.0)), ("validation 64x1", (64, 1, 0.0))):
            requests = _requests(prompts, n, temperature, fields["vocab_size"])
            methods = {
                "transformers, 1 at a time": partial(transformers_one_at_a_time, model, requests),
                "batched, 1 at a time": partial(engine_one_at_a_time, backend, requests),
                "batched, all in flight": partial(engine_all_in_flight, backend, requests),
            }
            samples: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(args.repeats):
                for name, run in methods.items():
                    samples[name].append(_timed(run))
            base = statistics.median(samples["transformers, 1 at a time"])
            for name in methods:
                rate = statistics.median(samples[name])
                rows.append([model_name, workload, name, f"{rate:,.0f}", f"{rate / base:.2f}"])
            if (model_name, workload) == ("tiny recipe", "train 8x16"):
                headline = statistics.median(samples["batched, all in flight"]) / base
    print_table(["model", "workload", "method", "tokens/s (median)", "vs transformers 1 at a time"], rows)
    print(
        f"batched engine, all requests in flight, on the tiny recipe's training generation: {headline:.2f}x the "
        "tokens/s of the one-request-at-a-time engine"
    )


if __name__ == "__main__":
    main()
