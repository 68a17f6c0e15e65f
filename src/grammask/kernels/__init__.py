"""Backend-neutral bitmask kernels: the bitmask layout, its buffers, and the apply onto logits."""
