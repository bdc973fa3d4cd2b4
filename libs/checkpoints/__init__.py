"""On-disk checkpoints: the layout, the atomic directory transaction, and the training-state format."""
