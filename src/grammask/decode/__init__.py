"""The decode step: rows, the fill job on the fill thread, first masks, drafts, the reasoning gate,
and the masks applied to the host's logits (``processor.BatchProcessor`` is the face)."""
