"""Policy engines, one per parallel layout (DeepSpeed ZeRO 0-3 with AutoTP; DeepSpeed pipeline),
and what they run: model building, the log-prob pass, packing."""
