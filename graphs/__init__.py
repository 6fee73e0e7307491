"""Shipped graph specs (YAML) and the tiny demo model; see docs/GRAPHS.md."""
