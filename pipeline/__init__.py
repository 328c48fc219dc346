"""pipeline: see ../shared DESIGN map in README."""
