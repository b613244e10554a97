"""Experiments of docs/experiments: `python -m tools.experiments N [--out DIR] [--limit N]`."""
