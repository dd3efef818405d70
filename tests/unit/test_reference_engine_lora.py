"""The reference engine serves LoRA adapters as SGLang 0.5.23 does (``--enable-lora``).

An in-process reference server on a tiny Qwen3 (random weights) driven by the ``HttpEngine``
client: an adapter loaded from tensors (``/load_lora_adapter_from_tensors``) or from a PEFT
directory (``/load_lora_adapter``) changes exactly the requests that name it (``lora_path``) into
what transformers + peft compute with that adapter; refusals answer SGLang's 400 bodies. On the
tiny Qwen3-MoE the adapter also holds every routed expert's gate/up/down (PEFT's per-expert form).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.engines.engine import EngineRequestError
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import (
    GenerateRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    LoRASettings,
    SamplingParams,
)
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.lora_adapters import build_adapter
from megatron_rl.engines.reference.slot_model import SlotModel
from megatron_rl.models.lora_merge import merge_lora_weights
from megatron_rl.models.lora_peft import save_peft_adapter
from megatron_rl.wire.tensor_serialization import serialize_tensor_dict
from tests.lora_adapters import random_peft_adapter
from tests.reference_servers import serving
from tests.tiny_checkpoints import save_tiny_dense, save_tiny_moe

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": TARGETS, "lora_dropout": 0.0}
SETTINGS = LoRASettings(max_rank=8, target_modules=tuple(TARGETS))
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [3, 17, 42, 7, 99]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_tiny_dense(tmp_path_factory.mktemp("hf") / "dense")


@pytest.fixture(scope="module")
def peft_model(hf_dir) -> PeftModel:
    """The base model with a LoRA adapter whose A and B are both random (PEFT starts B at zero)."""
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _peft_state(model: PeftModel) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.detach().clone()) for name, tensor in get_peft_model_state_dict(model).items()]


def _expected(model: torch.nn.Module, steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, each step a full forward of transformers (+ peft)."""
    tokens, logprobs = list(PROMPT), []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
    return tokens[len(PROMPT) :], logprobs


@pytest.fixture
def served(hf_dir) -> Iterator[tuple[HttpEngine, ReferenceBackend]]:
    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), lora=SETTINGS)
    with serving(backend) as engine:
        yield engine, backend


def _load(engine: HttpEngine, name: str, named: list[tuple[str, torch.Tensor]], config=None):
    request = LoadLoRAAdapterFromTensorsRequest(name, config or CONFIG, [serialize_tensor_dict(dict(named))])
    return engine.load_lora_adapter_from_tensors(request)


def _generate(engine: HttpEngine, lora_path: str | None) -> tuple[list[int], list[float]]:
    [result] = engine.generate(GenerateRequest(PROMPT, GREEDY, lora_path=lora_path))
    return result.output_ids, result.output_logprobs


def _assert_matches(got: tuple[list[int], list[float]], expected: tuple[list[int], list[float]]) -> None:
    """Same tokens; log-probs within fp32 reassociation (the bound of test_reference_engine_batching's
    ``test_the_forward_computes_transformers_logits``: 1e-3 on logits, so on log-probs)."""
    assert got[0] == expected[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(expected[1]), atol=2e-3, rtol=0)


def test_an_adapter_from_tensors_gives_peft_outputs_only_to_requests_naming_it(served, peft_model):
    engine, _ = served
    result = _load(engine, "policy-v1", _peft_state(peft_model))
    assert result.success and result.loaded_adapters == {"policy-v1": "__tensor__"}
    with_adapter = _generate(engine, "policy-v1")
    _assert_matches(with_adapter, _expected(peft_model, GREEDY.max_new_tokens))
    with peft_model.disable_adapter():
        base = _expected(peft_model, GREEDY.max_new_tokens)
    _assert_matches(_generate(engine, None), base)
    assert with_adapter[0] != base[0], "the adapter must change the outputs for the test to mean anything"


def test_a_batch_mixing_adapter_and_base_requests_gives_each_its_own_outputs(served, peft_model):
    engine, backend = served
    _load(engine, "a", _peft_state(peft_model))
    alone = {name: _generate(engine, name) for name in ("a", None)}
    backend.pause("in_place")  # hold both so that they decode in the same steps
    results: dict[str | None, tuple[list[int], list[float]]] = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, _generate(engine, n))) for n in ("a", None)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while backend._in_flight < 2 and time.monotonic() < deadline:  # both admitted and held by the pause
        time.sleep(0.01)
    backend.resume_generation()
    for thread in threads:
        thread.join()
    assert results == alone


def test_loading_a_loaded_name_is_refused_with_sglangs_body(served, peft_model):
    engine, _ = served
    _load(engine, "policy", _peft_state(peft_model))
    with pytest.raises(EngineRequestError) as refused:
        _load(engine, "policy", _peft_state(peft_model))
    assert refused.value.status == 400
    assert json.loads(refused.value.body) == {
        "success": False,
        "error_message": "Failed to load LoRA adapter policy because it is already loaded",
        "loaded_adapters": {"policy": "__tensor__"},
    }


def test_unload_then_load_again_serves_the_new_adapter(served, peft_model):
    engine, _ = served
    state = _peft_state(peft_model)
    _load(engine, "policy", [(name, torch.zeros_like(t)) for name, t in state])
    assert engine.unload_lora_adapter("policy").loaded_adapters == {}
    _load(engine, "policy", state)
    _assert_matches(_generate(engine, "policy"), _expected(peft_model, GREEDY.max_new_tokens))


def test_an_adapter_from_a_peft_directory_equals_it_from_tensors(served, peft_model, tmp_path):
    engine, _ = served
    peft_model.save_pretrained(tmp_path / "adapter")
    result = engine.load_lora_adapter(LoadLoRAAdapterRequest("from-dir", str(tmp_path / "adapter")))
    assert result.loaded_adapters == {"from-dir": str(tmp_path / "adapter")}
    _load(engine, "from-tensors", _peft_state(peft_model))
    assert _generate(engine, "from-dir") == _generate(engine, "from-tensors")


def test_unknown_adapters_are_refused_as_sglang_refuses_them(served, peft_model):
    engine, _ = served
    with pytest.raises(EngineRequestError) as generating:
        _generate(engine, "missing")
    assert generating.value.status == 400
    assert "Got LoRA adapter that has never been loaded: missing" in generating.value.body
    with pytest.raises(EngineRequestError) as unloading:
        engine.unload_lora_adapter("missing")
    assert json.loads(unloading.value.body) == {  # raised in the tokenizer manager: no adapters listed
        "success": False,
        "error_message": "LoRA with name missing does not exist. Loaded LoRAs: odict_keys([])",
        "loaded_adapters": None,
    }


def test_rank_and_targets_beyond_the_engines_limits_are_refused(served, peft_model):
    engine, _ = served
    for config in ({**CONFIG, "r": 16}, {**CONFIG, "target_modules": ["lm_head"]}):
        with pytest.raises(EngineRequestError) as refused:
            _load(engine, "big", _peft_state(peft_model), config)
        assert "is incompatible with the current LoRA memory pool configuration" in refused.value.body


def test_an_engine_without_lora_refuses_adapters_with_sglangs_messages(hf_dir, peft_model):
    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32))
    with serving(backend) as engine:
        with pytest.raises(EngineRequestError) as loading:
            _load(engine, "policy", _peft_state(peft_model))
        assert json.loads(loading.value.body) == {
            "success": False,
            "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
            "loaded_adapters": None,
        }
        with pytest.raises(EngineRequestError) as generating:
            _generate(engine, "policy")
        assert "LoRA adapter 'policy' was requested, but LoRA is not enabled." in generating.value.body


MOE_LORA = LoRAConfig(rank=4, alpha=8.0)  # all seven targets (TARGETS)


@pytest.fixture(scope="module")
def moe_adapter(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The tiny Qwen3-MoE with every layer routed (peft 0.21's conversion to transformers' fused experts misses on a
    model mixing dense and MoE layers: measured 0.3 off on logits, where merged weights agree with this engine to
    1e-6, :func:`test_a_mixed_dense_and_moe_model_computes_what_its_merged_weights_compute`), a random adapter on all
    seven targets (every expert's gate/up/down, PEFT's per-expert names, as the trainer exports) and its PEFT
    directory."""
    root = tmp_path_factory.mktemp("moe")
    hf_dir = save_tiny_moe(root / "base", all_sparse=True)
    state = random_peft_adapter(parse_hf_config(load_hf_config(hf_dir)), MOE_LORA, seed=7)
    assert any(".mlp.experts.3.down_proj." in name for name in state)
    save_peft_adapter(root / "adapter", state, MOE_LORA, str(hf_dir))
    return hf_dir, root / "adapter", state


def test_an_adapter_on_routed_experts_gives_peft_outputs_and_leaves_the_base_requests_alone(moe_adapter):
    """Same bound as the dense tests (:func:`_assert_matches`): the expert deltas are rank-4 dot products added
    before the activation and the routing weight (<= 1), a few more fp32 reassociations of the same magnitude."""
    hf_dir, adapter_dir, state = moe_adapter
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, experts_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    expected = _expected(peft_model, GREEDY.max_new_tokens)
    with peft_model.disable_adapter():
        expected_base = _expected(peft_model, GREEDY.max_new_tokens)
    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), lora=SETTINGS)
    with serving(backend) as engine:
        _load(engine, "moe", list(state.items()))
        _load(engine, "no-experts", [(name, t) for name, t in state.items() if ".experts." not in name])
        with_adapter = _generate(engine, "moe")
        _assert_matches(with_adapter, expected)
        _assert_matches(_generate(engine, None), expected_base)
        assert with_adapter[0] != expected_base[0], "the adapter must change the outputs for the test to mean anything"
        assert _generate(engine, "no-experts") != with_adapter, "the experts' adapters must change the outputs"


def test_expert_adapters_are_checked_against_the_fused_experts(moe_adapter):
    hf_dir, _, state = moe_adapter
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    adapter = build_adapter("a", "p", CONFIG, list(state.items()), model)
    a, b = adapter.weights[(0, "experts.2.down_proj")]
    assert a.shape == (4, 16) and b.shape == (32, 4)  # moe_intermediate_size 16 -> hidden 32
    # SGLang serves the experts without the adapter when --lora-target-modules lacks gate_up_proj or down_proj
    without = build_adapter("a", "p", CONFIG, list(state.items()), model, serve_experts=False)
    assert set(without.weights) == {key for key in adapter.weights if not key[1].startswith("experts.")}
    kept = [(key, tensor) for key, tensor in state.items() if ".layers.0.mlp.experts.2.down_proj." not in key]
    for module, a_shape, message in [
        ("layers.0.mlp.experts.2.down_proj", (4, 32), r"layer 0 experts.2.down_proj lora_A \(4, 32\) / lora_B"),
        ("layers.0.mlp.experts.4.down_proj", (4, 16), "the layer has 4 experts"),
        ("layers.1.mlp.down_proj", (4, 16), "down_proj of layer 1, whose MLP has no down_proj"),
    ]:
        prefix = f"base_model.model.model.{module}"
        halves = [(f"{prefix}.lora_A.weight", torch.zeros(a_shape)), (f"{prefix}.lora_B.weight", torch.zeros(32, 4))]
        with pytest.raises(ValueError, match=message):
            build_adapter("a", "p", CONFIG, kept + halves, model)


def test_a_mixed_dense_and_moe_model_computes_what_its_merged_weights_compute(tmp_path):
    """Layer 1 dense (its MLP adapted as a dense one), the others routed experts: the forward with the adapter equals
    transformers on the checkpoint with ``W + scaling * B @ A`` merged, within the fp32 bound of
    test_reference_engine_batching's ``test_the_forward_computes_transformers_logits`` (1e-3 on logits)."""
    hf_dir = save_tiny_moe(tmp_path / "base")
    state = random_peft_adapter(parse_hf_config(load_hf_config(hf_dir)), MOE_LORA, seed=7)
    assert any(".layers.1.mlp.up_proj." in name for name in state) and any(".experts.3.up_proj." in n for n in state)
    merged = dict(
        merge_lora_weights(load_file(hf_dir / "model.safetensors").items(), state, MOE_LORA.alpha / MOE_LORA.rank)
    )
    merged_dir = Path(shutil.copytree(hf_dir, tmp_path / "merged"))
    save_file(merged, merged_dir / "model.safetensors")
    tokens = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(input_ids=tokens[None])
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    adapter = build_adapter("a", "p", CONFIG, list(state.items()), model)
    positions = torch.arange(len(PROMPT))
    slots = torch.zeros(len(PROMPT), dtype=torch.long)
    ours, _ = SlotModel(model, slots=1, context_length=16).forward(
        tokens, slots, positions, positions, [(adapter, positions)]
    )
    torch.testing.assert_close(ours, expected.logits[0].float(), atol=1e-3, rtol=0)
