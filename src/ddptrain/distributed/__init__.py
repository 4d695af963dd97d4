"""Distributed setup: launcher environments, process groups, collectives, CPU threads."""
