"""`shardrl model import-gguf` on a tiny Llama GGUF file written here with the gguf package."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from shardrl.cli import main  # noqa: E402
from shardrl.models.gguf_import import GGUFImportError, import_gguf  # noqa: E402
from shardrl.models.io import load_causal_lm, load_tokenizer  # noqa: E402
from shardrl.tasks.prompts import PromptFormat  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, CONTEXT = 16, 2, 1, 1, 32, 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
# byte-level BPE symbols: letters, digits, "=", "+", newline (Ċ) and space (Ġ), one merge
SYMBOLS = list("abcdefghijklmnopqrstuvwxyz0123456789=+") + ["Ċ", "Ġ", "ab"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def write_tiny_gguf(path: Path, seed: int = 0, rope_scaling: float | None = None,
                    rope_freqs: bool = False) -> dict[str, np.ndarray]:
    """A one-layer Llama with tied embeddings and a BPE tokenizer with a chat template;
    returns the tensors as written (float32). `rope_scaling`: a linear scaling factor;
    `rope_freqs`: per-frequency factors, as Llama 3.1 files carry."""
    rng = np.random.default_rng(seed)
    vocab = SPECIALS + SYMBOLS
    head_dim = HIDDEN // HEADS
    shapes = {
        "token_embd.weight": (len(vocab), HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    tensors = {name: rng.normal(0.0, 0.2, shape).astype(np.float32)
               for name, shape in shapes.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling)
    if rope_freqs:
        tensors["rope_freqs.weight"] = np.full(head_dim // 2, 2.0, dtype=np.float32)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                      + [gguf.TokenType.NORMAL] * len(SYMBOLS))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_import_writes_a_plain_safetensors_folder(tiny_gguf, tmp_path):
    path, written = tiny_gguf
    lines: list[str] = []
    out = import_gguf(path, tmp_path / "model", log=lines.append)
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    assert not list(tmp_path.glob(".model*"))  # the temporary folder was renamed
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        HIDDEN, LAYERS, len(SPECIALS) + len(SYMBOLS))
    assert config["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied: stored once, as the input embedding
        assert len(keys) == len(written)
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"),
                           torch.from_numpy(written["token_embd.weight"]))
        assert torch.equal(f.get_tensor("model.layers.0.mlp.down_proj.weight"),
                           torch.from_numpy(written["blk.0.ffn_down.weight"]))
    assert lines[0].startswith(f"reading {path}")
    assert lines[-1].startswith(f"done: {out}")
    assert all("\r" not in line and "\n" not in line for line in lines)  # plain lines

    model, tok = load_causal_lm(out), load_tokenizer(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)
    ids = PromptFormat("chat").encode(tok, ["ab+1="])[0]
    # <|im_start|> user \n ab + 1 = <|im_end|> \n <|im_start|> assistant \n ("ab" is merged)
    sym = {s: 3 + i for i, s in enumerate(SYMBOLS)}
    nl = sym["Ċ"]
    want = ([1] + [sym[c] for c in "user"] + [nl, sym["ab"], sym["+"], sym["1"], sym["="], 2, nl, 1]
            + [sym[c] for c in "assistant"] + [nl])
    assert ids == want
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(SPECIALS) + len(SYMBOLS))
    assert torch.isfinite(logits).all()


def test_cli_errors_leave_nothing_behind(tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    out = tmp_path / "model"
    assert main(["model", "import-gguf", str(tmp_path / "missing.gguf"), "--out", str(out)]) == 1
    assert "missing.gguf: no such file" in capsys.readouterr().err
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    assert main(["model", "import-gguf", str(text), "--out", str(out)]) == 1
    assert "is not a GGUF file" in capsys.readouterr().err
    # a GGUF header whose tensor data is cut off: transformers fails after reading started
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:-600])
    with pytest.raises(GGUFImportError):
        import_gguf(broken, out, log=lambda _: None)
    # a header cut short: the reader's struct.error used to escape as a traceback
    stub = tmp_path / "stub.gguf"
    stub.write_bytes(path.read_bytes()[:16])
    assert main(["model", "import-gguf", str(stub), "--out", str(out)]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf", "notes.txt", "stub.gguf"]


def test_existing_output_needs_force(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(path, out, log=lambda _: None)
    assert (out / "keep.txt").exists()
    import_gguf(path, out, force=True, log=lambda _: None)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


@pytest.mark.parametrize(("kind", "said"), [("scaling", "scales its rotary positions"),
                                            ("freqs", "per-frequency rotary factors")])
def test_rotary_settings_the_reader_drops_are_refused_not_imported_wrong(tmp_path, kind, said):
    """transformers' GGUF reader ignores RoPE scaling and rope_freqs.weight: the folder would
    compute other logits than the file, and the import's own check (the folder against
    transformers' reading) could not tell."""
    path = tmp_path / "scaled.gguf"
    write_tiny_gguf(path, rope_scaling=4.0 if kind == "scaling" else None,
                    rope_freqs=kind == "freqs")
    with pytest.raises(GGUFImportError, match=said):
        import_gguf(path, tmp_path / "model", log=lambda _: None)
    assert not (tmp_path / "model").exists()


def test_force_never_deletes_the_source_or_the_folder_it_runs_in(tiny_gguf, tmp_path,
                                                                  monkeypatch):
    path, _ = tiny_gguf
    work = tmp_path / "work"
    work.mkdir()
    source = work / "model.gguf"
    source.write_bytes(path.read_bytes())
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    for out, said in (((".", "is the current folder")), (str(tmp_path), "one above it"),
                      (str(work), "is the current folder"),
                      (str(source), "holds the GGUF file")):
        with pytest.raises(GGUFImportError, match=said):
            import_gguf(source, out, force=True, log=lambda _: None)
    inside = work / "models" / "x"
    inside.mkdir(parents=True)
    moved = inside / "m.gguf"
    moved.write_bytes(path.read_bytes())
    with pytest.raises(GGUFImportError, match="holds the GGUF file"):
        import_gguf(moved, work / "models", force=True, log=lambda _: None)
    assert source.exists() and moved.exists() and (work / "notes.txt").read_text() == "keep"
    (work / "afile").write_text("x")
    with pytest.raises(GGUFImportError, match="is a file, not a folder"):
        import_gguf(source, work / "afile", force=True, log=lambda _: None)


def test_force_never_deletes_a_folder_holding_a_link_to_the_source(tiny_gguf, tmp_path):
    """A model cache keeps `snapshots/<rev>/x.gguf` as a link into `blobs/`: replacing the
    snapshot folder would delete the name the user gave."""
    path, _ = tiny_gguf
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_bytes(path.read_bytes())
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "x.gguf").symlink_to(blob)
    with pytest.raises(GGUFImportError, match="holds the GGUF file"):
        import_gguf(snapshot / "x.gguf", snapshot, force=True, log=lambda _: None)
    assert (snapshot / "x.gguf").exists()
