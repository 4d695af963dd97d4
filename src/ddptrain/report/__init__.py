"""Reporting: exact metric sums and the records a run writes."""
