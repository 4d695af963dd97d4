"""The model: built by name, placed (device, dtype, layout), wrapped by strategy."""
