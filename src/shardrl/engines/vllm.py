"""Generation with vLLM (the GPU rollout image), behind the same `Engine` interface as `hf`.

- Sampling: one vLLM request per sample (seed `mixed_seed(seed, i, j)` for sample j of prompt i), so
  the samples of a group differ and a run is reproducible whatever vLLM does with `n`.
- Behaviour logprobs: `logprobs=0` returns the sampled token's logprob, and
  `logprobs_mode="processed_logprobs"` makes it the logprob under the distribution the token
  was drawn from (after temperature and top-p), as `Engine.generate` specifies.
- FP32 LM head: `hf_overrides={"head_dtype": "float32"}` (vLLM computes the logits of a
  generation model in the head dtype).
- New policy versions: the weights go to a safetensors file that every worker loads in
  place (`collective_rpc` into `vllm_worker.WeightReloadExtension`), then the prefix cache is
  reset. If that fails, or the check below fails, the engine is rebuilt from a folder
  holding the new weights.
- Check after a reload (the first `verify_reloads` ones): greedy tokens on a few recent
  prompts must agree with a transformers engine holding the same weights.
"""

from __future__ import annotations

import gc
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .base import Sample, mixed_seed
from .hf import HFEngine

log = logging.getLogger(__name__)

WORKER_EXTENSION = "shardrl.engines.vllm_worker.WeightReloadExtension"
RELOAD_METHOD = "shardrl_load_weights"
WEIGHTS = "model.safetensors"


class ReloadMismatchError(RuntimeError):
    """vLLM's greedy tokens disagree with the reference engine even after a clean rebuild."""


def greedy_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Mean over prompts of (common prefix length / longer length); 1.0 when identical."""
    scores = []
    for x, y in zip(a, b, strict=True):
        common = 0
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            common += 1
        scores.append(common / max(len(x), len(y), 1))
    return sum(scores) / max(len(scores), 1)


def to_sample(completion: Any, greedy: bool) -> Sample:
    """A vLLM `CompletionOutput` as a `Sample` (the sampled token's logprob at each step)."""
    tokens = [int(t) for t in completion.token_ids]
    if greedy:
        logprobs = [0.0] * len(tokens)
    else:
        logprobs = [float(completion.logprobs[i][t].logprob) for i, t in enumerate(tokens)]
    reason = "stop" if completion.finish_reason == "stop" else "length"
    return Sample(token_ids=tokens, logprobs=logprobs, finish_reason=reason)


def load_state(state_dict_or_dir: dict[str, torch.Tensor] | str | Path) -> dict[str, torch.Tensor]:
    """A state dict, or every `*.safetensors` file of a folder merged into one."""
    if isinstance(state_dict_or_dir, dict):
        return state_dict_or_dir
    files = sorted(Path(state_dict_or_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {state_dict_or_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Save a state dict as one safetensors file (contiguous CPU copies, tied keys split)."""
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}, str(path))


@dataclass(frozen=True)
class VLLMSettings:
    """How the engine builds its `vllm.LLM`."""

    gpu_memory_utilization: float = 0.5
    fp32_lm_head: bool = True
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False

    def llm_kwargs(self, model_dir: Path) -> dict:
        kwargs = dict(model=str(model_dir), tokenizer=str(model_dir), dtype=self.dtype,
                      gpu_memory_utilization=self.gpu_memory_utilization, seed=self.seed,
                      enforce_eager=self.enforce_eager, logprobs_mode="processed_logprobs",
                      worker_extension_cls=WORKER_EXTENSION)
        if self.fp32_lm_head:
            kwargs["hf_overrides"] = {"head_dtype": "float32"}
        return kwargs


def vllm_factory(settings: VLLMSettings) -> tuple[Callable[[Path], Any], Callable[..., Any]]:
    """(build an LLM from a model folder, build SamplingParams) with the real vLLM."""
    from vllm import LLM, SamplingParams

    return (lambda folder: LLM(**settings.llm_kwargs(folder))), SamplingParams


class VLLMEngine:
    """The `Engine` implementation on vLLM. Build it with `from_model`."""

    def __init__(self, make_llm: Callable[[Path], Any], make_params: Callable[..., Any],
                 base_dir: Path, *, eos_token_id: int, reference: HFEngine | None,
                 verify_reloads: int = 1, min_agreement: float = 0.9, check_prompts: int = 3,
                 check_tokens: int = 8, version: int = 0) -> None:
        self.make_llm, self.make_params = make_llm, make_params
        self.base_dir, self.work_dir = base_dir, base_dir.parent
        self.eos_token_id = eos_token_id
        self.reference = reference
        self.verify_reloads, self.min_agreement = verify_reloads, min_agreement
        self.check_prompts, self.check_tokens = check_prompts, check_tokens
        self.version = version
        self.reloads = 0
        self.rebuilds = 0
        self.last_agreement: float | None = None
        self.recent_prompts: list[list[int]] = []
        self.llm = make_llm(base_dir)

    @classmethod
    def from_model(cls, model: PreTrainedModel, tokenizer, cache_dir: Path, *,
                   fp32_lm_head: bool = True, gpu_memory_utilization: float = 0.5,
                   dtype: str = "auto", seed: int = 0, verify_reloads: int = 1) -> VLLMEngine:
        """Write `model` and `tokenizer` as a folder under `cache_dir/vllm/` and start vLLM.

        The transformers `model` stays in memory as the reference of the reload check when
        `verify_reloads > 0` (it then follows every weight update on the CPU).
        """
        base = Path(cache_dir) / "vllm" / "base"
        if base.exists():
            shutil.rmtree(base)
        model.save_pretrained(str(base), safe_serialization=True)
        tokenizer.save_pretrained(str(base))
        settings = VLLMSettings(gpu_memory_utilization=gpu_memory_utilization,
                                fp32_lm_head=fp32_lm_head, dtype=dtype, seed=seed)
        make_llm, make_params = vllm_factory(settings)
        reference = None
        if verify_reloads > 0:
            reference = HFEngine(model, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, fp32_lm_head=fp32_lm_head)
        return cls(make_llm, make_params, base, eos_token_id=tokenizer.eos_token_id,
                   reference=reference, verify_reloads=verify_reloads)

    # -- generation -------------------------------------------------------------------------
    def _run(self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
             max_new_tokens: int, seed: int) -> list[list[Sample]]:
        greedy = temperature <= 0
        requests, params = [], []
        for i, prompt in enumerate(prompt_token_ids):
            for j in range(n):
                requests.append({"prompt_token_ids": list(prompt)})
                params.append(self.make_params(
                    n=1, temperature=max(temperature, 0.0), top_p=1.0 if greedy else top_p,
                    max_tokens=max_new_tokens, seed=mixed_seed(seed, i, j), logprobs=0,
                    stop_token_ids=[self.eos_token_id], detokenize=False))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = [to_sample(out.outputs[0], greedy) for out in outputs]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompt_token_ids))]

    def generate(self, prompt_token_ids: list[list[int]], n: int, *, temperature: float,
                 top_p: float, max_new_tokens: int, seed: int) -> list[list[Sample]]:
        """Sample `n` responses per prompt; see `Engine.generate`."""
        for prompt in prompt_token_ids:
            if len(self.recent_prompts) >= self.check_prompts:
                break
            if prompt not in self.recent_prompts:
                self.recent_prompts.append(list(prompt))
        return self._run(prompt_token_ids, n, temperature, top_p, max_new_tokens, seed)

    # -- weights ----------------------------------------------------------------------------
    def _reload_in_place(self, path: Path) -> bool:
        try:
            counts = self.llm.collective_rpc(RELOAD_METHOD, args=(str(path),))
        except (AttributeError, NotImplementedError, RuntimeError, ValueError) as err:
            log.warning("in-place weight reload failed (%s); rebuilding the engine", err)
            return False
        if not counts or min(counts) == 0:
            log.warning("in-place weight reload loaded no tensors; rebuilding the engine")
            return False
        self.llm.reset_prefix_cache()  # cached keys/values belong to the old weights
        return True

    def _rebuild(self, weights: Path) -> None:
        """A fresh LLM from a folder: the base folder's config and tokenizer, the new weights."""
        folder = self.work_dir / "rebuild"
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(self.base_dir, folder, ignore=shutil.ignore_patterns("*.safetensors",
                                                                            "*.index.json"))
        shutil.copyfile(weights, folder / WEIGHTS)
        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.llm = self.make_llm(folder)
        self.rebuilds += 1

    def check_reload(self) -> float:
        """Agreement of greedy tokens (vLLM vs the reference engine) on recent prompts."""
        if self.reference is None:
            raise RuntimeError("no reference engine: build with verify_reloads > 0")
        prompts = self.recent_prompts or [[self.eos_token_id]]
        ours = self._run(prompts, 1, 0.0, 1.0, self.check_tokens, 0)
        theirs = self.reference.generate(prompts, 1, temperature=0.0, top_p=1.0,
                                         max_new_tokens=self.check_tokens, seed=0)
        return greedy_agreement([s[0].token_ids for s in ours], [s[0].token_ids for s in theirs])

    def load_weights(self, state_dict_or_dir: dict[str, torch.Tensor] | str | Path,
                     version: int) -> None:
        """Load a new policy version, in place when vLLM allows it; see the module doc."""
        state = load_state(state_dict_or_dir)
        path = self.work_dir / "reload.safetensors"
        write_weights(state, path)
        in_place = self._reload_in_place(path)
        if not in_place:
            self._rebuild(path)
        self.reloads += 1
        self.version = version
        if self.reference is None or self.reloads > self.verify_reloads:
            return
        self.reference.load_weights(state, version)
        self.last_agreement = self.check_reload()
        if self.last_agreement < self.min_agreement and in_place:
            log.warning("greedy agreement %.3f after an in-place reload; rebuilding",
                        self.last_agreement)
            self._rebuild(path)
            self.last_agreement = self.check_reload()
        if self.last_agreement < self.min_agreement:
            raise ReloadMismatchError(
                f"policy v{version}: vLLM's greedy tokens agree with the reference on "
                f"{self.last_agreement:.3f} < {self.min_agreement} of the probe")
