"""Training: optimizers (optim), lr schedules (schedules), data sources (data),
the loop (loop), checkpoints (checkpoint) and inference (infer)."""
