#!/usr/bin/env bash
# Runs every test: formatting and lints (both enforced), unit and golden tests, and the end-to-end
# tests on a real kube-apiserver with network-namespace nodes and real kubelet nodes. Installs what
# is missing first.
#
# The Go builds (control plane, kubelet, kube-proxy, containerd, helm; cached) run in the background
# beside the Rust ones: each alone leaves a core idle for minutes (Go's links, Cargo's one-crate
# tails such as k8s-openapi), so a cold run overlaps them. Each step's wall time is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
step() { echo "[test.sh +$(( $(date +%s) - start ))s] $*" >&2; }
scripts/install-deps.sh --tools-only
go_out=$(mktemp)
go_log=$(mktemp)
go_pid=""
# On any exit, the background build's whole process group (its go and compile processes) ends too.
trap '[ -z "$go_pid" ] || kill -- "-$go_pid" 2>/dev/null || true; rm -f "$go_out" "$go_log"' EXIT
step "Go builds in the background (log: $go_log)"
setsid scripts/build-control-plane.sh >"$go_out" 2>"$go_log" &
go_pid=$!
step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
step "cargo build (debug, the tests' binaries)"
cargo build --workspace --bins --locked
step "scripts/build-images.sh"
scripts/build-images.sh
step "waiting for the Go builds"
if ! wait "$go_pid"; then
  go_pid=""
  cat "$go_log" >&2
  echo "switchyard: scripts/build-control-plane.sh failed (its log is above)" >&2
  exit 1
fi
go_pid=""
cat "$go_log" >&2
SWITCHYARD_K8S_BIN=$(tail -1 "$go_out")
export SWITCHYARD_K8S_BIN
step "cargo test"
cargo test --workspace --locked --no-fail-fast
step "done"
