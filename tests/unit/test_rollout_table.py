"""A rollout shard's table built a column at a time, and responses decoded in one pass."""

import pytest

from shardrl.engines.base import Sample
from shardrl.models.tiny import train_tokenizer
from shardrl.stages.engine import decode_all
from shardrl.stages.rollout import rollout_table
from shardrl.store.schemas import ROLLOUT
from shardrl.tasks.builtin import TaskItem


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(["abc .,!?"], tmp_path_factory.mktemp("tok"))


def test_rows_follow_groups_and_samples_in_order():
    items = [TaskItem("p0", "ab=", "bc", "len_2"), TaskItem("p1", "abc=", "bcd", "len_3")]
    prompt_ids = [[1, 5, 6], [1, 5, 6, 7]]
    groups = [
        [Sample([4, 2], [-0.5, -0.25], "stop"), Sample([5], [-1.0], "length")],
        [Sample([], [], "length"), Sample([6, 7, 2], [-0.1, -0.2, -0.3], "stop"),
         Sample([8], [-2.0], "length")],
    ]
    table = rollout_table(items, prompt_ids, groups, version=3, worker=1, seq=42,
                          texts=["t0", "t1", "t2", "t3", "t4"], created_at=12.5)
    assert table.schema.equals(ROLLOUT)
    rows = table.to_pylist()
    # (group, sample): item of the group, then the sample's own values
    expected = [(0, 0, [4, 2], [-0.5, -0.25], "stop"), (0, 1, [5], [-1.0], "length"),
                (1, 0, [], [], "length"), (1, 1, [6, 7, 2], [-0.1, -0.2, -0.3], "stop"),
                (1, 2, [8], [-2.0], "length")]
    assert len(rows) == len(expected)
    for n, (row, (g, j, ids, logprobs, finish)) in enumerate(zip(rows, expected, strict=True)):
        item = items[g]
        assert row == {
            "prompt_id": item.prompt_id, "group_id": f"w01-000042-{g:03d}", "sample_idx": j,
            "policy_version": 3, "worker": 1, "prompt_text": item.prompt,
            "prompt_token_ids": prompt_ids[g], "response_token_ids": ids,
            "behavior_logprobs": pytest.approx(logprobs), "finish_reason": finish,
            "response_text": f"t{n}", "answer": item.answer, "category": item.category,
            "created_at": 12.5,
        }


def test_no_items_is_an_empty_shard():
    table = rollout_table([], [], [], version=0, worker=0, seq=0, texts=[], created_at=0.0)
    assert table.num_rows == 0 and table.schema.equals(ROLLOUT)


def test_decode_all_is_decode_of_each(tokenizer, monkeypatch):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sequences = [tokenizer("ab .c")["input_ids"] + [eos], [pad, *tokenizer("c !")["input_ids"]],
                 []]
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]
    assert expected[0] == "ab .c"  # special tokens skipped, spaces kept
    calls = []
    monkeypatch.setattr(type(tokenizer), "decode",
                        lambda self, *a, **k: calls.append(a) or "")
    assert decode_all(tokenizer, sequences) == expected
    assert calls == []  # straight through the Rust backend


def test_decode_all_keeps_a_tokenizers_space_clean_up(tokenizer, monkeypatch):
    # the library's clean-up joins " ." to ".": the backend alone would not, so each
    # sequence goes through `decode` as before
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    ids = tokenizer("ab .c")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab.c"
    assert decode_all(tokenizer, [ids, ids]) == ["ab.c", "ab.c"]


def test_mismatched_inputs_are_refused():
    items = [TaskItem("p0", "ab=", "bc", "len_2")]
    group = [Sample([4], [-0.5], "stop")]

    def table(**changed):
        args = dict(items=items, prompt_ids=[[1]], groups=[group], texts=["x"]) | changed
        return rollout_table(args["items"], args["prompt_ids"], args["groups"], version=0,
                             worker=0, seq=0, texts=args["texts"], created_at=0.0)

    assert table().num_rows == 1
    with pytest.raises(ValueError, match="1 items, 2 prompts and 1 groups"):
        table(prompt_ids=[[1], [2]])
    with pytest.raises(ValueError, match="0 response texts for 1 samples"):
        table(texts=[])
    with pytest.raises(ValueError, match="logprobs differ in number from its tokens"):
        table(groups=[[Sample([4, 5], [-0.5], "stop")]])
