"""Orchestration: the stage graph and the local runner."""
