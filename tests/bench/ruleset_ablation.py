#!/usr/bin/env python3
"""First-packet cost of a whole dumped ruleset, and of it with single rules taken out (issue 16).

`api-bench --first-packet` compares the agent's and kube-proxy's rulesets as they run; this
script says where the difference goes. Give it `nft list ruleset` dumps (e.g. taken from
api-bench's node namespaces while it measures) and it loads each into a network namespace it
creates (and deletes), sends new-flow SYNs (the traffic of `dispatch_shapes.py`) to ClusterIPs
of the Services with the fewest and the most endpoints, and prints system CPU µs per SYN for the
whole ruleset and for the ruleset without each rule named by `--drop` (a substring of the rule).

With `--rounds N` it compares whole rulesets instead: each round loads every ruleset in turn
(order rotated per round, so that no ruleset always follows the same one) and times it, and the
table gives each ruleset's median and, per pair, the median of the per-round differences and in
how many rounds the first was cheaper — on a machine whose cost per SYN drifts by more than the
differences asked about, only paired rounds can tell them apart.

Usage (root): python3 tests/bench/ruleset_ablation.py --ruleset ours.nft --ruleset kp.nft
              [--drop '@cluster-ips' --drop '@hairpin-connections' ...] [--flows 60000]
              [--rounds 16 --flows 30000 --batches 5]
"""

import argparse
import itertools
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dispatch_shapes as ds  # noqa: E402


def targets(text):
    """ClusterIPs of the port-80 Services with the fewest and the most endpoints in a dumped ruleset (the
    SYNs go to port 80, as api-bench's Services listen)."""
    # Switchyard: endpoint maps `ip-endpoints-N` keyed by `ip . proto . port . slot`.
    maps = {}
    for m in re.finditer(r"map ip-endpoints-(\d+) \{(.*?)\n\t\}", text, re.S):
        ips = re.findall(r"(\d+\.\d+\.\d+\.\d+) \. tcp \. 80 \. 0", m.group(2))
        if ips:
            maps[int(m.group(1))] = sorted(set(ips))
    if not maps:
        # kube-proxy: service chains `numgen random mod N`, reached from `service-ips`.
        chains = {}
        for m in re.finditer(r"chain (service-\S+) \{(.*?)\n\t\}", text, re.S):
            mod = re.search(r"numgen random mod (\d+)", m.group(2))
            chains[m.group(1)] = int(mod.group(1)) if mod else 1
        for ip, chain in re.findall(r"(\d+\.\d+\.\d+\.\d+) \. tcp \. 80 : goto (service-\S+?)[,\s}]", text):
            if chain in chains:
                maps.setdefault(chains[chain], []).append(ip)
    if not maps:
        raise SystemExit("no endpoint maps or service chains found in the ruleset")
    return {n: maps[n] for n in (min(maps), max(maps))}


def drop_rule(text, needle):
    """The ruleset without the rule lines containing `needle` (inside chains only)."""
    out, in_chain, dropped = [], False, 0
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("chain "):
            in_chain = True
        elif stripped == "}" and line.startswith("\t}"):
            in_chain = False
        if in_chain and needle in line and not stripped.startswith(("chain ", "type ")):
            dropped += 1
            continue
        out.append(line)
    if not dropped:
        raise SystemExit(f"no rule contains {needle!r}")
    return "\n".join(out) + "\n"


def measure(netns, text, tg, args):
    ds.in_ns(netns, "nft", "flush", "ruleset")
    if text:
        ds.in_ns(netns, "nft", "-f", "-", stdin=text)
    return {n: ds.sys_us_per_syn(netns, ips, args.flows, args.batches, bool(text)) for n, ips in tg.items()}


def rounds(netns, args):
    """Whole rulesets, interleaved over `args.rounds` rounds: medians and paired differences."""
    texts = {p: open(p, encoding="utf-8").read() for p in args.ruleset}
    tgs = {p: targets(t) for p, t in texts.items()}
    costs = {p: {n: [] for n in tgs[p]} for p in args.ruleset}
    for r in range(args.rounds):
        k = r % len(args.ruleset)
        for p in args.ruleset[k:] + args.ruleset[:k]:
            for n, c in measure(netns, texts[p], tgs[p], args).items():
                costs[p][n].append(c)
    name = os.path.basename
    print(f"| ruleset | to the fewest endpoints (median of {args.rounds}) | to the most |")
    print("|---|---|---|")
    for p, by_count in costs.items():
        cells = " | ".join(f"{statistics.median(v):.2f} ({n})" for n, v in by_count.items())
        print(f"| {name(p)} | {cells} |")
    print("\n| pair (first − second) | fewest endpoints: median difference, rounds first cheaper | most |")
    print("|---|---|---|")
    for a, b in itertools.combinations(args.ruleset, 2):
        cells = []
        for (na, va), (nb, vb) in zip(costs[a].items(), costs[b].items()):
            d = [x - y for x, y in zip(va, vb)]
            cells.append(f"{statistics.median(d):+.2f} µs, {sum(x < 0 for x in d)} of {len(d)} ({na} / {nb})")
        print(f"| {name(a)} − {name(b)} | {' | '.join(cells)} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ruleset", action="append", required=True)
    parser.add_argument("--drop", action="append", default=[])
    parser.add_argument("--flows", type=int, default=60000)
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=0)
    args = parser.parse_args()
    netns = f"swyra{os.getpid()}"
    try:
        ds.setup(netns)
        if args.rounds:
            rounds(netns, args)
            return
        print("| ruleset | variant | to the fewest endpoints | to the most |")
        print("|---|---|---|---|")
        for path in args.ruleset:
            text = open(path, encoding="utf-8").read()
            tg = targets(text)
            variants = [("no rules", ""), ("whole", text)]
            variants += [(f"without `{d}`", drop_rule(text, d)) for d in args.drop if d in text]
            for name, body in variants:
                cost = measure(netns, body, tg, args)
                cells = " | ".join(f"{cost[n]:.2f} ({n})" for n in tg)
                print(f"| {os.path.basename(path)} | {name} | {cells} |", flush=True)
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)


if __name__ == "__main__":
    main()
