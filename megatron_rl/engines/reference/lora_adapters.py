"""LoRA adapters of the reference engine, served as SGLang 0.5.23 serves them (``--enable-lora``).

An adapter (:class:`LoRAAdapter`) holds, per (layer, projection), PEFT's ``lora_A`` [r, in] and
``lora_B`` [out, r] and the scaling ``lora_alpha / r`` (``srt/lora/lora.py:71``); a request naming it
adds ``scaling * B @ A @ x`` to that projection's output for its tokens
(:meth:`~megatron_rl.engines.reference.slot_model.SlotModel.forward`). Served projections: the
attention's ``q/k/v/o_proj``, a dense MLP's ``gate/up/down_proj`` and each routed expert's, in PEFT's
per-expert form (``mlp.experts.{e}.gate_proj``, which our trainer exports): SGLang's ``FusedMoEWithLoRA``
(``srt/lora/layers.py``) adds the stacked gate/up delta before the activation and the down delta before
the routing weight, with B scaled by ``lora_alpha / r`` (``srt/lora/mem_pool.py``), which is PEFT's
per-expert maths. As SGLang's ``init_lora_modules`` (``srt/lora/lora_manager.py``), experts are served
their adapter only when ``--lora-target-modules`` holds both ``gate_up_proj`` and ``down_proj`` (or
``all``); otherwise an adapter's expert weights are loaded and not applied.

:class:`LoRARegistry` keeps the loaded adapters by name and refuses as SGLang does, with its
messages: LoRA not enabled (``srt/managers/tokenizer_control_mixin.py:667-670``), DoRA or added
tokens (``srt/lora/lora_manager.py:337-349``), a name already loaded (``lora_manager.py:354-359``), a
rank above ``--max-lora-rank`` or targets outside ``--lora-target-modules`` (``lora_manager.py:366-373``,
``srt/lora/mem_pool.py:238-259``), unloading an unknown name (``srt/lora/lora_registry.py:117-121``),
generating with an unknown one (``srt/managers/tokenizer_manager.py:3729-3770``). A refused
load/unload raises :class:`LoRAUpdateFailed`, answered 400 with SGLang's ``LoRAUpdateOutput`` body.
An unload waits until no request holds the adapter, as SGLang's does (:class:`LoRARegistry`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from megatron_rl.engines.protocol import LoRASettings, LoRAUpdateResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TENSOR_PATH = "__tensor__"
"""The path SGLang records for an adapter loaded from tensors (``io_struct.py:2565``)."""
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMALIZED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
_NORMALIZED["up_proj"] = "gate_up_proj"
_PEFT_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\."
    r"(?:self_attn\.([qkvo]_proj)|mlp\.((?:experts\.\d+\.)?(?:gate|up|down)_proj))\.lora_(A|B)\.weight$"
)
_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


class LoRAUpdateFailed(ValueError):
    """A refused load or unload: HTTP 400 with :attr:`result` (SGLang's ``LoRAUpdateOutput``) as the body."""

    def __init__(self, result: LoRAUpdateResult) -> None:
        super().__init__(result.error_message)
        self.result = result


def normalized_targets(modules: list[str] | str) -> set[str]:
    """SGLang's ``get_normalized_target_modules`` (``srt/lora/utils.py:277``) for our projections: q/k/v share
    ``qkv_proj``, gate/up ``gate_up_proj``; ``"all"`` / ``"all-linear"`` give ``{"all"}``."""
    if isinstance(modules, str):
        if modules not in ("all", "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    return {_NORMALIZED.get(name.rsplit(".", 1)[-1], name.rsplit(".", 1)[-1]) for name in modules}


@dataclass(frozen=True)
class LoRAAdapter:
    """One loaded adapter: ``weights[(layer, projection)] = (A [r, in], B [out, r])`` in the model's dtype and
    device, ``scaling = lora_alpha / r``; ``path`` as SGLang reports it (:data:`TENSOR_PATH` for tensors).
    ``projection``: ``q_proj`` ... ``down_proj``, or ``experts.{e}.gate_proj`` (``up_proj``, ``down_proj``) for
    routed expert e."""

    name: str
    path: str
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_peft_dir(path: str) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """The ``adapter_config.json`` and ``adapter_model.safetensors`` tensors of a PEFT directory (ValueError when
    either is missing)."""
    config, weights = Path(path) / "adapter_config.json", Path(path) / "adapter_model.safetensors"
    if not (config.is_file() and weights.is_file()):
        raise ValueError(f"{path}: a PEFT adapter directory needs adapter_config.json and adapter_model.safetensors")
    return json.loads(config.read_text()), list(load_file(weights).items())


def _fan(model: PreTrainedModel, layer: int, projection: str) -> tuple[int, int]:
    """(in, out) features of ``projection`` of ``layer`` (see :class:`LoRAAdapter`); ValueError when the model has
    no such projection the engine adapts. An expert's are read from transformers' fused ``mlp.experts``:
    ``gate_up_proj`` [E, 2F, H] (gate rows, then up), ``down_proj`` [E, H, F]."""
    layers = model.model.layers
    if layer >= len(layers):
        raise ValueError(f"adapter weights for layer {layer}; the model has {len(layers)} layers")
    expert = _EXPERT.match(projection)
    if expert is not None:
        experts = getattr(layers[layer].mlp, "experts", None)
        if experts is None:
            raise ValueError(f"adapter weights for {projection} of layer {layer}, which has no routed experts")
        index, name = int(expert.group(1)), expert.group(2)
        count, two_f, hidden = experts.gate_up_proj.shape
        if index >= count:
            raise ValueError(f"adapter weights for {projection} of layer {layer}; the layer has {count} experts")
        return (two_f // 2, hidden) if name == "down_proj" else (hidden, two_f // 2)
    block = layers[layer].self_attn if projection in ATTENTION else layers[layer].mlp
    module = getattr(block, projection, None)
    if not isinstance(module, torch.nn.Linear):  # a dense MLP's name on a layer of routed experts
        raise ValueError(f"adapter weights for {projection} of layer {layer}, whose MLP has no {projection}")
    return module.in_features, module.out_features


def build_adapter(
    name: str,
    path: str,
    config: dict[str, Any],
    named: list[tuple[str, torch.Tensor]],
    model: PreTrainedModel,
    *,
    serve_experts: bool = True,
) -> LoRAAdapter:
    """The adapter of a PEFT config and its PEFT-named tensors, copied to the model's dtype and device.

    ValueError for a config that is not ``peft_type`` LoRA (SGLang asserts it, ``srt/lora/lora.py:66``),
    a name outside PEFT's ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`` (or
    ``...mlp.experts.{e}.{proj}...``), a projection not served, a missing half, or shapes that do not fit the
    projection and rank. ``serve_experts`` False: expert weights are checked, then left out (SGLang serves the
    experts without them when ``--lora-target-modules`` lacks ``gate_up_proj`` or ``down_proj``).
    """
    if str(config.get("peft_type", "")).lower() != "lora":
        raise ValueError(f"adapter {name}: peft_type must be LORA, got {config.get('peft_type')!r}")
    rank, param = int(config["r"]), next(model.parameters())
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in named:
        match = _PEFT_NAME.match(key)
        if match is None:
            raise ValueError(
                f"adapter {name}: {key} is not a PEFT LoRA weight of a projection the reference engine serves "
                "(self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, mlp.experts.{e}.{gate,up,down}_proj)"
            )
        layer, projection = int(match.group(1)), match.group(2) or match.group(3)
        halves.setdefault((layer, projection), {})[match.group(4)] = tensor.to(param.device, param.dtype, copy=True)
    weights = {}
    for (layer, projection), pair in sorted(halves.items()):
        fan_in, fan_out = _fan(model, layer, projection)
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise ValueError(f"adapter {name}: layer {layer} {projection} lacks lora_A or lora_B")
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(
                f"adapter {name}: layer {layer} {projection} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"fit r={rank} and the projection's {fan_in} -> {fan_out}"
            )
        if serve_experts or _EXPERT.match(projection) is None:
            weights[(layer, projection)] = (a, b)
    return LoRAAdapter(name, path, float(config["lora_alpha"]) / rank, weights)


class LoRARegistry:
    """The adapters loaded by name; ``settings`` None: LoRA not enabled (every load and LoRA request refused).

    As SGLang's tokenizer manager (``srt/managers/tokenizer_control_mixin.py:634-657``, ``srt/lora/lora_registry.py``):
    loads and unloads run one at a time (its ``lora_update_lock``); a request holds the adapter it named from its start
    to its end (:meth:`acquire`, :meth:`release`: its usage counter); an unload removes the name at once, then waits
    until no request holds the adapter, so an unload while generation is paused with requests holding the adapter
    does not return before they end (``wait_for_unload``). A request naming an adapter loaded before but not now is
    given it again from its last path (``_resolve_lora_path``): read again from a PEFT directory; refused for one
    loaded from tensors (SGLang reloads from the path ``__tensor__``, which fails).
    """

    def __init__(self, model: PreTrainedModel, settings: LoRASettings | None) -> None:
        self.model, self.settings = model, settings
        self._adapters: dict[str, LoRAAdapter] = {}
        self._paths: dict[str, str] = {}  # SGLang's lora_ref_cache: every name ever loaded -> its last path
        self._holders: dict[int, int] = {}  # id(adapter) -> requests holding it (SGLang's counter per lora_id)
        self._update = threading.Lock()
        self._state = threading.Condition()

    def result(self, error: str | None = None) -> LoRAUpdateResult:
        """SGLang's answer: success unless ``error``, with every loaded adapter's path
        (``lora_manager.py:267-277``)."""
        with self._state:
            loaded = {name: adapter.path for name, adapter in self._adapters.items()}
        return LoRAUpdateResult(error is None, error or "", loaded)

    def refusal(self, message: str) -> LoRAUpdateFailed:
        """The LoRAUpdateFailed SGLang answers for ``message`` (with the loaded adapters)."""
        return LoRAUpdateFailed(self.result(message))

    def check_enabled(self) -> None:
        """LoRAUpdateFailed with SGLang's message (no adapters listed) unless LoRA is enabled."""
        if self.settings is None:
            raise LoRAUpdateFailed(LoRAUpdateResult(False, NOT_ENABLED, None))

    def load(self, name: str, path: str, config: dict[str, Any], named: list[tuple[str, torch.Tensor]]) -> None:
        """Register adapter ``name``; LoRAUpdateFailed with SGLang's message when refused (module docstring)."""
        self.check_enabled()
        with self._update:
            self._load(name, path, config, named)

    def _load(self, name: str, path: str, config: dict[str, Any], named: list[tuple[str, torch.Tensor]]) -> None:
        assert self.settings is not None, "checked by the caller"
        if config.get("use_dora"):
            raise self.refusal(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        if name in self._adapters:
            raise self.refusal(f"Failed to load LoRA adapter {name} because it is already loaded")
        targets = normalized_targets(config.get("target_modules") or [])
        allowed = normalized_targets(list(self.settings.target_modules))
        if int(config["r"]) > self.settings.max_rank or not ("all" in targets or targets <= allowed):
            raise self.refusal(
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        try:
            experts = "all" in allowed or {"gate_up_proj", "down_proj"} <= allowed
            adapter = build_adapter(name, path, config, named, self.model, serve_experts=experts)
        except (ValueError, KeyError) as error:
            raise self.refusal(str(error)) from error
        with self._state:
            self._adapters[name] = adapter
            self._paths[name] = path

    def unload(self, name: str) -> None:
        """Forget adapter ``name`` once no request holds it (module docstring); LoRAUpdateFailed with SGLang's
        message, and no adapters listed, for a name not loaded (``tokenizer_control_mixin.py:858-859``)."""
        self.check_enabled()
        with self._update, self._state:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                loaded = OrderedDict.fromkeys(self._adapters).keys()  # SGLang's registry is an OrderedDict
                message = f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}"
                raise LoRAUpdateFailed(LoRAUpdateResult(False, message, None))
            self._state.wait_for(lambda: not self._holders.get(id(adapter)))
            self._holders.pop(id(adapter), None)

    def acquire(self, name: str | None) -> LoRAAdapter | None:
        """The adapter a generate request's ``lora_path`` names, held until :meth:`release` (None: the base model);
        ValueError (HTTP 400) with SGLang's message for LoRA not enabled or a name never loaded, or when giving an
        unloaded adapter again fails. Waits while a load or unload runs when the name is not loaded."""
        if name is None:
            return None
        if self.settings is None:
            raise ValueError(
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        with self._state:
            if name not in self._adapters and name not in self._paths:
                raise ValueError(
                    f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {self._paths.keys()}."
                )
            adapter = self._adapters.get(name)
            if adapter is not None:
                self._holders[id(adapter)] = self._holders.get(id(adapter), 0) + 1
                return adapter
        self._load_again(name)
        return self.acquire(name)

    def _load_again(self, name: str) -> None:
        """Give ``name`` again from its last path, as SGLang's implicit reload (under the update lock)."""
        with self._update:
            with self._state:
                if name in self._adapters:
                    return
                path = self._paths[name]
            try:
                if path == TENSOR_PATH:
                    raise LoRAUpdateFailed(self.result(f"{path} is not a PEFT adapter directory to load again"))
                self._load(name, path, *read_peft_dir(path))
            except (LoRAUpdateFailed, ValueError) as error:
                raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {error}") from error

    def release(self, adapter: LoRAAdapter | None) -> None:
        """A request that held ``adapter`` (from :meth:`acquire`) ended; an unload waiting for it may go on."""
        if adapter is None:
            return
        with self._state:
            self._holders[id(adapter)] -= 1
            self._state.notify_all()
