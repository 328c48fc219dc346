"""jepsen_like: see ../shared DESIGN map in README."""
