#!/usr/bin/env bash
# Installs what Switchyard's demo and tests need on a fresh Debian machine (idempotent):
# kernel userspace tools from apt (and lua5.1, which runs the Argo CD health checks in tests; runc,
# the CNI plugins and a static busybox for the real-node tier's containers), then the Go-built
# control plane, helm and the node tier's containerd/crictl (cached outside git).
# --tools-only: only the apt tools and the checks (scripts/test.sh builds the Go binaries itself,
# beside the Rust builds).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tools_only=0
[ "${1:-}" = --tools-only ] && tools_only=1

need=()
for tool in nft:nftables iptables-legacy:iptables iptables-nft:iptables ipset:ipset ip:iproute2 conntrack:conntrack sysctl:procps lua5.1:lua5.1 \
    runc:runc /usr/lib/cni/bridge:containernetworking-plugins /bin/busybox:busybox-static; do
  case ${tool%%:*} in
    /*) [ -x "${tool%%:*}" ] || need+=("${tool#*:}") ;;
    *) command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool#*:}") ;;
  esac
done
if [ ${#need[@]} -gt 0 ]; then
  echo "[install-deps] apt-get install ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || { echo "switchyard: cargo (Rust >= 1.89) is required: install it with rustup" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "switchyard: the demo and tests create network namespaces and need root" >&2; exit 1; }
[ "$tools_only" = 1 ] || "$here/build-control-plane.sh" >/dev/null
