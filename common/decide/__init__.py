"""The decision floor: every pure decision the cluster makes, shared by the live services and the simulator.

    policy.py         where a request goes: every (prefill, decode) candidate priced, p* chosen
    admission.py      admit or reject at arrival (none, baseline, early, predictive); decode's late check
    cluster_state.py  the load of every instance as the conductors see it, from the instances' reports
    index.py          the global prefix index: block key -> holders, longest-prefix matches
    pool.py           a node's two tiers (DRAM, SSD): what is stored, demoted, promoted, evicted
    eviction.py       the eviction policies the pool uses (LRU, LFU, length-aware)
    perf.py           the predictors: prefill and decode step time, from a measured profile or analytically
    learn.py          predictions that learn, per instance, from what actually happened
    outputs.py        how many tokens a request will still generate
    tenancy.py        tenants' limits and fair shares over every gateway replica
    retry.py          a failed attempt's next: a migration or a re-dispatch, and whom it avoids

Everything here is synchronous and pure: a snapshot (with the clock as a value) in, a decision out.
No I/O, no clocks, no globals; nothing here imports services/ or tools/ (a test checks it).
"""
