"""LoRA on the learner (`learner.lora`): only the adapters train, published weights are the
merged W + B A * alpha / r, the KL reference is the frozen base, a checkpoint resumes the
adapters and their AdamW state exactly, and the config errors name what to change.

A tiny random Llama with tied embeddings and a byte-level BPE tokenizer with a chat
template; prompts go through `PromptFormat("chat")` as in rollout."""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shardrl.config import ConfigError, validate
from shardrl.learner_backends import build_backend
from shardrl.models.delta import publish_state
from shardrl.models.heads import token_logprobs
from shardrl.models.lora import adapters_off, add_lora, lora_layers, merged_state
from shardrl.stages.batch import build_batch
from shardrl.stages.update import compute_loss
from shardrl.tasks.prompts import PromptFormat

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
H, R, ALPHA = 16, 2, 4.0  # hidden size, rank, alpha: scaling = alpha / r = 2


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on sums, with a ChatML-style template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [f"{a}+{b}={a + b} user assistant system" for a in range(40) for b in range(0, 40, 7)]
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHAT_TEMPLATE
    return hf


def base_model(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def lora_model(vocab: int, seed: int = 1) -> LlamaForCausalLM:
    return add_lora(base_model(vocab), R, ALPHA, 0.0, ["q_proj", "v_proj"], seed=seed)


def table(tok, prompts: list[str], responses: list[str], advantages: list[float]) -> pa.Table:
    """Rows of chat prompts and responses, behaviour logprobs 0.1 below -1 (ratios vary)."""
    prompt_ids = PromptFormat("chat", "Add.").encode(tok, prompts)
    response_ids = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id]
                    for r in responses]
    n = len(prompts)
    return pa.table({
        "prompt_id": list(range(n)), "group_id": [i // 2 for i in range(n)],
        "sample_idx": [i % 2 for i in range(n)],
        "prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
        "advantage": advantages,
        "behavior_logprobs": pa.array([[-1.1] * len(r) for r in response_ids],
                                      pa.list_(pa.float32())),
        "ref_logprobs": pa.array([None] * n, pa.list_(pa.float32())),
    })


def cfg_with(**learner):
    return validate({"algo": {"kl": {"placement": "loss"}},
                     "learner": {"lr": 1e-2, "weight_decay": 0.0, "grad_clip": None,
                                 "lora": {"r": R, "alpha": ALPHA,
                                          "target_modules": ["q_proj", "v_proj"]},
                                 **learner}}, "test")


def test_only_the_adapters_train(tokenizer):
    model = lora_model(len(tokenizer))
    base = base_model(len(tokenizer))
    # q_proj (16 -> 16) and v_proj (16 -> 2 kv heads x 8 = 16): A is (2, 16), B is (16, 2)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(trainable) == sorted(
        f"model.layers.0.self_attn.{m}.lora_{ab}.default.weight"
        for m in ("q_proj", "v_proj") for ab in "AB")
    assert sum(trainable.values()) == 2 * (2 * 16 + 16 * 2) == 128
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen == sum(p.numel() for p in base.parameters())
    cfg = cfg_with()
    backend = build_backend(cfg.learner, model)
    assert sum(p.numel() for p in backend.params) == 128
    before = {k: t.clone() for k, t in model.state_dict().items()}
    rows = table(tokenizer, ["12+5=", "12+5=", "3+4=", "3+4="], ["17", "7", "7", "12"],
                 [1.0, -1.0, 1.0, -1.0])
    for _ in range(2):  # B is zero at first, so A's gradient is zero until B has moved
        loss, _, _ = compute_loss(cfg, backend.policy, rows, tokenizer.pad_token_id, beta=0.1)
        applied, _ = backend.step(loss)
        assert applied
    after = model.state_dict()
    for key, t in before.items():
        moved = not torch.equal(t, after[key])
        assert moved == (".lora_" in key), key


def test_published_weights_are_base_plus_scaled_product(tokenizer):
    model = lora_model(len(tokenizer))
    base = base_model(len(tokenizer)).state_dict()
    for layer in lora_layers(model).values():
        torch.nn.init.constant_(layer.lora_A["default"].weight, 0.5)  # (2, 16)
        torch.nn.init.constant_(layer.lora_B["default"].weight, 0.25)  # (16, 2)
    # (B A)[i, j] = 2 * 0.25 * 0.5 = 0.25, times alpha / r = 2: every element moves by 0.5
    merged = merged_state(model)
    assert sorted(merged) == sorted(base)
    for key, w in base.items():
        shift = 0.5 if key.endswith(("q_proj.weight", "v_proj.weight")) else 0.0
        assert torch.equal(merged[key], w + shift), key
    published = publish_state(model, torch.bfloat16)
    assert "lm_head.weight" not in published  # tied: stored once, as the embedding
    assert all(t.dtype == torch.bfloat16 for t in published.values())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(published[q], (base[q] + 0.5).to(torch.bfloat16))
    # rollout loads them into a plain model, which computes as the adapted one
    plain = base_model(len(tokenizer))
    plain.load_state_dict(publish_state(model, torch.float32), strict=False)
    ids = torch.tensor([[5, 9, 12, 7, 3]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(plain, ids, mask, 2).logprobs,
                                   token_logprobs(model, ids, mask, 2).logprobs)


def test_reference_is_the_frozen_base(tokenizer):
    model = lora_model(len(tokenizer))
    pristine = copy.deepcopy(base_model(len(tokenizer)))
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    backend = build_backend(cfg_with().learner, model)
    rows = table(tokenizer, ["12+5=", "3+4="], ["17", "7"], [1.0, -1.0])
    batch = build_batch(rows, tokenizer.pad_token_id)
    args = (batch.input_ids, batch.attention_mask, batch.response_start)
    ref = backend.policy.reference(*args)
    with torch.no_grad():  # the same forward as the learner's (prompts shared or not)
        base_lp = token_logprobs(pristine, *args,
                                 share_prompts=backend.policy.share_prompts).logprobs
        adapted = backend.policy(*args).logprobs
    assert torch.equal(ref, base_lp)
    assert not torch.allclose(adapted, base_lp, atol=1e-3)  # the adapters do change it
    # after the base forward the adapters compute and train again
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)
    with torch.no_grad():
        assert torch.equal(backend.policy(*args).logprobs, adapted)
    with adapters_off(model), torch.no_grad():
        assert torch.equal(token_logprobs(model, *args,
                                          share_prompts=backend.policy.share_prompts).logprobs,
                           base_lp)

    # the KL term of the loss uses it when the shards carry no reference logprobs
    cfg = cfg_with()
    assert cfg.learner_reference
    loss, metrics, _ = compute_loss(cfg, backend.policy, rows, tokenizer.pad_token_id, beta=0.5)
    given = rows.set_column(rows.schema.get_field_index("ref_logprobs"), "ref_logprobs",
                            pa.array([r[: len(t)] for r, t in zip(
                                base_lp.tolist(), rows.column("response_token_ids").to_pylist(),
                                strict=True)], pa.list_(pa.float32())))
    loss2, metrics2, _ = compute_loss(cfg, backend.policy, given, tokenizer.pad_token_id,
                                      beta=0.5)
    assert float(metrics["kl_mean"]) > 0
    assert float(metrics["kl_mean"]) == pytest.approx(float(metrics2["kl_mean"]), rel=1e-6)
    assert float(loss.detach()) == pytest.approx(float(loss2.detach()), rel=1e-6)


def test_checkpoint_resumes_bit_exactly(tokenizer):
    cfg = cfg_with()
    pad = tokenizer.pad_token_id
    batches = [table(tokenizer, ["12+5=", "12+5=", "3+4=", "3+4="], ["17", "7", "7", "12"],
                     [1.0, -1.0, 1.0, -1.0]),
               table(tokenizer, ["20+13=", "20+13="], ["33", "34"], [1.0, -1.0])]

    def step(backend, rows):
        loss, _, _ = compute_loss(cfg, backend.policy, rows, pad, beta=0.1)
        assert backend.step(loss)[0]

    model = lora_model(len(tokenizer))
    backend = build_backend(cfg.learner, model)
    for rows in batches:
        step(backend, rows)
    saved = st_save(backend.state_dict())  # as the learner's checkpoint writes it
    for rows in batches:  # the run goes on ...
        step(backend, rows)

    resumed = lora_model(len(tokenizer), seed=99)  # other adapter inits, overwritten by the load
    backend2 = build_backend(cfg.learner, resumed)
    backend2.load_state_dict(st_load(saved))
    state = st_load(saved)
    assert float(state["step"]) == 2
    assert sum(1 for k in state if k.endswith("/weight")) == 4  # A and B of q_proj and v_proj
    for rows in batches:  # ... and so does the resumed one, from the checkpoint
        step(backend2, rows)
    a, b = model.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for key, t in publish_state(model, torch.bfloat16).items():
        assert torch.equal(t, publish_state(resumed, torch.bfloat16)[key]), key


def test_a_checkpoint_without_the_adapters_is_refused(tokenizer):
    cfg = cfg_with()
    full = build_backend(cfg.learner, base_model(len(tokenizer)))  # full fine-tuning's state
    backend = build_backend(cfg.learner, lora_model(len(tokenizer)))
    with pytest.raises(KeyError, match="lora_A.default.weight/weight"):
        backend.load_state_dict(full.state_dict())


def test_config_errors_name_the_fix():
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(ConfigError, match="torch backend only"):
        validate({"learner": {"lora": lora, "backend": {"kind": "deepspeed"}}}, "test")
    with pytest.raises(ConfigError, match=r"names \['lm_head'\]: the output head"):
        validate({"learner": {"lora": {"target_modules": ["q_proj", "lm_head"]}}}, "test")
    with pytest.raises(ConfigError, match="keep_checkpoints` of at least 2"):
        validate({"learner": {"lora": lora, "keep_checkpoints": 1}}, "test")
    with pytest.raises(ConfigError, match="learner.lora.r"):
        validate({"learner": {"lora": {"r": 0}}}, "test")
    with pytest.raises(ConfigError, match="unknown key 'rank'"):
        validate({"learner": {"lora": {"rank": 4}}}, "test")
    assert validate({}, "test").learner.lora is None
    # the learner computes the reference only for KL in the loss against the initial policy
    on = validate({"learner": {"lora": lora}, "algo": {"kl": {"placement": "loss"}}}, "test")
    assert on.learner_reference and on.inline_blocker() is None
    reward = validate({"learner": {"lora": lora}, "algo": {"kl": {"placement": "reward"}}},
                      "test")
    assert not reward.learner_reference and reward.inline_blocker() is not None
    full = validate({"algo": {"kl": {"placement": "loss"}}}, "test")
    assert not full.learner_reference


def test_adapter_init_is_a_function_of_the_seed(tokenizer):
    bases = [base_model(len(tokenizer)) for _ in range(3)]
    rng = torch.get_rng_state()
    models = [add_lora(m, R, ALPHA, 0.0, ["q_proj"], seed=s)
              for m, s in zip(bases, (3, 3, 4), strict=True)]
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left as it was
    a = [next(iter(lora_layers(m).values())).lora_A["default"].weight for m in models]
    assert torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
