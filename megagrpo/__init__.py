"""megagrpo: large-scale GRPO training on DeepSpeed with a co-located vLLM engine."""
__version__ = "0.1.0"
