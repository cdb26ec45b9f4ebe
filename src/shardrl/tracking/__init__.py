"""MLflow: one run per pipeline run, namespaced metrics, the model registry."""
