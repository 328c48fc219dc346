"""benchmarks: see ../shared DESIGN map in README."""
