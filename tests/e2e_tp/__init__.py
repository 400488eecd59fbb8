"""End-to-end tests with unequal tensor parallelism: P at TP 2, D at TP 1."""
