"""Run compose.yaml end to end on this machine: engine, images, cluster, host left as found.

    engine.py      use the Docker engine that runs, or start dockerd (own data-root) and stop it
                   by its pid; host.py snapshots what dockerd changes and puts it back
    images.py      the base image (a public Python image, or debootstrap + `docker import` where
                   no registry answers, cached by Docker) and the project image (docker/Dockerfile,
                   torch from the local wheel when there is one)
    compose.py     `docker compose` v2 or `docker-compose` v1 (whose missing `up --wait` it emulates)
    swarm.py       a one-node swarm (made and left here, or the engine's own) and a stack on it
                   (tests/integration/test_swarm.py, the stack derived by tools/swarm/stack.py)

tests/integration/test_compose_e2e.py drives them (`make compose-test`). Every piece of state
lives outside the work tree: Docker's data-root (/var/lib/moonbus-docker: images, the base image
and the build cache, kept between runs), /var/cache/moonbus-docker (dockerd.log, the debootstrap
root while a base image is built) and, only while a daemon of ours runs, /run/moonbus-docker (its
pid and the host snapshot, so that a run that dies is cleaned up by the next).
"""
