#!/usr/bin/env bash
# The local demo: a real control plane, Switchyard's CRDs and RBAC, namespace nodes with agents.
# Runs until Ctrl-C, then removes everything it created.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export SWITCHYARD_K8S_BIN=$(scripts/build-control-plane.sh)
cargo build --workspace --bins --locked
exec target/debug/switchyard-demo "$@"
