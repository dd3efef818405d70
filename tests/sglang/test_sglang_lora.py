"""LoRA adapters on the real SGLang 0.5.23 (CPU, fp32) against transformers + peft and our reference engine.

SGLang on CPU serves adapters with ``--lora-backend torch_native`` (``config/sglang_pin.CPU_LORA_FLAGS``) once
pinned host memory is a no-op there (``engines/native/cpu_site``); ``docs/sglang-lora-cpu.md`` says what it serves
and what not. Two servers of their own, one after the other: the tiny dense Qwen3 with an adapter on every attention
and MLP projection, and the tiny Qwen3-MoE with one on attention (SGLang runs routed-expert LoRA only on its Triton
MoE runner). Each adapter has random A and B (PEFT starts B at zero, which would change nothing) and is loaded the
two ways a weight sync sends one: as tensors (the tensor transport's flattened bucket) and from a PEFT directory.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from megatron_rl.config.schema import LoRAConfig, LoRATarget
from megatron_rl.engines.engine import EngineRequestError
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import (
    GenerateRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    LoRASettings,
    LoRAUpdateResult,
    SamplingParams,
)
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.sglang_engine import SGLangEngine
from megatron_rl.wire.tensor_serialization import (
    FLATTENED_BUCKET,
    flattened_bucket,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from tests.reference_servers import serving
from tests.sglang.conftest import start_sglang
from tests.tiny_checkpoints import save_tiny_dense, save_tiny_moe

pytestmark = pytest.mark.full  # two servers of their own: 137-217 s each to start on 2 busy shared cores

ATTENTION: list[LoRATarget] = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS: dict[str, list[LoRATarget]] = {"dense": [*ATTENTION, "gate_proj", "up_proj", "down_proj"], "moe": ATTENTION}
RANK, ALPHA, MAX_RANK = 4, 8, 8
"""The adapters' rank and alpha; the engines accept ranks up to MAX_RANK (``--max-lora-rank``)."""
PROMPTS = [[3, 17, 42, 7, 99], [64]]
NEW_TOKENS = 10
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
LOGPROB_TOLERANCE = 1e-4
"""fp32 engines against an fp64 softmax of fp32 logits, as in test_generate.py: the adapter adds two rank-4 products
per projection, far below the ~100-term sums whose ~1e-7 relative error the bound covers."""


@dataclass(frozen=True)
class Served:
    """One model's SGLang engine and reference engine (LoRA on, nothing loaded), its PEFT adapter (as a model, its
    PEFT-named tensors, its config and a directory holding it)."""

    name: str
    sglang: SGLangEngine
    reference: HttpEngine
    peft_model: PeftModel
    tensors: list[tuple[str, torch.Tensor]]
    config: dict[str, Any]
    adapter_dir: Path

    @property
    def engines(self) -> tuple[HttpEngine, HttpEngine]:
        return self.sglang, self.reference


def _random_adapter(model_dir: Path, targets: list[LoRATarget]) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    modules: list[str] = list(targets)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=modules, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module", params=list(TARGETS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    name, root = request.param, tmp_path_factory.mktemp(f"lora-{request.param}")
    if name == "dense":
        model_dir = save_tiny_dense(root / "hf")
    else:
        model_dir = save_tiny_moe(root / "hf", max_position_embeddings=2048, all_sparse=True)
    targets = TARGETS[name]
    peft_model = _random_adapter(model_dir, targets)
    peft_model.save_pretrained(str(root / "adapter"))
    tensors = [(key, tensor.detach().clone()) for key, tensor in get_peft_model_state_dict(peft_model).items()]
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    lora = LoRAConfig(rank=MAX_RANK, alpha=ALPHA, target_modules=targets, max_loras_per_batch=2)  # base + one
    settings = LoRASettings(max_rank=MAX_RANK, target_modules=tuple(targets))
    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora=settings)
    sglang = start_sglang(model_dir, root / "logs", name=f"sglang-lora-{name}", lora=lora)
    try:
        with serving(backend, name=f"reference-lora-{name}") as reference:
            yield Served(name, sglang, reference, peft_model, tensors, config, root / "adapter")
    finally:
        sglang.shutdown()


NAMES = ("policy", "from-dir", "from-tensors")
"""Every adapter name the tests load (what :func:`adapters` unloads after each)."""


@pytest.fixture
def adapters(served: Served) -> Iterator[Served]:
    """``served``, with each of :data:`NAMES` that a test left loaded unloaded afterwards (SGLang lists no adapters
    in the answer to unloading one it lacks: those answers are the 400s passed over here)."""
    yield served
    for engine in served.engines:
        for name in NAMES:
            with contextlib.suppress(EngineRequestError):
                engine.unload_lora_adapter(name)


def _flattened(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """The tensors as one flattened bucket (the tensor transport's form): views of one storage, back to back."""
    storage = torch.cat([tensor.reshape(-1) for _, tensor in tensors])
    views, offset = [], 0
    for name, tensor in tensors:
        views.append((name, storage[offset : offset + tensor.numel()].view(tensor.shape)))
        offset += tensor.numel()
    bucket = flattened_bucket(views)
    assert bucket is not None, "views of one storage, back to back, make one flattened bucket"
    return serialize_flattened_bucket(*bucket)


def _load_tensors(engine: HttpEngine, served: Served, name: str, config: dict[str, Any] | None = None):
    request = LoadLoRAAdapterFromTensorsRequest(
        name, config or served.config, [_flattened(served.tensors)], load_format=FLATTENED_BUCKET
    )
    return engine.load_lora_adapter_from_tensors(request)


def _generate(engine: HttpEngine, prompt: list[int], lora_path: str | None, params: SamplingParams = GREEDY):
    [result] = engine.generate(GenerateRequest(prompt, params, lora_path=lora_path))
    return result


@torch.no_grad()
def _peft_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from transformers (+ peft), a full forward per token, fp64 softmax."""
    ids, logprobs = list(prompt), []
    for _ in range(NEW_TOKENS):
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
        ids.append(int(logp.argmax()))
        logprobs.append(float(logp[ids[-1]]))
    return ids[len(prompt) :], logprobs


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
def test_an_adapter_from_tensors_gives_peft_logprobs_on_both_engines_to_the_requests_naming_it(adapters, prompt):
    served = adapters
    for engine in served.engines:
        assert _load_tensors(engine, served, "policy").loaded_adapters == {"policy": "__tensor__"}
    expected = _peft_greedy(served.peft_model, prompt)
    with served.peft_model.disable_adapter():
        expected_base = _peft_greedy(served.peft_model, prompt)
    assert expected[0] != expected_base[0], "the adapter must change the greedy tokens for the test to mean anything"
    theirs, ours = (_generate(engine, prompt, "policy") for engine in served.engines)
    assert theirs.output_ids == ours.output_ids == expected[0]
    assert theirs.output_logprobs == pytest.approx(expected[1], abs=LOGPROB_TOLERANCE)
    assert ours.output_logprobs == pytest.approx(theirs.output_logprobs, abs=LOGPROB_TOLERANCE)
    assert theirs.weight_version == ours.weight_version == "default"  # a LoRA load sets no weight version
    base = _generate(served.sglang, prompt, None)
    assert base.output_ids == expected_base[0]
    assert base.output_logprobs == pytest.approx(expected_base[1], abs=LOGPROB_TOLERANCE)


def test_sampled_tokens_carry_the_adapted_models_full_softmax_logprobs(adapters):
    """What RL reads: temperature 1, no top-p/top-k, each sampled token's log-prob under the adapted policy."""
    served = adapters
    _load_tensors(served.sglang, served, "policy")
    prompt = PROMPTS[0]
    result = _generate(served.sglang, prompt, "policy", SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0))
    ids = prompt + result.output_ids
    with torch.no_grad():
        logits = served.peft_model(input_ids=torch.tensor([ids])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(result.output_ids)[:, None])
    assert result.output_logprobs == pytest.approx(expected[:, 0].tolist(), abs=LOGPROB_TOLERANCE)


def test_an_adapter_from_a_peft_directory_serves_as_it_does_from_tensors(adapters):
    served = adapters
    for engine in served.engines:
        result = engine.load_lora_adapter(LoadLoRAAdapterRequest("from-dir", str(served.adapter_dir)))
        assert result.loaded_adapters == {"from-dir": str(served.adapter_dir)}
        _load_tensors(engine, served, "from-tensors")
        from_dir, from_tensors = (_generate(engine, PROMPTS[0], name) for name in ("from-dir", "from-tensors"))
        assert from_dir.output_ids == from_tensors.output_ids
        assert from_dir.output_logprobs == pytest.approx(from_tensors.output_logprobs, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("served", ["dense"], indirect=True)
def test_a_batch_mixing_adapter_and_base_requests_gives_each_its_own_outputs(adapters):
    """torch_native's segments: requests of the adapter and of the base decoded together, each as when alone."""
    served = adapters
    _load_tensors(served.sglang, served, "policy")
    alone = {name: _generate(served.sglang, PROMPTS[0], name).output_ids for name in ("policy", None)}
    together: dict[str | None, list[int]] = {}
    threads = [
        threading.Thread(
            target=lambda n=name: together.__setitem__(n, _generate(served.sglang, PROMPTS[0], n).output_ids)
        )
        for name in ("policy", None) * 2
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone


@pytest.mark.parametrize("served", ["dense"], indirect=True)
def test_refusals_are_the_same_on_both_engines(adapters):
    """A name already loaded, a rank above --max-lora-rank, a target outside --lora-target-modules, generating with
    an adapter never loaded: 400 with the same answer from both engines."""
    served = adapters
    loads = [("policy", served.config), ("big", {**served.config, "r": 16})]
    loads.append(("head", {**served.config, "target_modules": ["lm_head"]}))
    answers = []
    for engine in served.engines:
        _load_tensors(engine, served, "policy")
        refusals = []
        for name, config in loads:
            with pytest.raises(EngineRequestError) as refused:
                _load_tensors(engine, served, name, config)
            assert refused.value.status == 400
            refusals.append(LoRAUpdateResult.from_json(json.loads(refused.value.body)))
        answers.append(refusals)
        with pytest.raises(EngineRequestError) as unknown:
            _generate(engine, PROMPTS[0], "missing")
        assert unknown.value.status == 400
        assert (
            "Got LoRA adapter that has never been loaded: missing" in json.loads(unknown.value.body)["error"]["message"]
        )
    assert answers[0] == answers[1]
    duplicate, *incompatible = answers[0]
    assert duplicate.error_message == "Failed to load LoRA adapter policy because it is already loaded"
    assert all("incompatible with the current LoRA memory pool" in (a.error_message or "") for a in incompatible)


@pytest.mark.parametrize("served", ["dense"], indirect=True)
def test_a_name_unloaded_and_loaded_again_serves_its_new_weights_on_both_engines(adapters):
    served = adapters
    zeros = [(name, torch.zeros_like(tensor)) for name, tensor in served.tensors]
    for engine in served.engines:
        request = LoadLoRAAdapterFromTensorsRequest(
            "policy", served.config, [_flattened(zeros)], load_format=FLATTENED_BUCKET
        )
        engine.load_lora_adapter_from_tensors(request)
        base = _generate(engine, PROMPTS[0], None)
        zero_adapter = _generate(engine, PROMPTS[0], "policy")
        assert zero_adapter.output_ids == base.output_ids  # B = 0: the adapter adds exactly nothing
        assert engine.unload_lora_adapter("policy").loaded_adapters == {}
        _load_tensors(engine, served, "policy")
        assert _generate(engine, PROMPTS[0], "policy").output_ids == _peft_greedy(served.peft_model, PROMPTS[0])[0]


@pytest.mark.parametrize("served", ["dense"], indirect=True)
def test_sglangs_answers_a_lora_sync_depends_on(adapters):
    """SGLang's own behaviour (``docs/sglang-lora-cpu.md``): an unload of an unknown name lists no adapters
    (``loaded_adapters`` null); a tensor payload without ``load_format`` must be a dict, not the list of pairs
    ``/update_weights_from_tensor`` reads; a request naming an unloaded adapter reloads it from its last path, so a
    PEFT directory is read again and a tensor adapter (path ``__tensor__``) fails."""
    engine, served = adapters.sglang, adapters
    with pytest.raises(EngineRequestError) as unknown:
        engine.unload_lora_adapter("never-loaded")
    assert json.loads(unknown.value.body) == {
        "rid": None,
        "http_worker_ipc": None,
        "success": False,
        "error_message": "LoRA with name never-loaded does not exist. Loaded LoRAs: odict_keys([])",
        "loaded_adapters": None,
    }
    with pytest.raises(EngineRequestError) as listed:
        engine.load_lora_adapter_from_tensors(
            LoadLoRAAdapterFromTensorsRequest("pairs", served.config, [serialize_named_tensors(served.tensors)])
        )
    assert "'list' object has no attribute 'items'" in listed.value.body
    engine.load_lora_adapter(LoadLoRAAdapterRequest("from-dir", str(served.adapter_dir)))
    _load_tensors(engine, served, "from-tensors")
    expected = _generate(engine, PROMPTS[0], "from-dir").output_ids
    for name in ("from-dir", "from-tensors"):
        engine.unload_lora_adapter(name)
    assert _generate(engine, PROMPTS[0], "from-dir").output_ids == expected  # reloaded from the directory
    with pytest.raises(EngineRequestError) as from_tensors:
        _generate(engine, PROMPTS[0], "from-tensors")
    assert from_tensors.value.status == 400
    assert "Failed to implicitly load LoRA adapter from-tensors" in from_tensors.value.body
