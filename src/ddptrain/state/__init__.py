"""Run state on disk: checkpoints, atomic files, numbering and retention."""
