"""SGLang 0.5.23's ``/weights_checker`` on the reference engine: snapshot, reset, compare and checksum the weights.

What SGLang does (``srt/utils/weight_checker.py`` ``WeightChecker``, ``weight_checker_comparator.py``,
``managers/scheduler_components/weight_updater.py`` ``check_weights``, ``entrypoints/http_server.py``), and
so what :class:`WeightChecker` does:

- ``snapshot`` copies every parameter and buffer; ``reset_tensors`` overwrites each one not skipped with random
  values (floating point: uniform in [0, 1); integers: the dtype's range); ``compare`` checks each against the
  snapshot, bit for bit, and drops the snapshot once it passes (a failed compare keeps it); ``checksum`` hashes
  each tensor not skipped (the first 8 bytes of the SHA-256 of its bytes, as 16 hex digits).
- Skipped by reset, compare and checksum alike: non-persistent buffers (names containing ``cos_sin_cache``,
  ``inv_freq``, ...: rotary caches recomputed from the config) and names containing any ``skip_tensor_list``
  entry; compare reports a skipped tensor that differs in its log only.
- FP8 weights (an engine started from an FP8 checkpoint) are compared and hashed as their dequantised value
  (FP8 weight times its block's scale), never skipped; with ``allow_quant_error`` a difference within the sum of
  both sides' quantisation ULPs (per element, times the scale) passes.
- Any failure answers ``{"success": false, "message"}`` (HTTP 400): a compare that finds differences has the
  message ``"check tensor equality failed:\\n"`` and one line per differing tensor, ``name=<tensor name>
  max_abs_err=... mean_abs_err=... num_exceed=... expect=... actual=...``; a compare without a snapshot fails
  SGLang's bare ``assert``, the message empty; an unknown action: ``Unsupported action='...'``. Success answers
  ``{"success": true, "message": "Success."}``, a checksum also ``ranks`` (one entry per TP rank: ``checksums``
  by name, ``per_gpu_checksum``, ``parallelism_info``) and ``per_engine_checksum``.

Names: SGLang checks its internal parameter names (fused ``qkv_proj``, ``gate_up_proj``, the experts'
``w13_weight``/``w2_weight``, ...); the reference engine checks its own: the transformers model's parameters
and buffers (``model.layers.0.self_attn.q_proj.weight``, fused ``mlp.experts.gate_up_proj``, ...) and, with FP8
weights, each FP8 projection under its Hub name (its FP8 weight and ``<name>_scale_inv`` scales, in place of the
model parameter computed from them). Checksums of the two engines therefore never match each other.

On CPU, SGLang's ``compare`` always fails (its comparator moves each chunk with ``.cuda()``: the message is
torch's "Found no NVIDIA driver on your system..."); snapshot, reset and checksum work. The reference engine
compares on its own device, CPU included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from megatron_rl.engines.protocol import CheckWeightsRequest
from megatron_rl.engines.reference.fp8_weights import Fp8Weights
from megatron_rl.engines.reference.weights import holding_parameter, load_named_tensors
from megatron_rl.wire.fp8_blocks import SCALE_SUFFIX, dequantize_blocks

SUCCESS = "Success."
"""SGLang's message of a successful check (with its full stop, unlike the weight-update endpoints')."""
NON_PERSISTENT_BUFFER_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
COMPARE_FAILED = "check tensor equality failed:\n"


class WeightCheckFailed(Exception):
    """A check SGLang answers with ``{"success": false, "message": str(error)}`` and HTTP 400."""


class CompareResult(NamedTuple):
    equal: bool
    max_abs_err: float
    mean_abs_err: float
    num_exceed: int
    """Elements differing by more than the two sides' quantisation tolerance (0 for raw tensors: any)."""


@dataclass(frozen=True, repr=False)
class RawWeight:
    """A tensor compared bit for bit."""

    tensor: torch.Tensor

    def __repr__(self) -> str:
        return f"raw(shape={tuple(self.tensor.shape)} dtype={self.tensor.dtype})"

    def values(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the values compared, flat; no tolerance)."""
        return self.tensor.reshape(-1), None

    def dequantized(self) -> torch.Tensor:
        return self.tensor


@dataclass(frozen=True, repr=False)
class Fp8BlockWeight:
    """An FP8 weight with its float32 block scales, compared as its dequantised value (SGLang's ``fp8_block``)."""

    weight: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]

    def __repr__(self) -> str:
        return f"fp8_block(shape={tuple(self.weight.shape)} dtype={self.weight.dtype} is_shuffled=False)"

    def values(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the bf16 dequantised weight, each element's quantisation ULP times its scale), as SGLang's."""
        return self.dequantized(), dequantize_blocks(_quant_ulp(self.weight), self.scales, self.block, torch.float32)

    def dequantized(self) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.scales, self.block, torch.bfloat16)


Comparable = RawWeight | Fp8BlockWeight


class CheckEntry(NamedTuple):
    name: str
    should_compare: bool
    comparable: Comparable


def _quant_ulp(weight: torch.Tensor) -> torch.Tensor:
    """The spacing of ``weight``'s dtype at each element (subnormals and zeros: the smallest normal's)."""
    finfo = torch.finfo(weight.dtype)
    x = weight.float().abs()
    _, exponent = torch.frexp(x)
    binade = torch.exp2((exponent - 1).float()).masked_fill(x < finfo.smallest_normal, finfo.smallest_normal)
    return binade * finfo.eps


def is_skipped(name: str, skip_tensor_list: list[str] | None) -> bool:
    """Whether reset, compare and checksum leave ``name`` out (a non-persistent buffer, or a listed substring)."""
    return any(pattern in name for pattern in (*NON_PERSISTENT_BUFFER_PATTERNS, *(skip_tensor_list or ())))


def compare_weights(expect: Comparable, actual: Comparable) -> CompareResult:
    """Element-wise comparison of the two values; NaN counts as differing (SGLang's ``compare_weights``)."""
    expect_values, expect_tol = expect.values()
    actual_values, actual_tol = actual.values()
    assert expect_values.shape == actual_values.shape, f"{expect_values.shape=} {actual_values.shape=}"
    diff = (actual_values.float() - expect_values.float()).abs()
    if torch.all(diff == 0):
        return CompareResult(True, 0.0, 0.0, 0)
    tol: torch.Tensor | float = 0.0 if expect_tol is None or actual_tol is None else expect_tol + actual_tol
    exceed = int((~(diff <= tol)).sum())  # not `diff > tol`: NaN exceeds
    return CompareResult(False, diff.max().item(), diff.sum().item() / max(diff.numel(), 1), exceed)


def check_tensors(expect: list[CheckEntry], actual: list[CheckEntry], allow_quant_error: bool) -> None:
    """Raise (with SGLang's message: one ``name=...`` line per tensor) when a compared tensor differs; skipped
    tensors, and with ``allow_quant_error`` FP8 ones within tolerance, may differ."""
    errors = []
    for (name, should_compare, expect_weight), (actual_name, actual_should, actual_weight) in zip(
        expect, actual, strict=True
    ):
        assert name == actual_name, f"{name=} {actual_name=}"
        assert should_compare == actual_should, f"{should_compare=} {actual_should=}"
        result = compare_weights(expect_weight, actual_weight)
        if result.equal or not should_compare or (allow_quant_error and result.num_exceed == 0):
            continue
        errors.append(
            f"name={name} max_abs_err={result.max_abs_err} mean_abs_err={result.mean_abs_err} "
            f"num_exceed={result.num_exceed} expect={expect_weight!r} actual={actual_weight!r} "
        )
    if errors:
        raise WeightCheckFailed(COMPARE_FAILED + "\n".join(errors))


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's ``tensor_hash`` of a CPU tensor: the first 8 bytes of the SHA-256 of its bytes, 16 hex digits."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(flat.numpy())).digest()[:8].hex()


def overall_checksum(checksums: dict[str, str]) -> str:
    """One rank's ``per_gpu_checksum``: the SHA-256 of every (name, checksum), by name."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


def engine_checksum(ranks: list[dict[str, Any]]) -> str:
    """The ``per_engine_checksum``: the SHA-256 of the ranks' ``per_gpu_checksum``, in rank order."""
    digest = hashlib.sha256()
    for rank in ranks:
        digest.update(rank["per_gpu_checksum"].encode())
    return digest.hexdigest()


def merge_rank_checksums(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's checksum answer from its TP ranks' answers (in rank order), as SGLang gathers them."""
    ranks = [rank for answer in answers for rank in answer["ranks"]]
    return {"success": True, "message": SUCCESS, "ranks": ranks, "per_engine_checksum": engine_checksum(ranks)}


def _random_like(tensor: torch.Tensor) -> torch.Tensor:
    """Random values of ``tensor``'s shape and dtype, as SGLang's reset draws them."""
    if tensor.dtype.is_floating_point:
        return torch.rand(tensor.shape, device=tensor.device).to(tensor.dtype)
    if tensor.dtype == torch.bool:
        return torch.rand(tensor.shape, device=tensor.device) > 0.5
    info = torch.iinfo(tensor.dtype)
    return torch.randint(int(info.min), int(info.max), tensor.shape, device=tensor.device, dtype=tensor.dtype)


class WeightChecker:
    """The ``/weights_checker`` actions on ``model`` (and the FP8 weights ``fp8`` it computes from, if any) of
    TP rank ``tp_rank`` of ``tp_size``. Not thread-safe: the caller holds the model lock."""

    def __init__(self, model: torch.nn.Module, fp8: Fp8Weights | None, *, tp_rank: int, tp_size: int) -> None:
        self.model, self.fp8 = model, fp8
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._snapshot: dict[str, torch.Tensor] | None = None

    def handle(self, request: CheckWeightsRequest) -> dict[str, Any]:
        """SGLang's answer body to ``request`` (success); WeightCheckFailed with SGLang's message otherwise."""
        try:
            return self._handle(request)
        except Exception as error:  # noqa: BLE001 - SGLang answers every failure as {"success": false, message}
            raise WeightCheckFailed(str(error)) from error

    def _handle(self, request: CheckWeightsRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"success": True, "message": SUCCESS}
        if request.selector == "draft":
            return body  # no draft model: no runner to act on
        if request.action == "snapshot":
            self._snapshot = {name: tensor.detach().clone() for name, tensor in self._state()}
        elif request.action == "reset_tensors":
            self._reset(request.skip_tensor_list)
        elif request.action == "compare":
            self._compare(request.allow_quant_error, request.skip_tensor_list)
        elif request.action == "checksum":
            body |= merge_rank_checksums([{"ranks": [self._checksum(request.skip_tensor_list)]}])
        else:
            raise ValueError(f"Unsupported action={request.action!r}")
        return body

    def _derived_parameters(self) -> set[str]:
        """Model parameters computed from held FP8 weights (checked as those weights instead)."""
        return set() if self.fp8 is None else {holding_parameter(name) for name in self.fp8.weights}

    def _state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor checked, by name: the model's parameters and buffers, and each held FP8 weight and its
        scales (under ``<name>_scale_inv``) in place of the parameters computed from them."""
        derived = self._derived_parameters()
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if name not in derived:
                yield name, tensor.data
        if self.fp8 is not None:
            for name in sorted(self.fp8.weights):
                yield name, self.fp8.weights[name]
                yield name + SCALE_SUFFIX, self.fp8.scales[name]

    def _entries(self, state: dict[str, torch.Tensor], skipped: set[str]) -> list[CheckEntry]:
        """One entry per weight of ``state``; an FP8 weight takes its scales along (never skipped, as SGLang's)."""
        fp8 = self.fp8
        entries = []
        for name, tensor in state.items():
            if fp8 is not None and name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in fp8.weights:
                continue
            if fp8 is not None and name in fp8.weights:
                entries.append(CheckEntry(name, True, Fp8BlockWeight(tensor, state[name + SCALE_SUFFIX], fp8.block)))
            else:
                entries.append(CheckEntry(name, name not in skipped, RawWeight(tensor)))
        return entries

    @torch.no_grad()
    def _reset(self, skip_tensor_list: list[str] | None) -> None:
        for name, tensor in self._state():
            if not is_skipped(name, skip_tensor_list):
                tensor.copy_(_random_like(tensor))
        fp8 = self.fp8
        if fp8 is not None:  # the model computes with the (now random) FP8 weights
            dtype = next(self.model.parameters()).dtype
            dequantized = [(n, dequantize_blocks(w, fp8.scales[n], fp8.block, dtype)) for n, w in fp8.weights.items()]
            load_named_tensors(dict(self.model.named_parameters()), dequantized)

    def _compare(self, allow_quant_error: bool, skip_tensor_list: list[str] | None) -> None:
        if self._snapshot is None:
            raise AssertionError()  # SGLang's bare `assert`: the answer's message is empty
        state = dict(self._state())
        skipped = {name for name in state if is_skipped(name, skip_tensor_list)}
        check_tensors(self._entries(self._snapshot, skipped), self._entries(state, skipped), allow_quant_error)
        self._snapshot = None

    def _checksum(self, skip_tensor_list: list[str] | None) -> dict[str, Any]:
        """This rank's entry of ``ranks``: checksums by name, their ``per_gpu_checksum``, its place."""
        state = dict(self._state())
        skipped = {name for name in state if is_skipped(name, skip_tensor_list)}
        checksums = {
            name: tensor_checksum(weight.dequantized())
            for name, should_compare, weight in self._entries(state, skipped)
            if should_compare
        }
        place = {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "dp_rank": 0, "dp_size": 1}
        place |= {"pp_rank": 0, "pp_size": 1, "rank": self.tp_rank, "size": self.tp_size}
        return {
            "checksums": checksums,
            "per_gpu_checksum": overall_checksum(checksums),
            "parallelism_info": [{"role": "target", **place}],
        }
