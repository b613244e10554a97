#!/bin/sh
# Runs inside the RDMA test VM, started by the image's PID 1 (/sbin/moonbus-init) from the run
# share (/run/moonbus). Sets up the shares, the network and a soft-RoCE device, runs command.sh
# with the project's tree as the working directory, and leaves its exit status in
# /run/moonbus/rc (qemu's own exit status says nothing about the guest).
RUN=/run/moonbus
exec >"$RUN/guest.log" 2>&1
echo "guest: script started at uptime $(cut -d' ' -f1 /proc/uptime) s"
set -x

mkdir -p /work /opt/moonbus-deps
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,ro repo /work
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,ro deps /opt/moonbus-deps

# User networking: the host's 127.0.0.1 is 10.0.2.2 here (a nats-server on the host is reachable).
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2

# Soft-RoCE on a dummy NIC (named so: loading the dummy module already creates dummy0). Both ends
# of every test are on this one device; rxe loops packets between them back inside the kernel.
# 198.18.0.0/15 is the range reserved for benchmarking (RFC 2544): no real network is there.
modprobe -a dummy rdma_rxe ib_uverbs
ip link add rxenet type dummy
ip link set rxenet mtu 9000 up
ip addr add 198.18.0.1/24 dev rxenet
rdma link add rxe0 type rxe netdev rxenet
rdma link show
set +x

. "$RUN/env.sh"
export PYTHONPATH=/work:/opt/moonbus-deps PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
export MOONBUS_RDMA_GUEST=1 MOONBUS_RDMA_DEVICE=rxe0
echo "guest: command started at uptime $(cut -d' ' -f1 /proc/uptime) s"
cd /work
sh "$RUN/command.sh" >"$RUN/output.log" 2>&1
rc=$?
echo "guest: command exited $rc at uptime $(cut -d' ' -f1 /proc/uptime) s"
echo "$rc" >"$RUN/rc"
sync
