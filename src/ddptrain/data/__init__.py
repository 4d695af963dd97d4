"""Data: image folders, transforms, the global-batch sampler, loaders, the built-in dataset."""
