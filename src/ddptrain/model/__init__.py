"""The model: built by name (its provider), placed (device, dtype, layout)."""
