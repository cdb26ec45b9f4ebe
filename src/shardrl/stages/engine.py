"""Building the configured generation engine for a policy version (rollout and evaluate)."""

from __future__ import annotations

from transformers.tokenization_utils_tokenizers import TokenizersBackend

from ..engines.hf import HFEngine
from ..tasks.prompts import PromptFormat
from .channel import Channel
from .context import StageContext
from .policy import BasePolicy, PolicyWeights, load_policy


class PolicyEngine:
    """An engine that follows the published policy versions, reloading weights in place.

    It keeps the published weights of its version (`PolicyWeights`), so moving to a newer
    version reads only the deltas since, or the newest full snapshot when one of them is gone.
    """

    def __init__(self, ctx: StageContext, version: int, base: BasePolicy | None = None) -> None:
        """`base`: v0 loaded early (`StageContext.preload_policy`); None: loaded here."""
        self.ctx = ctx
        model, self.tokenizer = (base.take() if base is not None
                                 else load_policy(ctx.store, ctx.keys, 0, ctx.cache_dir()))
        self.weights = PolicyWeights()
        self.from_channel = 0
        """Versions loaded from the weights channel (`take`)."""
        self.prompt_format = PromptFormat.from_config(ctx.cfg)
        self.prompt_format.check(self.tokenizer)
        self.context: int | None = getattr(model.config, "max_position_embeddings", None)
        """Longest prompt + response the model takes (None: unbounded)."""
        cfg = ctx.cfg
        if cfg.rollout.engine == "vllm":
            from ..engines.vllm import VLLMEngine

            self.engine = VLLMEngine.from_model(model, self.tokenizer, ctx.cache_dir(),
                                                fp32_lm_head=cfg.model.fp32_lm_head,
                                                gpu_memory_utilization=cfg.rollout.gpu_memory_utilization)
        else:
            self.engine = HFEngine(model, eos_token_id=self.tokenizer.eos_token_id,
                                   pad_token_id=self.tokenizer.pad_token_id,
                                   fp32_lm_head=cfg.model.fp32_lm_head, version=0)
        self.ensure(version)

    @property
    def version(self) -> int:
        return self.engine.version

    def fits(self, prompt_tokens: int, room: int) -> bool:
        """Whether a prompt of `prompt_tokens` tokens can be sampled from with `room` new
        tokens: it has a token (an empty one would be sampled from padding alone) and the
        two fit the model's context."""
        return 0 < prompt_tokens and (self.context is None
                                      or prompt_tokens + room <= self.context)

    def ensure(self, version: int) -> bool:
        """Load `version` if it is not the current one; True when weights changed."""
        if version == self.engine.version:
            return False
        state = self.weights.get(self.ctx.store, self.ctx.keys, version)
        self.engine.load_weights(state, version)
        return True

    def take(self, channel: Channel, committed: int) -> bool:
        """Load the weights channel's newest version if it is newer than this engine's and
        than `committed` (the store's newest); True when it did."""
        version = channel.latest()
        if version is None or version <= max(committed, self.engine.version):
            return False
        state = channel.load(version)
        if state is None:  # replaced by a newer one meanwhile: the store has this one soon
            return False
        # no base for the store's deltas: should the learner crash before this version's
        # commit, its restart makes a different one, and deltas applied to this would drift
        self.weights.state, self.weights.version = {}, None
        self.engine.load_weights(state, version)
        self.from_channel += 1
        return True

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Prompt token ids in the run's `task.prompt_format`."""
        return self.prompt_format.encode(self.tokenizer, prompts)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def decode_all(self, sequences: list[list[int]]) -> list[str]:
        """`decode` of each sequence (special tokens skipped), the same strings."""
        return decode_all(self.tokenizer, sequences)


def decode_all(tokenizer, sequences: list[list[int]]) -> list[str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` of each sequence. A fast tokenizer
    whose decoding is the library's own (neither `decode` nor `_decode` overridden, as some
    model-specific tokenizers do) and cleans up no spaces decodes straight through its
    Rust backend: the same strings, without the Python layers around each call (about a
    fifth of the time; a demo shard's 128 responses took 0.3-0.5 ms one call each). Any other
    tokenizer decodes one call per sequence, as `decode` does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    kind = type(tokenizer)
    if (backend is None or tokenizer.clean_up_tokenization_spaces
            or kind.decode is not TokenizersBackend.decode
            or kind._decode is not TokenizersBackend._decode):
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]
    return [backend.decode(ids, skip_special_tokens=True) for ids in sequences]
