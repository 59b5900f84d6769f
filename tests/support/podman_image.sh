#!/usr/bin/env bash
# The image the container tests run stages in (tests/slurm/test_slurm_container.py), built here from
# a Debian root file system (debootstrap from the Debian mirror, nothing pulled from a registry): the
# OS, the libraries the project's Python links Open MPI (mpi4py) and ninja
# (DeepSpeed loads its built CPU op through it); the Python, the venv and the
# project are mounted.
set -euo pipefail
image=${1:-localhost/hpcr1-ranks:test}
podman image exists "$image" && exit 0
codename=$(sed -n "s/^VERSION_CODENAME=//p" /etc/os-release)
root=$(mktemp -d /var/tmp/hpcr1-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3.11,libstdc++6,libgomp1,libopenmpi3,ninja-build "$codename" "$root" \
  http://deb.debian.org/debian >/dev/null
tar -C "$root" -c . | podman import --quiet - "$image" >/dev/null
echo "built $image"
