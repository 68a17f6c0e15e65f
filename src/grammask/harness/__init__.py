"""Mask-correctness harness: engine-independent oracles, walks and audits, corpus report."""
