"""Code that runs inside vLLM's GPU worker processes (named by `worker_extension_cls`).

vLLM mixes this class into its worker, so `VLLMEngine` can reach the live model with
`llm.collective_rpc("shardrl_load_weights", args=(path,))`: every tensor-parallel rank reads
the same safetensors file and copies it into its shard of the weights, in place, without
restarting the engine. Imported only by vLLM, on the GPU image.
"""

from __future__ import annotations


class WeightReloadExtension:
    """In-place weight reload for vLLM workers (a mixin: `self` is the vLLM worker)."""

    def shardrl_load_weights(self, path: str) -> int:
        """Load the Hugging Face-named tensors of a safetensors file; returns how many."""
        from safetensors.torch import load_file

        state = load_file(path)  # CPU tensors; the model's weight loaders copy and shard them
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        loaded = model.load_weights(weights=iter(state.items()))
        return len(loaded) if loaded is not None else len(state)
