"""Benchmarks behind `splitserve bench`."""
