"""Greedy decoding and log-probs with Hugging Face transformers: the independent fp32 reference."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


def load_model(model_dir: Path, weights: Mapping[str, torch.Tensor] | None = None) -> PreTrainedModel:
    """The checkpoint in fp32, eval mode; ``weights`` (on-disk names) replace the saved ones where given."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights:
        missing, unexpected = model.load_state_dict(dict(weights), strict=False)
        assert not unexpected, unexpected
    return model


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """(tokens, their log-probs) of greedy decoding, ignoring EOS, full forward per token."""
    ids = list(prompt)
    logprobs = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        token = int(torch.argmax(logits))
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt) :], logprobs
