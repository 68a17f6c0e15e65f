"""The value types: what a constraint is (``GrammarSpec``), its limits, the shipped grammar library,
and the front ends that read requests into it."""
