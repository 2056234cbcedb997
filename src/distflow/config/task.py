"""The `task` section: the dataset, the reward functions and reward models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from distflow.config.components import TASK_SOURCES
from distflow.config.errors import check, check_seconds

GYM_REWARD = "distflow.tasks.reasoning_gym:score_reward"
"""`task.reward` of a reasoning-gym task left at the default: the datasets' own scorer."""
FLOAT32_MAX = 3.4028234663852886e38
"""Rewards are float32 tensors: a larger default reward would be inf there."""


@dataclass(kw_only=True)
class RewardSpec:
    """One term of a weighted sum of reward functions (`task.rewards`)."""

    fn: str
    """`package.module:function`, called as fn(prompt, completion, sample) -> float, or a dict
    with a "score" and other numbers (logged as `reward/<name>/<key>`)."""
    weight: float = 1.0
    """Its weight in the sum."""
    name: str | None = None
    """Metric name (`reward/<name>`); defaults to the function's name."""

    def __post_init__(self) -> None:
        check(":" in self.fn, f"task.rewards[].fn must look like 'package.module:function' (got {self.fn!r})")


@dataclass(kw_only=True)
class RewardModelSpec:
    """A local sequence-classification reward model scored beside the reward functions (`task.reward_models`)."""

    path: str
    """A Hugging Face model directory holding an `AutoModelForSequenceClassification` with one
    label (its score) and its tokenizer."""
    weight: float = 1.0
    """Its weight in the sum of rewards."""
    name: str | None = None
    """Metric name (`reward/<name>`); defaults to the directory's name."""
    batch_size: int = 32
    """Samples per forward pass of the reward model."""

    def __post_init__(self) -> None:
        check(self.batch_size >= 1, f"task.reward_models[].batch_size must be >= 1 (got {self.batch_size})")


@dataclass(kw_only=True)
class DatasetSpec:
    """Rows from the Hugging Face `datasets` library (`task.dataset`), graded like `task.train_file`'s."""

    path: str
    """A directory saved with `save_to_disk` (a Dataset or a DatasetDict), or a .parquet, .jsonl,
    .json or .csv file (converted to Arrow once, in the datasets cache)."""
    split: str = "train"
    """The split that is trained on."""
    heldout_split: str = "test"
    """The split that is evaluated (held-out accuracy)."""
    heldout_path: str | None = None
    """Where the held-out split is, when not in `path` (a single file or Dataset has one split, train)."""
    prompt_column: str = "prompt"
    """Text, or a list of chat messages."""
    answer_column: str = "answer"
    """The ground truth the verifier (math-verify equivalence) and reward functions read as `sample["answer"]`."""
    chat: bool = True
    """A text prompt is sent as one user message through the tokenizer's chat template; false: as is."""


ANSWER_FORMATS = ("tag", "last_number", "last_line")


@dataclass(kw_only=True)
class GymDatasetSpec:
    """One reasoning-gym dataset of a mix (`task.reasoning_gym.datasets`)."""

    name: str
    """A reasoning-gym dataset name (`reasoning_gym.factory.DATASETS`: chain_sum, basic_arithmetic, ...)."""
    weight: float = 1.0
    """Its share of the training and held-out rows (weights are normalized over the mix)."""
    config: dict = field(default_factory=dict)
    """Keyword arguments of the dataset's config (e.g. {min_terms: 2, max_terms: 2} for chain_sum)."""

    def __post_init__(self) -> None:
        check(bool(self.name), "task.reasoning_gym.datasets[].name must not be empty")
        check(self.weight > 0, f"task.reasoning_gym.datasets[{self.name}].weight must be > 0 (got {self.weight})")


@dataclass(kw_only=True)
class ReasoningGymSpec:
    """Procedural tasks from the `reasoning-gym` package (`pip install 'distflow[reasoning]'`):
    rows are a pure function of (trainer.seed, index); scored by each dataset's own `score_answer`."""

    datasets: list[GymDatasetSpec] = field(default_factory=list)
    """The datasets of the mix, each `{name, weight, config}`; at least one."""
    num_train: int = 10000
    """Training rows in all (split over the mix by weight; held-out questions are left out of them)."""
    instruction: str = "{question}"
    """The user message; `{question}` is the dataset's question. Say here where the answer goes."""
    system_prompt: str | None = None
    """A system message before it (None: the chat template's default, if it has one)."""
    answer_format: str = "last_number"
    """How the answer is taken from a completion before it is scored: tag (the text of the last
    <answer>...</answer>, reasoning-gym's convention), last_number (the last number in it, for
    numeric tasks and models that do not follow a format) or last_line (its last non-empty line)."""

    def __post_init__(self) -> None:
        check(
            bool(self.datasets), "task.reasoning_gym.datasets must name at least one dataset, e.g. [{name: chain_sum}]"
        )
        names = [d.name for d in self.datasets]
        check(len(set(names)) == len(names), f"task.reasoning_gym.datasets names a dataset twice: {names}")
        check(self.num_train >= 1, f"task.reasoning_gym.num_train must be >= 1 (got {self.num_train})")
        check(
            "{question}" in self.instruction,
            f"task.reasoning_gym.instruction must contain {{question}} (got {self.instruction!r})",
        )
        check(
            self.answer_format in ANSWER_FORMATS,
            f"task.reasoning_gym.answer_format must be one of {', '.join(ANSWER_FORMATS)} (got {self.answer_format!r})",
        )


@dataclass(kw_only=True)
class GivenRows:
    """How messages name the rows that `distflow.train(dataset=..., heldout=...)` wrote to
    `task.train_file` / `task.heldout_file` (`task.given_rows`): as the caller indexes them,
    `dataset[0]`, not as lines of those temporary files. Set by `distflow.train`."""

    train: str = "dataset"
    """Row i of `train_file` is row i of this: `dataset` or `dataset['train']`."""
    heldout: str = "heldout"
    """Row i of `heldout_file` is row `heldout_start + i` of this: `heldout`, `dataset['test']` or
    `dataset` (its last rows, held out of training)."""
    heldout_start: int = 0
    """Where the held-out rows start in `heldout`."""

    def __post_init__(self) -> None:
        check(self.heldout_start >= 0, f"task.given_rows.heldout_start must be >= 0 (got {self.heldout_start})")


@dataclass(kw_only=True)
class TaskConfig:
    SELECTOR: ClassVar[str] = "source"
    source: str = "arithmetic"
    """Where the rows come from (distflow/tasks/): `arithmetic`, the embedded addition task; `files`,
    verl-format files (`train_file`, `heldout_file`); `datasets`, the `datasets` library (`dataset`);
    `reasoning_gym`, procedural tasks (`reasoning_gym`); `verifiers`, an environment of the verifiers
    library (`task.verifiers: {env, kwargs, harness}`, its options). Each source reads its own keys below and
    refuses the others'. Your own: 'package.module:name', a `distflow.tasks.build.TaskSource` subclass
    or a function `(config, tokenizer) -> Task` (its settings in `task.options`)."""
    options: dict = field(default_factory=dict)
    """A source of your own's settings (for a function source: handed over as a dict)."""
    num_digits: int = 2
    """`source: arithmetic`: operands of the embedded addition task have up to this many digits (1..3)."""
    num_operands: int = 2
    """`source: arithmetic`: operands of each embedded sum ("a+b=", "a+b+c=", ...; 2..4): more makes a multi-step task
    that the calculator tool (`env.cls: distflow.envs.tools:CalculatorEnv`) helps with."""
    num_heldout: int = 1000
    """Problems held out of training for evaluation. The embedded addition task holds them out of
    its 10^(num_operands·num_digits) problems, so it must leave some to train on; reasoning-gym
    generates this many; with `heldout_file` or `dataset`, a cap on the held-out rows evaluated."""
    reward: str = "distflow.tasks.arithmetic:correctness_reward"
    """Reward function as `package.module:function`, called as fn(prompt, completion, sample)."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Several reward functions summed with weights, `[{fn, weight, name}]`, each logged as
    `reward/<name>`; when set, replaces `reward`."""
    reward_models: list[RewardModelSpec] = field(default_factory=list)
    """Local reward models whose weighted scores are added to the reward functions' sum,
    `[{path, weight, name, batch_size}]` (each an `AutoModelForSequenceClassification` with one label)."""
    default_reward: float = 0.0
    """What a reward function that raises, times out or returns a value float32 cannot hold
    (NaN, inf, |x| > 3.4e38) scores (counted in `reward/errors` and `reward/timeouts`)."""
    reward_timeout_s: float = 10.0
    """Longest a reward call may take (run on a helper thread); 0: call inline, no deadline."""
    train_file: str | None = None
    """`source: files`: a verl-format dataset (.jsonl / .parquet rows with `prompt` as chat messages and
    `reward_model.ground_truth`). Needs `model.path`."""
    heldout_file: str | None = None
    """`source: files`: held-out rows in the same format (evaluation)."""
    given_rows: GivenRows | None = None
    """Set by `distflow.train` when it is given rows, which it writes to `train_file` and
    `heldout_file`: how messages name them. Null: as lines of those files."""
    dataset: DatasetSpec | None = None
    """`source: datasets`: rows read with the `datasets` library. Needs `model.path`."""
    reasoning_gym: ReasoningGymSpec | None = None
    """`source: reasoning_gym`: procedural reasoning-gym tasks (`task.num_heldout` of them held out).
    Needs `model.path`; the default `task.reward` becomes the datasets' own scorer."""

    def __post_init__(self) -> None:
        TASK_SOURCES.chosen(self, "source")  # a known source, with options it takes
        check(1 <= self.num_digits <= 3, f"task.num_digits must be in 1..3 (got {self.num_digits})")
        check(2 <= self.num_operands <= 4, f"task.num_operands must be in 2..4 (got {self.num_operands})")
        check(self.num_heldout >= 1, f"task.num_heldout must be >= 1 (got {self.num_heldout})")
        check(":" in self.reward, f"task.reward must look like 'package.module:function' (got {self.reward!r})")
        check(self.reward_timeout_s >= 0, f"task.reward_timeout_s must be >= 0 (got {self.reward_timeout_s})")
        check_seconds("task.reward_timeout_s", self.reward_timeout_s)
        check(
            abs(self.default_reward) <= FLOAT32_MAX,
            f"task.default_reward must fit in float32, |x| <= 3.4e38 (got {self.default_reward})",
        )
