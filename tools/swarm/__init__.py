"""moonbus on a Docker swarm (docs/swarm.md).

    stack.py       derives the stack file `docker stack deploy` takes from compose.yaml (and any
                   override files, as compose merges them): the one description of the cluster
    autoscale.py   `moonbus swarm autoscale`: follows the planner's decisions with `docker service scale`
    cli.py         `moonbus swarm ...`: its subcommands

tools/compose_e2e/swarm.py drives a one-node swarm for tests/integration/test_swarm.py.
"""
