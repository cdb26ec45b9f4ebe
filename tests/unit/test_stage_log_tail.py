"""The runner quotes a failed stage's last error line from its log."""

from __future__ import annotations

from shardrl.orchestrate.local import last_error


def test_the_last_error_line_of_a_stage_log(tmp_path):
    log = tmp_path / "snapshot.log"
    log.write_text(
        "10:00:01 snapshot INFO loading\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 3, in f\n'
        "    raise FileNotFoundError(msg)\n"
        "FileNotFoundError: model directory models/m does not exist\n")
    assert last_error(log) == ": FileNotFoundError: model directory models/m does not exist"
    log.write_text("10:00:01 rollout ERROR only prompts longer than the context\n"
                   "10:00:02 rollout INFO closing\n")
    assert last_error(log) == ": 10:00:01 rollout ERROR only prompts longer than the context"
    log.write_text("10:00:01 learn INFO all good\n")
    assert last_error(log) == ""
    log.write_text("10:00:01 learn ERROR an earlier error\nTraceback (most recent call last):\n"
                   '  File "y.py", line 1, in g\n'
                   "shardrl.store.base.StoreUnavailable: " + "x" * 400 + "\n")
    quoted = last_error(log)
    assert quoted.startswith(": shardrl.store.base.StoreUnavailable: x") and len(quoted) == 302
    assert last_error(tmp_path / "missing.log") == ""
