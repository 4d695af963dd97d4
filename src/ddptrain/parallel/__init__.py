"""Parallelism: the model wrapped by strategy (DDP, FSDP2), fsdp's shard units, DDP's hooks."""
