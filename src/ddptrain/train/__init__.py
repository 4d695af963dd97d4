"""Training: the trainer and its step, optimizer and schedule, stop requests."""
