#!/usr/bin/env python3
"""First-packet cost of a whole dumped ruleset, and of it with single rules taken out (issue 16).

`api-bench --first-packet` compares the agent's and kube-proxy's rulesets as they run; this
script says where the difference goes. Give it `nft list ruleset` dumps (e.g. taken from
api-bench's node namespaces while it measures) and it loads each into a network namespace it
creates (and deletes), sends new-flow SYNs (the traffic of `dispatch_shapes.py`) to ClusterIPs
of the Services with the fewest and the most endpoints, and prints CPU µs (the sending thread's) per SYN for the
whole ruleset and for the ruleset without each rule named by `--drop` (a substring of the rule).

With `--rounds N` it compares whole rulesets instead: each ruleset is loaded once into a
namespace of its own, and each round times one measurement in every namespace in turn (order
rotated per round, so that no ruleset always follows the same one); the table gives each
ruleset's median and, per pair, the median of the per-round differences with its
distribution-free 99% confidence interval and in how many rounds the first was cheaper — on a
machine whose cost per SYN drifts by more than the differences asked about, only paired rounds
seconds apart can tell them apart.

Usage (root): python3 tests/bench/ruleset_ablation.py --ruleset ours.nft --ruleset kp.nft
              [--drop '@cluster-ips' --drop '@hairpin-connections' ...] [--flows 60000]
              [--rounds 200 --flows 10000 --batches 1] [--sender rust|python]
"""

import argparse
import itertools
import math
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


SYN_COST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "target", "release", "syn-cost")


def cost(netns, ips, args, dnat=True):
    """CPU µs per SYN to `ips` in `netns`: from Python's own loop (`--sender python`) or from
    `syn-cost` (`--sender rust`: `cargo build --release -p switchyard-e2e --bin syn-cost`), whose
    own CPU per SYN is a fraction of Python's and steadier."""
    if args.sender == "python":
        return ds.cpu_us_per_syn(netns, ips, args.flows, args.batches, dnat)
    cmd = [SYN_COST, "--netns", netns, "--src", ds.SOURCE, "--flows", str(args.flows)]
    out = subprocess.run(
        cmd + ["--batches", str(args.batches), *ips], capture_output=True, text=True, check=True
    ).stdout.split()
    us, dnated = float(out[0]), int(out[1])
    if dnated != (args.flows if dnat else 0):
        raise RuntimeError(f"{dnated} of {args.flows} flows were DNATed, expected {args.flows if dnat else 0}")
    return us


def measure(netns, text, tg, args):
    ds.in_ns(netns, "nft", "flush", "ruleset")
    if text:
        ds.in_ns(netns, "nft", "-f", "-", stdin=text)
    return {n: cost(netns, ips, args, bool(text)) for n, ips in tg.items()}


def median_ci(d, alpha=0.01):
    """Distribution-free confidence interval (1 − `alpha`) of the median of `d`: the order
    statistics k and n − k + 1, k the largest with P(Binomial(n, ½) < k) ≤ alpha / 2; None when
    there are too few values for it."""
    n, s = len(d), sorted(d)
    below, k = 0.0, 0
    while below + math.comb(n, k) / 2**n <= alpha / 2:
        below += math.comb(n, k) / 2**n
        k += 1
    return (s[k - 1], s[n - k]) if k else None


def rounds(args):
    """Whole rulesets, interleaved over `args.rounds` rounds: medians and paired differences.

    Each ruleset is loaded once, into a namespace of its own (set up alike); each round sends one
    measurement to each namespace in turn (order rotated), so that the paired rounds are
    seconds apart and the machine's drift cancels out of their differences."""
    texts = {p: open(p, encoding="utf-8").read() for p in args.ruleset}
    tgs = {p: targets(t) for p, t in texts.items()}
    spaces = {p: f"swyra{os.getpid()}-{i}" for i, p in enumerate(args.ruleset)}
    costs = {p: {n: [] for n in tgs[p]} for p in args.ruleset}
    try:
        for p, netns in spaces.items():
            ds.setup(netns)
            ds.in_ns(netns, "nft", "-f", "-", stdin=texts[p])
        for r in range(args.rounds):
            k = r % len(args.ruleset)
            for p in args.ruleset[k:] + args.ruleset[:k]:
                for n, ips in tgs[p].items():
                    costs[p][n].append(cost(spaces[p], ips, args))
    finally:
        for netns in spaces.values():
            subprocess.run(["ip", "netns", "del", netns], check=False)
    name = os.path.basename
    print(f"| ruleset | to the fewest endpoints (median of {args.rounds}) | to the most |")
    print("|---|---|---|")
    for p, by_count in costs.items():
        cells = " | ".join(f"{statistics.median(v):.2f} ({n})" for n, v in by_count.items())
        print(f"| {name(p)} | {cells} |")
    print(
        "\n| pair (first − second) | fewest endpoints: median difference [99% CI], rounds first "
        "cheaper | most |"
    )
    print("|---|---|---|")
    for a, b in itertools.combinations(args.ruleset, 2):
        cells = []
        for (na, va), (nb, vb) in zip(costs[a].items(), costs[b].items()):
            d = [x - y for x, y in zip(va, vb)]
            ci = median_ci(d)
            ci_text = f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "[too few rounds]"
            cells.append(
                f"{statistics.median(d):+.2f} µs {ci_text}, {sum(x < 0 for x in d)} of {len(d)} ({na} / {nb})"
            )
        print(f"| {name(a)} − {name(b)} | {' | '.join(cells)} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ruleset", action="append", required=True)
    parser.add_argument("--drop", action="append", default=[])
    parser.add_argument("--flows", type=int, default=60000)
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--sender", choices=("rust", "python"), default="rust")
    args = parser.parse_args()
    if args.sender == "rust" and not os.access(SYN_COST, os.X_OK):
        raise SystemExit(
            f"{SYN_COST} is missing: cargo build --release -p switchyard-e2e --bin syn-cost (or --sender python)"
        )
    if args.rounds:
        rounds(args)
        return
    netns = f"swyra{os.getpid()}"
    try:
        ds.setup(netns)
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
