"""A tiny random judge for the judge-reward tests: a dense Qwen3 with the synthetic tokenizer (chat template
included), built locally, and recipe overrides that score the tiny recipes with it.

Its answers are noise, so the verdict patterns read digits, which its vocabulary is mostly made of: the last digit
of an answer decides (0-3 correct, 6-9 wrong), and an answer with only 4s, 5s or words is a reward error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from megatron_rl.data.synthetic_tokenizer import SYNTHETIC_VOCAB_SIZE, save_synthetic_tokenizer

CORRECT, WRONG = "[0-3]", "[6-9]"
TEMPLATE = "{prompt} {response} {ground_truth}"
MAX_NEW_TOKENS = 6
SCALE = 0.5


def save_tiny_judge(path: Path, seed: int = 8) -> Path:
    """Write the judge (weights, config, tokenizer) to ``path``; return it. At the default seed its verdicts on
    short digit answers are of all three kinds (correct, wrong, none)."""
    config = Qwen3Config(
        vocab_size=SYNTHETIC_VOCAB_SIZE,  # every token it writes decodes to a word
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than Hugging Face's init, so greedy answers depend on what the judge reads
        for param in model.parameters():
            param.copy_(SCALE * torch.randn(param.shape, generator=generator))
    model.save_pretrained(path)
    save_synthetic_tokenizer(path)
    return path


def judge_overrides(model: Path, num_engines: int = 1) -> list[str]:
    """Recipe overrides scoring a tiny recipe with the judge at ``model``."""
    return [
        "data.reward=judge",
        f"judge.model={model}",
        f"judge.num_engines={num_engines}",
        f"judge.prompt_template='{TEMPLATE}'",
        f"judge.correct_pattern='{CORRECT}'",
        f"judge.wrong_pattern='{WRONG}'",
        f"judge.max_new_tokens={MAX_NEW_TOKENS}",
        "judge.correct_score=1.0",
        "judge.wrong_score=-1.0",
    ]
