"""Benchmarks of mas-async and their workloads: each script prints ratios against a raw baseline measured
in the same run (`python -m bench.X` or `python bench/X.py`; see bench/README.md)."""
