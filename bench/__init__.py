"""Benchmarks (run through ``grammask bench ...``); numbers come from here, never from tests."""
