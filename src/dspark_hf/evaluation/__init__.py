"""Benchmarks, plots and the acceptance simulator."""
