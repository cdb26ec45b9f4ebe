"""Kubeflow pipelines of ShardRL: definitions, compilation and submission."""
