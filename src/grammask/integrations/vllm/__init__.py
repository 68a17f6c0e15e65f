"""grammask as vLLM's logits processor (``plugin`` is the entry point vLLM loads)."""
