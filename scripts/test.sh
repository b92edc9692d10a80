#!/usr/bin/env bash
# Runs every test: formatting and lints (both enforced), unit and golden tests, and the end-to-end
# tests on a real kube-apiserver with network-namespace nodes and real kubelet nodes. Installs what
# is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export SWITCHYARD_K8S_BIN=$(scripts/build-control-plane.sh)
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo build --workspace --bins --locked
scripts/build-images.sh
cargo test --workspace --locked --no-fail-fast
