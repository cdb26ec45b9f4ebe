"""Task data and reward settings."""

from __future__ import annotations

import difflib
import re
import string
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section


class BuiltinTask(Section):
    """A verifiable task whose prompts are generated in code (no downloads)."""

    kind: Literal["builtin"] = "builtin"
    name: Literal["cipher", "addition", "calculator", "guess"] = "cipher"
    """'cipher': shift each letter of a word one place; 'addition': sums of numbers of up to
    `max_digits` digits; 'calculator': word problems solved with the `calc(expr)` tool;
    'guess': find a number from higher/lower replies (the last two are episodes: set
    `task.environment`)."""
    max_digits: int = Field(3, ge=2, le=9)
    """'addition' only: operands have 1 to this many digits (2 gives 10,000 prompts, about a
    tenth of them held out)."""
    demo_error_rate: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of SFT demonstrations with one wrong character, as an imperfect demonstrator
    writes them (the verifier used by RL is never wrong)."""
    heldout_size: int = Field(256, ge=16, le=1_000_000)
    """Size of the fixed held-out split used by evaluation."""
    seed: int = Field(0, ge=0)
    """Seed of the training prompt stream and of the demonstrations."""


    @model_validator(mode="after")
    def _enough_heldout_sums(self) -> BuiltinTask:
        most = 10 ** (2 * self.max_digits) // 20  # half the ~10% of prompts held out
        if self.name == "addition" and self.heldout_size > most:
            raise ValueError(
                f"`task.source.heldout_size` ({self.heldout_size}) exceeds half the held-out "
                f"sums of {self.max_digits}-digit numbers (about {2 * most}): lower "
                "heldout_size or raise max_digits")
        return self


class DatasetTask(Section):
    """User data: JSONL or Parquet files with `prompt` and `answer` (optional `category`)."""

    kind: Literal["dataset"] = "dataset"
    train_path: str = Field(min_length=1)
    """Training prompts (RL) and demonstrations (SFT)."""
    eval_path: str = Field(min_length=1)
    """Held-out prompts for evaluation."""
    prompt_template: str = "{prompt}"
    """Python format string applied to each prompt; `{prompt}` is replaced by the row's prompt
    (literal braces doubled: `{{` and `}}`)."""

    @field_validator("prompt_template")
    @classmethod
    def _one_prompt_field(cls, template: str) -> str:
        try:
            parts = [(name, spec, conversion) for _, name, spec, conversion
                     in string.Formatter().parse(template) if name is not None]
        except ValueError as exc:
            raise ValueError(f"is not a format string ({exc}); write literal braces as "
                             "{{ and }}") from None
        fields = {name for name, _, _ in parts}
        if "prompt" not in fields:
            raise ValueError("must hold {prompt}, where each row's prompt goes")
        if other := sorted(fields - {"prompt"}):
            raise ValueError(f"holds other fields than {{prompt}} "
                             f"({', '.join(repr(f) for f in other)}): write literal braces "
                             "as {{ and }}")
        if any(spec or conversion for _, spec, conversion in parts):
            # `{prompt:.0}` would empty every prompt, `{prompt!r}` quote it
            raise ValueError("writes {prompt} with a format spec or conversion: write "
                             "{prompt} alone")
        return template


TaskSource = Annotated[BuiltinTask | DatasetTask, Field(discriminator="kind")]


DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
"""`package.module:attribute`: user code, found where the stage runs."""
VERIFIER_NAMES = ("task", "exact_match", "math_final_answer", "numeric", "python_exec")
"""The verifiers a config may name (`tasks.verifiers` registers them; a test keeps the two
lists equal)."""
ENVIRONMENT_NAMES = ("calculator", "guess", "python")
"""The environments a config may name (registered in `tasks.environments`)."""


def _registered_name(kind: str, name: str, known: list[str], dotted: str) -> str:
    """`name` when it is one of `known` or a dotted path; else a ValueError saying what is."""
    if name in known or DOTTED.match(name):
        return name
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{kind} {name!r} is neither a registered name{hint}: one of "
                     f"{', '.join(known)}, nor a dotted path `{dotted}`")


class VerifierSpec(Section):
    """One verifier: a registered name or a dotted path `package.module:function`."""

    name: str = Field("task", min_length=1)
    """'task' (the task's own checker), 'exact_match', 'numeric', 'math_final_answer',
    'python_exec', or `package.module:function`."""
    weight: float = Field(1.0, ge=-100.0, le=100.0)
    """Weight in the composite reward."""
    sandboxed: bool = False
    """Run in a subprocess with CPU, memory and wall-clock limits (always on for python_exec)."""

    @model_validator(mode="after")
    def _known(self) -> VerifierSpec:
        if self.name == "task" and self.sandboxed:
            raise ValueError("the task's own checker runs in process: set `sandboxed: "
                             "false` for verifier 'task', or name a dotted-path verifier")
        _registered_name("verifier", self.name, list(VERIFIER_NAMES), "package.module:function")
        return self


class RewardModelSpec(Section):
    """A sequence-classification reward model with a single output."""

    path: str = Field(min_length=1)
    """Model folder (safetensors only)."""
    weight: float = Field(1.0, ge=-100.0, le=100.0)
    """Weight of the reward model's score in the composite reward."""
    batch_size: int = Field(32, ge=1, le=4096)
    """Texts scored per forward pass."""


class OverlongPenalty(Section):
    """Soft penalty for responses running into the token limit (DAPO's overlong shaping)."""

    buffer_tokens: int = Field(4, ge=1, le=65536)
    """Penalty ramps linearly over the last `buffer_tokens` before max_new_tokens."""
    penalty: float = Field(1.0, ge=0.0, le=100.0)
    """Penalty at the limit."""


class SandboxLimits(Section):
    """Limits for untrusted reward code."""

    cpu_seconds: float = Field(2.0, gt=0.0, le=3600.0)
    """CPU-time limit per call."""
    memory_mb: int = Field(512, ge=32, le=1_000_000)
    """Address-space limit per call."""
    wall_seconds: float = Field(5.0, gt=0.0, le=3600.0)
    """Wall-clock limit per call."""
    output_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    """Bytes a call may write to any file (its stdout included), and the most its result
    may take."""
    open_files: int = Field(256, ge=16, le=65536)
    """Files a call may hold open at once."""


class TaskConfig(Section):
    """Where prompts come from and how the model reads them."""

    source: TaskSource = BuiltinTask()
    """The task."""
    prompt_format: Literal["raw", "chat"] = "raw"
    """'raw': the prompt text as is; 'chat': the tokenizer's chat template applied to the
    prompt as a user message, ending with the assistant's turn (needs a tokenizer with a
    chat template). Rollout, evaluation and SFT format prompts the same way."""
    system_prompt: str | None = None
    """System message placed before the prompt (`prompt_format: chat` only)."""
    environment: str | None = Field(None, min_length=1, max_length=200)
    """Environment the policy acts in over `rollout.max_turns` turns: a registered name
    ('calculator', 'guess', 'python': a Python interpreter run in the sandbox under
    `reward.sandbox`'s limits) or `package.module:Class` (`tasks.environments`). The episode's
    reward is the sum of its turns' rewards. None: one response per sample, verified."""

    @model_validator(mode="after")
    def _known_environment(self) -> TaskConfig:
        if self.environment is not None:
            _registered_name("environment", self.environment, list(ENVIRONMENT_NAMES),
                             "package.module:Class")
        return self

    @model_validator(mode="after")
    def _episode_tasks_need_an_environment(self) -> TaskConfig:
        name = getattr(self.source, "name", None)
        if name in ("calculator", "guess") and self.environment is None:
            raise ValueError(f"task '{name}' is played in an environment: set "
                             f"`task.environment: {name}`")
        return self

    @model_validator(mode="after")
    def _system_prompt_needs_chat(self) -> TaskConfig:
        if self.system_prompt is not None and self.prompt_format != "chat":
            raise ValueError(
                "task.system_prompt is set but task.prompt_format is 'raw': a system prompt "
                "goes through the chat template, so set task.prompt_format: chat"
            )
        return self


class RewardConfig(Section):
    """How a response is scored before shaping."""

    verifiers: list[VerifierSpec] = [VerifierSpec()]
    """Verifiers summed with their weights."""
    reward_model: RewardModelSpec | None = None
    """Optional reward model (RLHF)."""
    overlong: OverlongPenalty | None = None
    """Optional overlong penalty."""
    sandbox: SandboxLimits = SandboxLimits()
    """Limits for sandboxed verifiers."""

    @model_validator(mode="after")
    def _something_scores(self) -> RewardConfig:
        if not self.verifiers and self.reward_model is None:
            raise ValueError(
                "nothing produces a reward: add an entry to `reward.verifiers` "
                "or set `reward.reward_model.path`"
            )
        return self
