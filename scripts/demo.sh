#!/usr/bin/env bash
# The local demo of Switchyard as it ships: a real control plane and five kubelet nodes (containerd
# + kubelet in network namespaces, no kube-proxy), the Helm chart installed with the images
# scripts/build-images.sh builds, echo servers behind a Service, a client Pod on every node, and a
# ProxyPolicy moving the pool from iptables to nftables in waves, shown live. Runs until Ctrl-C,
# then removes everything it created. `scripts/demo.sh --processes`: the faster variant with the
# agents and the operator as processes in namespace nodes (no kubelets, no images).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export SWITCHYARD_K8S_BIN=$(scripts/build-control-plane.sh)
cargo build --workspace --bins --locked
case " $* " in
  *" --processes "*) ;;
  *) scripts/build-images.sh ;;
esac
exec target/debug/switchyard-demo "$@"
