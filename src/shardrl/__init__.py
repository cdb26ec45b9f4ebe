"""ShardRL: asynchronous RL fine-tuning of language models as a pipeline of stages."""

__version__ = "0.1.0"
