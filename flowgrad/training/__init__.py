"""What training is made of: optimizers (optim), lr schedules (schedules),
datasets (data) and the sources a train section names (sources), eval
metrics (metrics), the train section (section, spec), the loop's progress
and output files (progress, outputs), checkpoints (checkpoint), inference
(infer, arrayfiles), text generation (generate) and data-parallel steps
(distributed, mpi_launch, grad_buckets). The loop itself, `fg.train`, is
flowgrad/trainer.py: it loads and compiles models through the API, which
sits above this package."""
