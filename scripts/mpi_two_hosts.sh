#!/usr/bin/env bash
# Data-parallel training on two hosts simulated on this machine: two network
# namespaces, each with its own hostname, joined by a veth pair; MPICH's Hydra
# starts the second host's proxy through `ip netns exec` where it would use
# ssh. Trains mlp on 2 x PER_HOST ranks (batch 16 each), then one process on
# the global batch, and prints the largest param difference. Needs root, the
# mpich wheel's mpiexec in .venv, and `ip` and `unshare`.
#   scripts/mpi_two_hosts.sh [PER_HOST]          (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
per_host=${1:-2}
ranks=$((2 * per_host))
py=${PYTHON:-$PWD/.venv/bin/python}
mpiexec=$(dirname "$py")/mpiexec

namespaces_gone() {
    ip netns del fg-host1 2>/dev/null || true
    ip netns del fg-host2 2>/dev/null || true
}
namespaces_gone        # left by an interrupted run
work=$(mktemp -d /tmp/flowgrad-two-hosts.XXXXXX)
trap 'namespaces_gone; rm -rf "$work"' EXIT
ip netns add fg-host1
ip netns add fg-host2
ip link add fg-veth1 type veth peer name fg-veth2
ip link set fg-veth1 netns fg-host1
ip link set fg-veth2 netns fg-host2
ip -n fg-host1 addr add 10.77.0.1/24 dev fg-veth1
ip -n fg-host2 addr add 10.77.0.2/24 dev fg-veth2
for n in 1 2; do
    ip -n fg-host$n link set fg-veth$n up
    ip -n fg-host$n link set lo up
done

# Hydra calls this as `ssh [-x] HOST COMMAND`: run COMMAND in that host's namespaces
cat >"$work/netns-ssh" <<'EOF'
#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
case $1 in 10.77.0.1) n=1;; 10.77.0.2) n=2;; *) echo "netns-ssh: unknown host $1" >&2; exit 255;; esac
shift
exec ip netns exec fg-host$n unshare --uts sh -c "hostname host$n; exec $*"
EOF
chmod +x "$work/netns-ssh"

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
train="-m flowgrad.cli train mlp --device cpu --steps 20"
echo "== $ranks ranks on host1 and host2 ($per_host each)"
ip netns exec fg-host1 unshare --uts sh -c "hostname host1; exec $mpiexec -launcher ssh \
    -launcher-exec $work/netns-ssh -hosts 10.77.0.1,10.77.0.2 -n $ranks -ppn $per_host \
    $py -c 'import socket; from mpi4py import MPI; c = MPI.COMM_WORLD; print(f\"rank {c.rank} of {c.size} on {socket.gethostname()}\", flush=True)'" | sort
ip netns exec fg-host1 unshare --uts sh -c "hostname host1; exec $mpiexec -launcher ssh \
    -launcher-exec $work/netns-ssh -hosts 10.77.0.1,10.77.0.2 -n $ranks -ppn $per_host \
    $py $train --set batch=16 --out $work/ranks" 2>/dev/null
echo "== one process, global batch $((16 * ranks))"
$py $train --set batch=$((16 * ranks)) --out "$work/one" 2>/dev/null
$py - "$work" <<'EOF'
import sys
import numpy as np
from flowgrad.training import checkpoint
a, b = (checkpoint.load(f"{sys.argv[1]}/{d}/checkpoint.safetensors") for d in ("ranks", "one"))
diff = max(float(np.abs(a.params[k] - b.params[k]).max()) for k in b.params)
print(f"step {a.step} vs {b.step}, global batch {a.config['batch']} vs {b.config['batch']}: "
      f"largest param difference {diff:.2e}")
EOF
