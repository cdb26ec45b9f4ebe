"""The vLLM engine's own logic on CPU, with a stand-in for `vllm.LLM`.

The stand-in runs the transformers engine and reloads weights through the real worker
extension (`WeightReloadExtension`), so these tests cover request seeding, sample conversion,
the in-place reload, the greedy check and the rebuild fallback; vLLM itself is exercised by
tests/gpu.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardrl.engines.base import mixed_seed
from shardrl.engines.hf import HFEngine
from shardrl.engines.vllm import (
    ReloadMismatchError,
    VLLMEngine,
    VLLMSettings,
    greedy_agreement,
    to_sample,
)
from shardrl.engines.vllm_worker import WeightReloadExtension
from shardrl.models.io import load_causal_lm

EOS, PAD = 2, 0
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def lm(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
                      tie_word_embeddings=False)  # tied, random greedy tokens repeat the input
    return LlamaForCausalLM(cfg).eval()


def hf(model) -> HFEngine:
    return HFEngine(model, eos_token_id=EOS, pad_token_id=PAD)


class FakeVLLMModel:
    """A vLLM model's `load_weights(iterable of (name, tensor)) -> loaded names`."""

    def __init__(self, model) -> None:
        self.model = model

    def load_weights(self, weights):
        state = dict(weights)
        self.model.load_state_dict(state, strict=False)
        return set(state)


class FakeWorker(WeightReloadExtension):
    """What vLLM mixes the extension into: a worker whose model runner has the model."""

    def __init__(self, model) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: FakeVLLMModel(model))


class FakeLLM:
    """`vllm.LLM` stand-in over the transformers engine; `mode` breaks the in-place reload."""

    def __init__(self, folder: Path, mode: str = "ok") -> None:
        self.engine, self.mode = hf(load_causal_lm(folder)), mode
        self.worker = FakeWorker(self.engine.model)
        self.prefix_resets = 0

    def generate(self, requests, params, use_tqdm=False):
        outs = []
        for req, p in zip(requests, params, strict=True):
            [s] = self.engine.generate([req["prompt_token_ids"]], 1, temperature=p.temperature,
                                       top_p=p.top_p, max_new_tokens=p.max_tokens,
                                       seed=p.seed)[0]
            lps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(s.token_ids, s.logprobs,
                                                                     strict=True)]
            done = SimpleNamespace(token_ids=s.token_ids, logprobs=lps,
                                   finish_reason=s.finish_reason)
            outs.append(SimpleNamespace(outputs=[done]))
        return outs

    def collective_rpc(self, method, args=()):
        if self.mode == "no-extension":
            raise AttributeError(f"worker has no method {method}")
        if self.mode == "stale":  # claims success, loads nothing into the live model
            return [10]
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self):
        self.prefix_resets += 1


def engine(tmp_path: Path, mode: str = "ok", rebuild_mode: str = "ok") -> VLLMEngine:
    base = tmp_path / "vllm" / "base"
    lm(0).save_pretrained(str(base), safe_serialization=True)
    builds = []

    def make_llm(folder: Path) -> FakeLLM:
        builds.append(folder)
        return FakeLLM(folder, mode if len(builds) == 1 else rebuild_mode)

    return VLLMEngine(make_llm, lambda **kw: SimpleNamespace(**kw), base, eos_token_id=EOS,
                      reference=hf(lm(0)), verify_reloads=1, check_tokens=6)


def test_greedy_agreement_by_hand():
    assert greedy_agreement([[1, 2, 3]], [[1, 2, 4]]) == pytest.approx(2 / 3)
    assert greedy_agreement([[1], [7, 8]], [[1, 5], [7, 8]]) == pytest.approx((1 / 2 + 1) / 2)
    assert greedy_agreement([[]], [[]]) == 0.0


def test_to_sample_reads_the_sampled_tokens_logprob():
    out = SimpleNamespace(token_ids=[5, 2], finish_reason="stop",
                          logprobs=[{5: SimpleNamespace(logprob=-0.5)},
                                    {2: SimpleNamespace(logprob=-1.25)}])
    s = to_sample(out, greedy=False)
    assert (s.token_ids, s.logprobs, s.finish_reason) == ([5, 2], [-0.5, -1.25], "stop")
    s = to_sample(SimpleNamespace(token_ids=[5], logprobs=None, finish_reason="length"), True)
    assert (s.logprobs, s.finish_reason) == ([0.0], "length")


def test_llm_settings():
    kw = VLLMSettings(gpu_memory_utilization=0.3).llm_kwargs(Path("/m"))
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["hf_overrides"] == {"head_dtype": "float32"}
    assert kw["worker_extension_cls"] == "shardrl.engines.vllm_worker.WeightReloadExtension"
    assert "hf_overrides" not in VLLMSettings(fp32_lm_head=False).llm_kwargs(Path("/m"))


def test_samples_follow_per_request_seeds(tmp_path: Path):
    eng = engine(tmp_path)
    got = eng.generate(PROMPTS, 2, temperature=1.0, top_p=0.9, max_new_tokens=5, seed=7)
    reference = hf(lm(0))
    for i, prompt in enumerate(PROMPTS):
        for j in range(2):  # sample j of prompt i is request i * n + j, seeded (7, i, j)
            [want] = reference.generate([prompt], 1, temperature=1.0, top_p=0.9,
                                        max_new_tokens=5, seed=mixed_seed(7, i, j))[0]
            assert (got[i][j].token_ids, got[i][j].finish_reason) == (want.token_ids,
                                                                      want.finish_reason)
            # the stand-in's model was read back from disk: float32 rounding may differ
            assert got[i][j].logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert got[0][0].token_ids != got[0][1].token_ids or got[0][0].logprobs != got[0][1].logprobs


def test_in_place_reload_passes_the_check(tmp_path: Path):
    eng = engine(tmp_path)
    eng.generate(PROMPTS, 1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    eng.load_weights(lm(1).state_dict(), version=1)
    assert (eng.version, eng.rebuilds, eng.last_agreement) == (1, 0, 1.0)
    assert eng.llm.prefix_resets == 1
    greedy = eng.generate(PROMPTS, 1, temperature=0.0, top_p=1.0, max_new_tokens=6, seed=0)
    want = hf(lm(1)).generate(PROMPTS, 1, temperature=0.0, top_p=1.0, max_new_tokens=6, seed=0)
    assert [[s.token_ids for s in g] for g in greedy] == [[s.token_ids for s in g] for g in want]


@pytest.mark.parametrize("mode", ["stale", "no-extension"])
def test_failed_in_place_reload_rebuilds_from_the_new_weights(tmp_path: Path, mode: str):
    eng = engine(tmp_path, mode=mode)
    eng.generate(PROMPTS, 1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    eng.load_weights(lm(1).state_dict(), version=3)
    assert (eng.version, eng.rebuilds, eng.last_agreement) == (3, 1, 1.0)
    assert (tmp_path / "vllm" / "rebuild" / "model.safetensors").exists()


def test_mismatch_after_rebuild_is_an_error(tmp_path: Path):
    eng = engine(tmp_path, mode="stale")
    # the rebuilt engine serves the old weights whatever folder it is given
    eng.make_llm = lambda folder: FakeLLM(eng.base_dir, "stale")
    eng.generate(PROMPTS, 1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    with pytest.raises(ReloadMismatchError, match="agree"):
        eng.load_weights(lm(1).state_dict(), version=2)
