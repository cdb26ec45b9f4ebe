"""The control plane's typed records: their keys, their JSON form, and their strictness."""

import json

import pytest
from pydantic import ValidationError

from shardrl.store import LocalStore, NotFound, StoreError
from shardrl.store.keys import RunKeys, folder_number, parse_eval_summary_key
from shardrl.store.records import (
    Buffered,
    Cursor,
    Done,
    LedgerDelta,
    LedgerEntry,
    PolicyPointer,
    Progress,
    WorkerState,
)

rk = RunKeys("r1")


def test_record_keys():
    assert rk.progress() == "runs/r1/state/learn/progress.json"
    assert rk.buffered() == "runs/r1/state/learn/buffered.json"
    assert rk.ledger(7) == "runs/r1/state/learn/ledger-000007.json"
    assert rk.ledger(7).startswith(rk.ledger_prefix())
    assert rk.cursor("prepare") == "runs/r1/state/prepare/cursor.json"
    assert rk.worker_state(3) == "runs/r1/state/rollout/w03.json"
    assert rk.retired_change(12) == "runs/r1/state/prepare/retired/000000012.json"
    assert rk.retired_change(12).startswith(rk.retired_prefix())
    assert rk.passrate_snapshot(3) == "runs/r1/state/prepare/passrate-000003.json"
    assert rk.eval_latest() == "runs/r1/state/evaluate/latest.json"
    with pytest.raises(ValueError):
        rk.worker_state(100)


def test_progress_round_trips_with_integer_keys_as_json_strings(tmp_path):
    store = LocalStore(tmp_path)
    progress = Progress(version=4, commits=5, counts={"consumed": 96, "filtered": 32},
                        groups_by_worker={0: 12, 1: 10}, staleness={0: 64, 1: 32},
                        ledger={3: ["w00-000007.parquet"]}, kl={"beta": 0.1}, beta=0.1, time=1.5)
    progress.write(store, rk.progress())
    on_disk = json.loads((tmp_path / rk.progress()).read_text())
    assert on_disk["groups_by_worker"] == {"0": 12, "1": 10}
    assert on_disk["ledger"] == {"3": ["w00-000007.parquet"]}
    back = Progress.read(store, rk.progress())
    assert back == progress and back.groups_by_worker[1] == 10 and back.staleness[0] == 64


def test_a_missing_record_reads_empty_or_none(tmp_path):
    store = LocalStore(tmp_path)
    assert Progress.read(store, rk.progress()) == Progress()
    assert Progress.read(store, rk.progress()).version == 0
    assert Cursor.read(store, rk.cursor("learn")).low == 0
    assert WorkerState.read(store, rk.worker_state(0)).next_seq == 0
    assert Done.read(store, rk.done(), optional=True) is None
    assert PolicyPointer.read(store, rk.latest_policy(), optional=True) is None


def test_a_record_deleted_between_the_check_and_the_read_reads_as_missing(tmp_path):
    """Another stage may delete a record right after `exists` saw it (prepare replaces the
    retired-prompt changes by a full set): the read then finds none, not an error."""

    class Racing(LocalStore):
        def exists(self, key):
            found = super().exists(key)
            self.delete(key)  # gone by the time it is read
            return found

    store = Racing(tmp_path)
    WorkerState(next_seq=3).write(store, rk.worker_state(0))
    assert WorkerState.read(store, rk.worker_state(0), optional=True) is None
    WorkerState(next_seq=3).write(store, rk.worker_state(0))
    assert WorkerState.read(store, rk.worker_state(0)) == WorkerState()


def test_misspelt_or_wrongly_typed_fields_fail_where_they_are_written_and_read(tmp_path):
    with pytest.raises(ValidationError):
        Buffered(groups_by_worker={0: 1}, kept_by_worker={0: 1})
    with pytest.raises(ValidationError):
        LedgerEntry(key="k", outcome="eaten", rows=3)
    store = LocalStore(tmp_path)
    store.put_json(rk.cursor("learn"), {"low": "soon"})
    # read back: an error that names the record, its key and the store, not pydantic's alone
    with pytest.raises(StoreError, match=r"'runs/r1/state/learn/cursor.json' in file://.* is "
                                         r"not a valid Cursor record") as info:
        Cursor.read(store, rk.cursor("learn"))
    assert isinstance(info.value.__cause__, ValidationError) and "low" in str(info.value)


def test_a_missing_record_without_an_empty_form_is_not_found_naming_its_key(tmp_path):
    from shardrl.store.records import PassRateSnapshot

    store = LocalStore(tmp_path)
    with pytest.raises(NotFound, match=r"no PassRateSnapshot record 'runs/r1/x.json' in file://"):
        PassRateSnapshot.read(store, "runs/r1/x.json")
    assert PassRateSnapshot.read(store, "runs/r1/x.json", optional=True) is None


def test_ledger_delta_holds_its_entries(tmp_path):
    store = LocalStore(tmp_path)
    key = "runs/r1/ready/v000002/w01-000009.parquet"
    LedgerDelta(version=3, stepped=True,
                shards=[LedgerEntry(key=key, outcome="stale", rows=8)]).write(store, rk.ledger(1))
    back = LedgerDelta.read(store, rk.ledger(1))
    assert (back.version, back.stepped, back.shards[0].outcome, back.shards[0].rows) == \
        (3, True, "stale", 8)


def test_folder_and_summary_keys_parse_to_their_numbers():
    assert folder_number(rk.policy_file(12, "model.safetensors"), "policy") == 12
    assert folder_number(rk.latest_policy(), "policy") is None
    assert folder_number(rk.learner_file(40, "backend.safetensors"), "learner") == 40
    assert folder_number(rk.latest_learner(), "learner") is None
    assert folder_number(rk.policy_file(12, "x"), "learner") is None
    assert parse_eval_summary_key(rk.eval_summary(25)) == 25
    with pytest.raises(ValueError):
        parse_eval_summary_key(rk.eval_table(25))


def test_quarantined_keys_name_their_stage_and_original():
    original = rk.shard("scored", 2, 1, 9)
    assert rk.unquarantined(rk.quarantine("prepare", original)) == ("prepare", original)
    with pytest.raises(ValueError):
        rk.unquarantined(original)


def test_a_run_json_without_its_config_is_one_line_for_every_command(tmp_path, capsys):
    """A hand-edited run.json (not JSON, or JSON without `config`): the commands that read a
    run say so in one line naming the file, instead of a KeyError's traceback."""
    from shardrl.cli import main as cli_main
    from shardrl.store.records import recorded_config

    store = LocalStore(tmp_path)
    store.put_json(rk.run_json(), {"config": {"name": "x"}})
    assert recorded_config(store, rk.run_json()) == {"name": "x"}
    for broken in ({}, [1], {"config": "demo"}):
        store.put_json(rk.run_json(), broken)
        with pytest.raises(StoreError, match=r"'runs/r1/run.json' in file://.* holds no run "
                                             r"config"):
            recorded_config(store, rk.run_json())
    store.put_bytes(rk.run_json(), b"{not json")
    for command in (["replay", "r1"], ["doctor", "r1"], ["run", "--resume", "r1"]):
        for content in (b"{not json", b"{}"):
            store.put_bytes(rk.run_json(), content)
            try:
                code = cli_main([*command, "--store", str(tmp_path)])
            except SystemExit as exc:  # doctor and run end with a message as the exit value
                code, message = 1, str(exc.code)
            else:
                message = capsys.readouterr().err
            assert code != 0, (command, content)
            assert "runs/r1/run.json" in message and "Traceback" not in message, message


def test_commands_reading_a_run_name_the_store_they_looked_in(tmp_path, capsys):
    from shardrl.cli import main as cli_main

    store = str(tmp_path / "store")
    for command in ("report", "samples"):
        assert cli_main([command, "nosuch", "--store", store]) == 2
        assert capsys.readouterr().err == (f"shardrl {command}: no run 'nosuch' in the store "
                                           f"'{store}' (--store names another)\n")
