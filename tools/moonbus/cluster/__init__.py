"""Running a cluster: what `moonbus up`, the tests and operators use to start, secure and measure one.

    processes.py        the local cluster as real processes (embedded nats-server, every service)
    supervisor.py       the restart policy (backoff, crash loops) `moonbus up` applies
    up.py               `moonbus up`
    security.py         the cluster's secrets and the NATS users, roles and permissions
    keys.py             `moonbus keys`: API keys, stored hashed
    compose_secrets.py  `moonbus compose-secrets`: what compose.yaml hands its containers
    profile.py          `moonbus profile`: the deployed model's measured speed, which the predictors fit
"""
