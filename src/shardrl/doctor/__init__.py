"""The training doctor: symptom rules over a run's metric series, live and offline; the
report (plots, findings, ScaleRL's compute -> pass-rate fit) and the sample audit.

Importing this package does not import torch or matplotlib.
"""

from .findings import Evidence, Finding, Remedy, finding_tags, format_finding
from .live import LiveDoctor, saved_findings
from .rules import RULES, diagnose, too_short, unassessed
from .series import Metrics, Series, load_mlflow_metrics, load_store_metrics

__all__ = [
    "RULES", "Evidence", "Finding", "LiveDoctor", "Metrics", "Remedy", "Series", "diagnose",
    "finding_tags", "format_finding", "load_mlflow_metrics", "load_store_metrics",
    "saved_findings", "too_short", "unassessed",
]
