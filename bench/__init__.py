"""Benchmarks: ddptrain measured side by side with its baselines (run from the repo root)."""
