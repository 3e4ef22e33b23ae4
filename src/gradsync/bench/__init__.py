"""Benchmarks users run on their own machines: all-reduce bandwidth, training configurations, a simulated cluster."""
