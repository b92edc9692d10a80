#!/bin/bash
# Dumps the rulesets the agent and kube-proxy program in an api-bench run, for
# tests/bench/ruleset_ablation.py: runs `api-bench --rows ROWS --proxies PROXIES --first-packet`
# in the background and, once a second while it runs, lists each node namespace's `ip switchyard`
# and `ip kube-proxy` tables, keeping the longest listing of each as OUT-switchyard.nft and
# OUT-kube-proxy.nft (the bench's own output goes to OUT.log).
#
# Usage (root, from the repository, with SWITCHYARD_K8S_BIN set as for api-bench):
#   tests/bench/dump_rulesets.sh /tmp/fp 1kx1-64 sy-nft,kp-nft
set -euo pipefail
out=$1 rows=$2 proxies=$3
rm -f "$out"-switchyard.nft "$out"-kube-proxy.nft
target/release/api-bench --rows "$rows" --proxies "$proxies" --first-packet --samples 5 \
  --period-ms 2 --reps 1 >"$out.log" 2>&1 &
bench=$!
# Bounded: at most an hour of polling.
for _ in $(seq 1 3600); do
  for ns in $(ip netns list | awk '{print $1}'); do
    for table in switchyard kube-proxy; do
      listing=$(ip netns exec "$ns" nft list table ip "$table" 2>/dev/null) || continue
      kept=0
      [ -f "$out-$table.nft" ] && kept=$(wc -l <"$out-$table.nft")
      if [ "$(wc -l <<<"$listing")" -gt "$kept" ]; then
        printf '%s\n' "$listing" >"$out-$table.nft"
      fi
    done
  done
  kill -0 "$bench" 2>/dev/null || break
  sleep 1
done
wait "$bench"
wc -l "$out"-*.nft
