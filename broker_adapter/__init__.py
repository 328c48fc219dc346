"""broker_adapter: see ../shared DESIGN map in README."""
