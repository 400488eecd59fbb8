"""End-to-end tests with unequal layouts: P at TP 2, D at PP 2 x TP 1 (a pipeline stage per core; each D stage reads
its own layers from both P ranks, see conftest.py)."""
