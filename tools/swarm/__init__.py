"""moonbus on a Docker swarm (docs/swarm.md).

    stack.py   derives the stack file `docker stack deploy` takes from compose.yaml (and any
               override files, as compose merges them): the one description of the cluster

tools/compose_e2e/swarm.py drives a one-node swarm for tests/integration/test_swarm.py.
"""
