"""Benchmarks (CLIs that print a table and write JSON): ``python -m flashhead_ext.bench head``."""
