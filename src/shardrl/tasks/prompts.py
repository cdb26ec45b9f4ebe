"""How a task's prompt text becomes the token ids a model sees (`task.prompt_format`).

`raw` feeds the prompt text as it is (with whatever special tokens the tokenizer adds, e.g.
a leading BOS). `chat` applies the tokenizer's chat template to the prompt as one user
message, after an optional system message, and ends with the opening of the assistant's turn
(`add_generation_prompt=True`); the templated text carries its own special tokens, so none
are added when it is tokenized.

Every place that tokenizes a prompt goes through `PromptFormat`: rollout and evaluate
(`stages.engine.PolicyEngine.encode`), the SFT demonstrations of the snapshot stage (the
answer's tokens and EOS are appended after the formatted prompt's), and the benchmarks'
peers. A response is the same token sequence in all of them, whatever the format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


class PromptFormatError(ValueError):
    """The configured prompt format cannot be applied with this tokenizer."""


_MARK = "QZXJ"
"""Stand-in content of an assistant message, to find where the template closes it."""


@dataclass(frozen=True)
class PromptFormat:
    """`task.prompt_format` and `task.system_prompt` applied with a tokenizer."""

    kind: Literal["raw", "chat"] = "raw"
    system_prompt: str | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> PromptFormat:
        """The format of a `RunConfig` (its `task` section)."""
        return cls(cfg.task.prompt_format, cfg.task.system_prompt)

    def check(self, tokenizer: Any) -> None:
        """Raise `PromptFormatError` when `chat` is asked of a tokenizer without a chat
        template."""
        if self.kind == "chat" and not getattr(tokenizer, "chat_template", None):
            raise PromptFormatError(
                "task.prompt_format is 'chat' but the model's tokenizer has no chat template "
                "(tokenizer_config.json `chat_template` or chat_template.jinja): use "
                "task.prompt_format: raw, or a model folder whose tokenizer ships a template")

    def text(self, tokenizer: Any, prompt: str) -> str:
        """The prompt as the model reads it, before tokenization."""
        if self.kind == "raw":
            return prompt
        self.check(tokenizer)
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)

    def encode(self, tokenizer: Any, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt, ready for generation (the response follows them)."""
        if not prompts:
            return []
        texts = [self.text(tokenizer, p) for p in prompts]
        return [list(ids) for ids in
                tokenizer(texts, add_special_tokens=self.kind == "raw")["input_ids"]]

    def observation_text(self, tokenizer: Any, observation: str) -> str:
        """What follows a policy turn (which ends with its EOS) in a multi-turn episode:
        `raw`, the environment's reply as is; `chat`, the reply as the next user message and
        the opening of the assistant's next turn, as the chat template writes them (the
        template's text after an assistant message's end, which the policy's EOS stands for)."""
        if self.kind == "raw":
            return observation
        self.check(tokenizer)
        head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
        before = tokenizer.apply_chat_template(head, tokenize=False)
        after = tokenizer.apply_chat_template(head + [{"role": "user", "content": observation}],
                                              tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            raise PromptFormatError("the chat template rewrites earlier messages when one is "
                                    "added: multi-turn episodes need task.prompt_format: raw")
        end = before[before.rindex(_MARK) + len(_MARK):]  # the assistant message's closing
        eos = tokenizer.eos_token or ""
        closing = end[end.index(eos) + len(eos):] if eos and eos in end else ""
        return closing + after[len(before):]

    def encode_observation(self, tokenizer: Any, observation: str) -> list[int]:
        """Token ids of `observation_text` (no special tokens added)."""
        text = self.observation_text(tokenizer, observation)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def encode_pair(self, tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], int]:
        """(prompt ids + answer ids + EOS, index where the answer starts): a demonstration
        as the model would have generated it after `encode([prompt])`."""
        ids = self.encode(tokenizer, [prompt])[0]
        target = tokenizer(answer, add_special_tokens=False)["input_ids"]
        return ids + list(target) + [tokenizer.eos_token_id], len(ids)
