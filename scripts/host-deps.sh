#!/usr/bin/env bash
# System packages the lab (two hosts in network namespaces) and end-to-end tests need. Idempotent: installs only
# what is missing. Run as root (CI is root); `nox -s tests` calls it.
set -euo pipefail
PKGS=(
  openssh-server openssh-client rsync iproute2 iptables psmisc procps
  docker.io zfs-fuse fio busybox-static
  libibverbs-dev  # rdma-core headers: the all-reduce's RDMA backend compiles when they exist
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "host-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "host-deps: ok"
