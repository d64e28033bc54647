"""Benchmarks behind `kvpool bench` and the `kvpool demo` main job."""
