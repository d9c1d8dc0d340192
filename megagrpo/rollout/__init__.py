"""Rollout: the generation engines (vLLM, transformers), the batch a step carries, and the
weight sync that streams trained weights into the engine."""
