"""The GRPO algorithm as pure math: group advantages, KL, clipped per-token loss, aggregation
(grpo.py), and the loss of one micro-batch with its statistics (loss.py)."""
