"""Training: optimizers (optim), lr schedules (schedules), datasets (data) and
the sources a train section names (sources), eval metrics (metrics), the
train section (section, spec, overrides), the loop (loop, progress, outputs),
checkpoints (checkpoint), inference (infer, arrayfiles) and text generation
(generate)."""
