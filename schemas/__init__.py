"""Wire types and subject names. One module per hop, in path order:

gateway -> conductor (`route`), conductor -> prefill (`prefill`), prefill -> messenger -> decode
(`transfer`, `decode`), workers -> gateway (`tokens`), plus `workers` (announce/heartbeat),
`index` (cache index queries and KV events) and `events` (the audit log).
"""
