"""Library output in ShardRL's logs: no progress bars, no advisory warnings.

Stage logs and the model commands print one line per event; transformers, huggingface_hub
and tqdm would otherwise draw progress bars (loading weights, converting a GGUF file) and
repeat advisory warnings into them.
"""

from __future__ import annotations

import os
import sys

QUIET_LIBRARIES_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TQDM_DISABLE": "1",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
"""Environment that keeps transformers, huggingface_hub and tqdm from drawing progress bars
and printing advisory warnings, MLflow from logging its database set-up at INFO into a
run's output, and MLflow and huggingface_hub from reporting usage over the network (MLflow's
reporter also starts threads in the runner, which then forks its stages; a variable the user
set is left as it is)."""


def quiet_libraries() -> None:
    """No library progress bars or advisory warnings in a stage's log: one line per event.

    The environment covers libraries imported later; libraries already imported (a stage
    forked from the local runner) are told through their own switches.
    """
    for name, value in QUIET_LIBRARIES_ENV.items():
        os.environ.setdefault(name, value)
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if os.environ["TRANSFORMERS_VERBOSITY"] == "error":
            hf_logging.set_verbosity_error()
