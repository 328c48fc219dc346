"""http_api: see ../shared DESIGN map in README."""
