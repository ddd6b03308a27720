"""Benchmarks that print figures side by side; each section module runs alone too."""
