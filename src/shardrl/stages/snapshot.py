"""snapshot: build or load the base model, SFT it, publish ref/, policy/v000000/ and run.json.

Before publishing v0 (`policy/LATEST.json`, then run.json) it evaluates it as the evaluate
stage would (`evaluate.evaluate_snapshot`; with the HF engine), so the stages that start on
run.json have the cores to themselves. The rollout workers and the learner load v0 meanwhile
(`policy.BasePolicy`), beside that evaluation."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from .. import __version__
from ..config import ConfigError, FieldError
from ..config.model import PretrainedModel
from ..models.io import (
    UnsafeWeightsError,
    check_safe_weights_dir,
    check_tokenizers_match,
    directory_manifest,
    load_causal_lm,
    load_tokenizer,
    save_model,
)
from ..models.tiny import build_tiny_model, train_tokenizer
from ..store import Store
from ..tasks.prompts import PromptFormat
from ..tasks.source import make_task
from .context import StageContext
from .evaluate import evaluate_snapshot, evaluates_snapshot
from .policy import MANIFEST, point_latest
from .sft import encode_episodes, train_sft


def main(ctx: StageContext) -> int:
    cfg, keys, store = ctx.cfg, ctx.keys, ctx.store
    if store.exists(keys.run_json()):
        ctx.log.info("run %s already has a snapshot; nothing to do", ctx.run_id)
        return 0
    task = make_task(cfg)
    started = time.time()
    if cfg.model.reference not in ("initial", "none"):
        _check_folder(cfg.model.reference, "model.reference", "or 'initial' or 'none'")
    if isinstance(cfg.model.source, PretrainedModel):
        _check_folder(cfg.model.source.path, "model.source.path")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, tokenizer = _initial_model(ctx, task, work)
        _check_lora_targets(cfg, model)  # before SFT: the learner would fail on them after it
        prompt_format = PromptFormat.from_config(cfg)
        prompt_format.check(tokenizer)  # before any training: rollout would refuse it too
        ctx.log.info("policy has %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
        sft_info = None
        if cfg.model.sft.enabled:
            sft = cfg.model.sft
            if task.episodes is not None:  # played in an environment: whole episodes
                pairs = task.episodes(sft.demonstrations)
                val = [task.demonstrate(it) for it in task.validation]
                result = train_sft(model, tokenizer, pairs, val, sft, cfg.seed, prompt_format,
                                   encode=encode_episodes)
            else:
                pairs = task.demonstrations(sft.demonstrations)
                # the task's validation split: disjoint from the demonstrations and held-out
                val = [(it.prompt, it.answer) for it in task.validation]
                result = train_sft(model, tokenizer, pairs, val, sft, cfg.seed, prompt_format)
            sft_info = dataclasses.asdict(result) | {"demonstrations": len(pairs)}
            ctx.log.info("sft done: %s", sft_info)
        policy_dir = work / "policy"
        save_model(model, tokenizer, policy_dir)
        del model  # its weights may be pages of the source's file mapping: unmapped now
        ref_dir = _reference(ctx, policy_dir, tokenizer, work)
        _upload(store, keys.ref_prefix(), ref_dir)
        _upload(store, keys.policy_prefix(0), policy_dir)
    if evaluates_snapshot(cfg):
        evaluate_snapshot(ctx, task)
    point_latest(store, keys, 0)
    store.put_json(keys.run_json(), {
        "run_id": ctx.run_id, "version": __version__, "created": started,
        "config": cfg.model_dump(mode="json"), "config_hash": cfg.config_hash(),
        "sft": sft_info, "snapshot_seconds": time.time() - started,
    })
    if sft_info:
        ctx.metrics.log(0, {"sft_val_loss": sft_info["best_val_loss"],
                            "sft_epochs": sft_info["epochs"]})
    return 0


def _check_folder(path: str, field: str, alternatives: str = "") -> None:
    """ConfigError unless `path` is a folder of safetensors weights (a name that is not a
    folder would be looked up on the Hugging Face hub)."""
    try:
        check_safe_weights_dir(path)
    except (FileNotFoundError, UnsafeWeightsError) as exc:
        raise ConfigError("the run's config", [FieldError(
            field, f"{exc}{f' ({alternatives})' if alternatives else ''}")]) from exc


def _check_lora_targets(cfg, model) -> None:
    """ConfigError when `learner.lora.target_modules` would make peft refuse the policy: no
    module is a target (a module is one when its name is one of them or ends with '.' and
    one of them), or a target is not a layer peft adapts (a linear or convolution layer)."""
    if (lora := cfg.learner.lora) is None:
        return
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    targets = list(lora.target_modules)
    matched = [(name, module) for name, module in model.named_modules()
               if any(name == t or name.endswith("." + t) for t in targets)]
    adaptable = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, Conv1D)
    if not matched:
        known = sorted({last for name, _ in model.named_modules() if name
                        and not (last := name.rsplit(".", 1)[-1]).isdigit()})
        why = f"names no module of the model; its modules are named {', '.join(known[:16])}"
    elif odd := [(n, m) for n, m in matched if not isinstance(m, adaptable)]:
        name, module = odd[0]
        why = (f"names {name}, a {type(module).__name__}, which LoRA does not adapt: name "
               "linear layers (such as q_proj or down_proj)")
    else:
        return
    raise ConfigError("the run's config", [FieldError("learner.lora.target_modules",
                                                      f"{targets} {why}")])


def _initial_model(ctx: StageContext, task, work: Path):
    source = ctx.cfg.model.source
    if isinstance(source, PretrainedModel):
        return load_causal_lm(source.path), load_tokenizer(source.path)
    texts = task.corpus + [p + a for p, a in task.demonstrations(ctx.cfg.model.sft.demonstrations)]
    tokenizer = train_tokenizer(texts, work / "tokenizer")
    model = build_tiny_model(
        tokenizer, hidden_size=source.hidden_size, num_layers=source.num_layers,
        num_heads=source.num_heads, intermediate_size=source.intermediate_size,
        max_position_embeddings=source.max_position_embeddings, seed=ctx.cfg.seed,
    )
    return model, tokenizer


def _reference(ctx: StageContext, policy_dir: Path, tokenizer, work: Path) -> Path:
    """The folder to publish as ref/: the SFT policy itself, or a given model checked to match."""
    ref = ctx.cfg.model.reference
    if ref in ("initial", "none"):
        return policy_dir
    ref_tok = load_tokenizer(ref)
    check_tokenizers_match(tokenizer, ref_tok)
    out = work / "ref"
    save_model(load_causal_lm(ref), ref_tok, out)
    return out


def _upload(store: Store, prefix: str, folder: Path) -> dict[str, str]:
    """Put every file of `folder` under `prefix`, then its manifest, as
    `policy.upload_folder` does, but each file sent from the disk (`Store.put_file`) instead
    of read into memory whole; returns the manifest."""
    check_safe_weights_dir(folder)
    manifest = directory_manifest(folder)
    for rel in manifest:
        store.put_file(prefix + rel, folder / rel)
    store.put_json(prefix + MANIFEST, {"files": manifest, "time": time.time()})
    return manifest
