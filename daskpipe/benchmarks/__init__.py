"""Benchmarks that span the layers (planner, simulator, runtime) and so belong to none of them."""
