"""Traces against the system: replayed live, simulated, or through the cache alone.

    replay.py     `moonbus replay`: a trace against a live cluster, with per-request results
    sim.py        `moonbus sim`: a discrete-event cluster running the same decision code (tools/sim)
    cachesim.py   `moonbus cachesim`: a trace through the pool's eviction and index code only
    plots.py      the CDF and load plots the first two draw
"""
