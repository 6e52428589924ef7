"""Benchmarks of ephost (run them as scripts: python bench/dispatch.py)."""
