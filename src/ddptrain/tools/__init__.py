"""Commands beside training that work on what a run would do or has written: `ddptrain plan`
(per-rank memory of a run, ddp against fsdp, before it starts) and `ddptrain export`."""
