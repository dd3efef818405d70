"""Turn a recipe's data section into what a run consumes: tokenizer, datasets, reward function.

Synthetic tasks are written into ``work_dir`` first (tokenizer in the Hugging Face format,
verl-layout parquet files), so that they go through the same loading path as user data.
Everything that can be wrong with the data (a missing column, an unknown reward, a
tokenizer larger than the model's vocabulary, no prompt short enough) is reported here,
before any rank or engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from megatron_rl.config.schema import JUDGE_REWARD, REMOTE_REWARD, DataConfig, RunConfig, ValidationConfig
from megatron_rl.data.parquet_dataset import PromptDataset, load_prompt_dataset
from megatron_rl.data.remote_reward import RemoteReward
from megatron_rl.data.rewards import RewardFn, check_reward_contract, get_reward
from megatron_rl.data.synthetic_task import TOOL_TASKS, write_synthetic_dataset
from megatron_rl.data.synthetic_tokenizer import save_synthetic_tokenizer


@dataclass(frozen=True)
class PreparedData:
    """The tokenizer, the training and validation prompts and the reward of a run.

    ``val`` holds ``data.val_files`` (or the synthetic validation split); ``val_sets`` maps each validation
    set to its prompts (its own files, else ``val``; a set with neither is absent). ``reward_fn`` is None with
    ``data.reward: judge``, whose engines start with the run.
    """

    tokenizer: PreTrainedTokenizerBase
    tokenizer_dir: Path
    train: PromptDataset
    val: PromptDataset | None
    reward_fn: RewardFn | None
    val_sets: dict[str, PromptDataset] = field(default_factory=dict)

    def decode(self, token_ids: list[int]) -> str:
        """The text of one token sequence, special tokens kept."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        assert isinstance(text, str), "one sequence decodes to one text (a list is a batch's)"
        return text


def resolve_reward(data: DataConfig) -> RewardFn | None:
    """The reward function ``data.reward`` names, checked against the reward contract.

    Raises ValueError naming ``data.reward`` when it is unknown, cannot be imported, or
    violates the contract. With ``data.reward: remote`` it is the :class:`RemoteReward` of
    ``data.remote_reward``, and the contract's probe is a request to the server: a server that is down
    or answers no score fails here, the message naming ``data.remote_reward.url``. The probe's
    connection is closed before this returns. With ``data.reward: judge`` it is None: the judge's engines,
    which the run starts, score (:class:`~megatron_rl.rollout.judge_reward.JudgeReward`).
    """
    if data.reward == JUDGE_REWARD:
        return None
    try:
        if data.reward != REMOTE_REWARD:
            reward_fn = get_reward(data.reward)
            check_reward_contract(reward_fn)
            return reward_fn
        if data.remote_reward is None:
            raise ValueError(f"{REMOTE_REWARD!r} needs data.remote_reward.url, the reward server's URL")
        remote = RemoteReward(data.remote_reward)
        try:
            check_reward_contract(remote)
        finally:
            remote.close()
        return remote
    except (ValueError, TypeError, ImportError) as exc:
        raise ValueError(f"data.reward: {exc}") from exc


def _check_vocab_fits(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"model vocab_size: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}: "
            "use the checkpoint's own tokenizer or a model with a larger vocabulary"
        )


def prepare_data(
    data: DataConfig,
    *,
    tokenizer_path: str | None,
    model_vocab_size: int,
    max_prompt_length: int,
    work_dir: str | Path,
    validation: ValidationConfig | None = None,
) -> PreparedData:
    """Load (or, for a synthetic task, first write into ``work_dir``) the run's data, and each of
    ``validation``'s sets (files shared by sets are loaded once).

    ``tokenizer_path`` is the model's tokenizer directory; it is ignored for synthetic
    tasks, which bring their own. Prompts longer than ``max_prompt_length`` tokens are
    filtered out (the count is in ``PromptDataset.num_filtered``). Bad data is a ValueError
    whose message starts with the recipe field that names it (``data.train_files: <file> row
    ...``).
    """
    work_dir = Path(work_dir)
    train_files, val_files = list(data.train_files), list(data.val_files)
    if data.synthetic is not None:
        tokenizer_dir = save_synthetic_tokenizer(work_dir / "tokenizer", tools=data.synthetic.task in TOOL_TASKS)
        files = write_synthetic_dataset(
            work_dir / "data",
            task=data.synthetic.task,
            prompt_format=data.synthetic.prompt_format,
            num_train=data.synthetic.num_train,
            num_val=data.synthetic.num_val,
            seed=data.synthetic.seed,
        )
        train_files, val_files = [str(files.train)], [str(files.val)]
    elif tokenizer_path is None:
        raise ValueError("model.tokenizer: no tokenizer directory; set model.tokenizer or model.path")
    else:
        tokenizer_dir = Path(tokenizer_path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    _check_vocab_fits(tokenizer, model_vocab_size)
    reward_fn = resolve_reward(data)

    def load(field: str, files: list[str]) -> PromptDataset:
        try:
            return load_prompt_dataset(
                files,
                tokenizer,
                max_prompt_length=max_prompt_length,
                prompt_key=data.prompt_key,
                answer_key=data.answer_key,
                wrap_text_in_chat=data.apply_chat_template,
            )
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"{field}: {exc}") from exc

    synthetic = data.synthetic is not None
    train = load("data.synthetic" if synthetic else "data.train_files", train_files)
    val = load("data.synthetic" if synthetic else "data.val_files", val_files) if val_files else None
    loaded: dict[tuple[str, ...], PromptDataset] = {}
    val_sets = {}
    for name, validation_set in (validation.sets if validation is not None else {}).items():
        set_files = tuple(validation_set.files)
        if set_files and set_files not in loaded:
            loaded[set_files] = load(f"validation.sets.{name}.files", list(set_files))
        dataset = loaded[set_files] if set_files else val
        if dataset is not None:
            val_sets[name] = dataset
    return PreparedData(
        tokenizer=tokenizer,
        tokenizer_dir=tokenizer_dir,
        train=train,
        val=val,
        reward_fn=reward_fn,
        val_sets=val_sets,
    )


def prepare_recipe_data(cfg: RunConfig, *, model_vocab_size: int, work_dir: str | Path) -> PreparedData:
    """:func:`prepare_data` as the recipe ``cfg`` sets it: its data and validation sections, the model's tokenizer
    (``model.tokenizer``, else ``model.path``) and ``rollout.max_prompt_length``."""
    return prepare_data(
        cfg.data,
        tokenizer_path=cfg.model.tokenizer or cfg.model.path,
        model_vocab_size=model_vocab_size,
        max_prompt_length=cfg.rollout.max_prompt_length,
        work_dir=work_dir,
        validation=cfg.validation,
    )
