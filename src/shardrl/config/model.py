"""Model, reference and supervised warm-start (SFT) settings."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .base import Section


class TinyModel(Section):
    """A small Llama-style model built from scratch, with a tokenizer trained locally."""

    kind: Literal["tiny"] = "tiny"
    hidden_size: int = Field(128, ge=8, le=16384)
    """Width of the residual stream."""
    num_layers: int = Field(2, ge=1, le=128)
    """Number of transformer blocks."""
    num_heads: int = Field(4, ge=1, le=256)
    """Attention heads; must divide hidden_size."""
    intermediate_size: int = Field(512, ge=8, le=65536)
    """Width of the MLP."""
    max_position_embeddings: int = Field(64, ge=16, le=131072)
    """Longest prompt + response the model can take."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size}): "
                "change one of `model.source.num_heads` / `model.source.hidden_size`"
            )
        return self


class PretrainedModel(Section):
    """A Hugging Face model folder on local disk (weights as safetensors only)."""

    kind: Literal["pretrained"] = "pretrained"
    path: str = Field(min_length=1)
    """Folder with config.json, *.safetensors and the tokenizer files."""


ModelSource = Annotated[TinyModel | PretrainedModel, Field(discriminator="kind")]


class SFTConfig(Section):
    """Supervised warm start on task demonstrations, run by the snapshot stage."""

    enabled: bool = True
    """Run SFT before RL; when False the snapshot stage copies the model as is."""
    demonstrations: int = Field(512, ge=1, le=10_000_000)
    """Number of (prompt, answer) demonstrations: a limited set, disjoint from held-out prompts."""
    max_epochs: int = Field(60, ge=1, le=10_000)
    """Upper bound on passes over the demonstrations."""
    batch_size: int = Field(32, ge=1, le=65536)
    """Demonstrations per optimizer step."""
    lr: float = Field(3e-3, gt=0.0, le=1.0)
    """Peak AdamW learning rate."""
    warmup_steps: int = Field(20, ge=0, le=1_000_000)
    """Linear warmup steps."""
    patience: int = Field(5, ge=1, le=1000)
    """Stop after this many epochs without improvement of the validation loss (the plateau)."""
    validation_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    """Not used: the plateau is detected on the task's validation split, which is disjoint
    from the demonstrations and the held-out set (a built-in task's own; a dataset's first
    tenth of its training rows, up to 256). Kept so that configs and runs that name it load."""


class ModelConfig(Section):
    """The policy, its frozen reference and their numerics."""

    source: ModelSource = TinyModel()
    """Where the initial policy comes from."""
    reference: str = "initial"
    """Frozen KL reference: 'initial' (the snapshot of the policy), 'none', or a model folder."""
    fp32_lm_head: bool = True
    """Compute logits in float32 in both generator and learner (ScaleRL)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype policy versions are published in (`learner.publish.dtype: auto`): the
    generator samples with the weights rounded to it. Both the generator and the torch learner
    compute in float32 whatever it is (the learner keeps float32 weights; DeepSpeed's `bf16`
    sets its own compute dtype): it halves what a version costs to store and send, not the
    memory or time of computing."""
    sft: SFTConfig = SFTConfig()
    """Supervised warm start before RL."""
