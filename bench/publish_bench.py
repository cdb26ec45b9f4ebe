"""Published weights: bytes per version against the full size, reload time, exactness.

For the demo's model shape and a bigger tiny Llama, a learner makes real AdamW steps (next-
token loss on random token batches) and publishes every version as the learner does
(`publish_weights`: deltas against the previous version, a full snapshot every
`full_every`), in float32 and in bfloat16, into a folder store. A rollout-style follower
(`PolicyWeights` + `HFEngine.load_weights`) reloads each version; a late reader rebuilds the
last one from its full snapshot. Figures: median bytes of a delta version over the full
snapshot's, median reload time by delta and from the full snapshot, and whether every
rebuilt version equals the learner's published tensors bit for bit. Merged under
"publish" into bench/results.json.

    python -m bench.publish_bench [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.results import merge_results
from shardrl.engines.hf import HFEngine
from shardrl.models.delta import DTYPES, publish_state, states_equal
from shardrl.stages.policy import (
    DELTA,
    MANIFEST,
    WEIGHTS,
    PolicyWeights,
    publish_weights,
    upload_folder,
)
from shardrl.store import LocalStore, RunKeys

MODELS = {
    # the demo preset's shape (character vocabulary of about 40 tokens)
    "demo": dict(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=256),
    # a bigger tiny Llama: 8 layers, 512 wide, an 8k vocabulary (about 30M parameters)
    "tiny-30m": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8,
                     num_attention_heads=8, intermediate_size=1408),
}
LRS = {"demo": 1e-3, "pretrained": 1e-6}
"""The demo preset's learning rate, and one typical for RL on a pretrained model."""


def build(shape: dict) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**shape, num_key_value_heads=shape["num_attention_heads"],
                         max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def measure(shape: dict, dtype_name: str, lr: float, steps: int, full_every: int,
            work: Path) -> dict:
    dtype = DTYPES[dtype_name]
    model = build(shape)
    v0 = work / "v0"
    model.save_pretrained(str(v0))
    store, keys = LocalStore(str(work / "store")), RunKeys("bench")
    upload_folder(store, keys.policy_prefix(0), v0)
    follower = build(shape).eval()
    engine = HFEngine(follower, eos_token_id=0, pad_token_id=0, version=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
    reader, gen = PolicyWeights(), torch.Generator().manual_seed(1)
    published = publish_state(model, dtype)
    rows, exact = [], True
    for v in range(1, steps + 1):
        tokens = torch.randint(0, shape["vocab_size"], (8, 32), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        started = time.perf_counter()
        state = publish_state(model, dtype)
        written = publish_weights(store, keys, v, state, published, full_every)
        publish_s = time.perf_counter() - started
        published = state
        files = store.get_json(keys.policy_file(v, MANIFEST))["files"]
        delta_bytes = len(store.get_bytes(keys.policy_file(v, DELTA)))
        started = time.perf_counter()
        engine.load_weights(reader.get(store, keys, v), v)
        reload_s = time.perf_counter() - started
        exact &= states_equal(reader.state, state)
        rows.append({"version": v, "written": written, "delta": delta_bytes,
                     "full": WEIGHTS in files, "publish_s": publish_s, "reload_s": reload_s})
    last_full = steps - steps % full_every
    full_bytes = len(store.get_bytes(keys.policy_file(last_full, WEIGHTS)))
    late = PolicyWeights()
    started = time.perf_counter()
    engine.load_weights(late.get(store, keys, last_full), last_full)
    full_reload_s = time.perf_counter() - started
    exact &= states_equal(late.state, fetch_state(store, keys, last_full))
    deltas = [r["delta"] for r in rows]
    return {"params": sum(p.numel() for p in model.parameters()), "dtype": dtype_name,
            "lr": lr, "steps": steps, "full_every": full_every, "full_bytes": full_bytes,
            "delta_bytes_median": statistics.median(deltas),
            "delta_fraction_median": statistics.median(deltas) / full_bytes,
            "written_per_version": sum(r["written"] for r in rows) / steps / full_bytes,
            "reload_delta_s": statistics.median(r["reload_s"] for r in rows if not r["full"]),
            "reload_full_s": full_reload_s,
            "publish_s": statistics.median(r["publish_s"] for r in rows),
            "bit_exact": exact}


def fetch_state(store, keys, version):
    from shardrl.stages.policy import fetch_weights

    return fetch_weights(store, keys, version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--full-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {}
    for model, shape in MODELS.items():
        for dtype in ("float32", "bfloat16"):
            for lr_name, lr in LRS.items():
                with tempfile.TemporaryDirectory() as tmp:
                    r = measure(shape, dtype, lr, args.steps, args.full_every, Path(tmp))
                name = f"{model}/{dtype}/lr-{lr_name}"
                cases[name] = r
                print(f"{name}: {r['params'] / 1e6:.2f}M params, full {r['full_bytes'] / 1e6:.2f}"
                      f" MB, delta {r['delta_fraction_median']:.3f} of full, written per "
                      f"version {r['written_per_version']:.3f}, reload {r['reload_delta_s']:.4f}"
                      f" s by delta / {r['reload_full_s']:.4f} s full, exact {r['bit_exact']}",
                      flush=True)
    merge_results("publish", {"cases": cases})


if __name__ == "__main__":
    main()
