"""Benchmark tests: parts of `bench` that need more than a unit test (external stacks)."""
