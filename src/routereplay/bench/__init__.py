"""Benchmarks behind `routereplay bench`: each suite returns a JSON-able record of medians."""
