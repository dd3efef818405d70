"""Prompt data, rewards, synthetic tasks and batch balancing for RL post-training.

Depends on pyarrow, numpy, tokenizers and transformers; never imports Megatron, Ray or torch.
Importing the package registers the built-in rewards (``math_dapo``, the DAPO rule;
``math_equiv`` and ``math_01``, lenient equivalence; ``synthetic_successor``, ``synthetic_max``).
"""

from megatron_rl.data.balancing import (
    WORKLOAD_LINEAR_COEFFICIENT,
    balance_across_dp,
    karmarkar_karp_partition,
    sequence_workload,
)
from megatron_rl.data.math_reward import (
    answers_match,
    extract_answer,
    extract_boxed,
    is_correct_math_response,
    math_01,
    math_dapo,
    math_equiv,
    normalize_answer,
    parse_number,
)
from megatron_rl.data.micro_batching import token_budget_micro_batches
from megatron_rl.data.parquet_dataset import PromptDataset, PromptItem, load_prompt_dataset
from megatron_rl.data.prompts import Prompt, encode_prompts, render_prompt, validate_prompt
from megatron_rl.data.rewards import (
    RewardContractError,
    RewardFn,
    RewardOutput,
    check_reward_contract,
    get_reward,
    register_reward,
    registered_rewards,
)
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.data.synthetic_task import (
    SYNTHETIC_PROMPT_FORMATS,
    SYNTHETIC_TASKS,
    SyntheticDatasetFiles,
    synthetic_exact,
    synthetic_rows,
    write_synthetic_dataset,
)
from megatron_rl.data.synthetic_tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    PAD_TOKEN,
    PAD_TOKEN_ID,
    SYNTHETIC_CHAT_TEMPLATE,
    SYNTHETIC_VOCAB,
    SYNTHETIC_VOCAB_SIZE,
    build_synthetic_tokenizer,
    save_synthetic_tokenizer,
)

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "PAD_TOKEN",
    "PAD_TOKEN_ID",
    "SYNTHETIC_CHAT_TEMPLATE",
    "SYNTHETIC_PROMPT_FORMATS",
    "SYNTHETIC_TASKS",
    "SYNTHETIC_VOCAB",
    "SYNTHETIC_VOCAB_SIZE",
    "WORKLOAD_LINEAR_COEFFICIENT",
    "Prompt",
    "PromptDataset",
    "PromptItem",
    "PromptSampler",
    "RewardContractError",
    "RewardFn",
    "RewardOutput",
    "SyntheticDatasetFiles",
    "answers_match",
    "balance_across_dp",
    "build_synthetic_tokenizer",
    "check_reward_contract",
    "encode_prompts",
    "extract_answer",
    "extract_boxed",
    "get_reward",
    "is_correct_math_response",
    "karmarkar_karp_partition",
    "load_prompt_dataset",
    "math_01",
    "math_dapo",
    "math_equiv",
    "normalize_answer",
    "parse_number",
    "register_reward",
    "registered_rewards",
    "render_prompt",
    "save_synthetic_tokenizer",
    "sequence_workload",
    "synthetic_exact",
    "synthetic_rows",
    "token_budget_micro_batches",
    "validate_prompt",
    "write_synthetic_dataset",
]
