#!/usr/bin/env python3
"""Dispatch shapes for nftables endpoint maps (issue 16): what each costs a new connection, and
what the kernel charges a commit of one service's element.

How a new connection reaches the `numgen` map of its service's endpoint count decides its
first-packet cost. Four shapes are loaded in turn, by `nft -f`, into a network namespace this
script creates (and deletes), and each is timed with the same traffic:

  trie      the agent's earlier shape: a binary trie over the bits in which the counts in use
            differ, one plain-set lookup per level (`... @bit-K goto ...`), then the count's map
  register  a count map whose value selects the count's chain through a small verdict map: two
            lookups. The agent would chain the lookups through a register; nft's grammar
            (text and JSON) cannot write that, so here the value passes through `meta mark`
            (which a proxy must not clobber), the same two lookups plus a mark write
  goto      the agent's shape: a verdict-map element per service that `goto`s the chain of its
            endpoint count, shared by every service of that count, which DNATs through the
            count's map (here it first marks traffic from outside the cluster for masquerade, as
            this script's kp chains do; the agent marks it before, through `@cluster-ips`, as
            kube-proxy v1.36+ does)
  kp        kube-proxy's: a verdict-map element per service, `goto` its own chain, whose
            `numgen ... vmap` picks an endpoint chain that DNATs

Traffic: TCP SYNs from a raw socket, each from a new source port (a new conntrack flow runs the
nat hooks), to the ClusterIPs of services with the given endpoint count; the endpoints' range is
routed to a veth whose peer is down (drops at once). The figure is the sending thread's CPU
(user + system, its exact clock) per SYN (median of the batches; conntrack flushed before each; every flow must have been
DNATed, none without rules). Only the dispatch and DNAT
differ between shapes; the agent's and kube-proxy's whole rulesets are compared by
`api-bench --first-packet`.

The second table times `nft add element` of one service into each shape's per-service map with
N services loaded (median of 30): a `goto` element makes the kernel validate every element of
the verdict map on each commit (the agent's `goto` elements reach count chains of one rule each).

Usage (root): python3 tests/bench/dispatch_shapes.py [--services 1000] [--counts 64]
              [--flows 60000] [--batches 7] [--commit-services 44000]
"""

import argparse
import ctypes
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

SHAPES = ("trie", "register", "goto", "kp")


def cluster_ip(i):
    return f"10.96.{i // 256}.{i % 256}"


def endpoint(i, j):
    return f"10.{128 + i // 256}.{i % 256}.{j}"


def count_of(i, counts):
    return 1 + i % counts


def trie_chains(counts, out):
    """Appends the trie's chains over `counts` (rooted at chain `d`) to `out`."""

    def node(cands, name):
        if len(cands) == 1:
            n = cands[0]
            out.append(
                f" chain {name} {{ dnat ip to ip daddr . meta l4proto . th dport . "
                f"numgen random mod {n} map @eps{n}; }}"
            )
            return
        differing = 0
        for c in cands:
            differing |= c ^ cands[0]
        bit = differing.bit_length() - 1
        ones = [c for c in cands if c >> bit & 1]
        zeros = [c for c in cands if not c >> bit & 1]
        out.append(
            f" chain {name} {{ ip daddr . meta l4proto . th dport @bit{bit} goto {name}1; "
            f"goto {name}0; }}"
        )
        node(ones, name + "1")
        node(zeros, name + "0")

    node(counts, "d")


def ruleset(shape, services, counts):
    """The `nft -f` script of one shape with `services` services of counts 1..`counts`."""
    used = sorted({count_of(i, counts) for i in range(services)})
    out = ["table ip t {"]
    if shape != "kp":
        for n in used:
            out.append(
                f" map eps{n} {{ typeof ip daddr . meta l4proto . th dport . numgen random mod {n}"
                " : ip daddr . th dport; }"
            )
    if shape == "trie":
        for b in range(max(used).bit_length()):
            out.append(f" set bit{b} {{ type ipv4_addr . inet_proto . inet_service; }}")
        trie_chains(used, out)
        entry = "jump d"
    elif shape == "goto":
        out.append(" map sips { type ipv4_addr . inet_proto . inet_service : verdict; }")
        for n in used:
            out.append(
                f" chain d{n} {{ ip saddr != 10.244.0.0/16 meta mark set meta mark | 0x4000; "
                f"dnat ip to ip daddr . meta l4proto . th dport . numgen random mod {n} map @eps{n}; }}"
            )
        entry = "ip daddr . meta l4proto . th dport vmap @sips"
    elif shape == "register":
        out.append(" map counts { type ipv4_addr . inet_proto . inet_service : mark; }")
        out.append(" map disp { type mark : verdict; }")
        for n in used:
            out.append(
                f" chain d{n} {{ dnat ip to ip daddr . meta l4proto . th dport . "
                f"numgen random mod {n} map @eps{n}; }}"
            )
        entry = "meta mark set ip daddr . meta l4proto . th dport map @counts meta mark vmap @disp"
    else:
        out.append(" map sips { type ipv4_addr . inet_proto . inet_service : verdict; }")
        out.append(" chain m { meta mark set meta mark | 0x4000; }")
        for i in range(services):
            n = count_of(i, counts)
            picks = ", ".join(f"{j} : goto e{i}_{j}" for j in range(n))
            out.append(
                f" chain s{i} {{ ip daddr {cluster_ip(i)} tcp dport 80 ip saddr != 10.244.0.0/16 "
                f"jump m; numgen random mod {n} vmap {{ {picks} }}; }}"
            )
            for j in range(n):
                out.append(
                    f" chain e{i}_{j} {{ ip saddr {endpoint(i, j)} jump m; "
                    f"meta l4proto tcp dnat ip to {endpoint(i, j)}:8080; }}"
                )
        entry = "ip daddr . meta l4proto . th dport vmap @sips"
    out.append(f" chain c {{ type nat hook output priority -100; policy accept; {entry}; }}")
    out.append(" chain p { type nat hook postrouting priority srcnat; policy accept; masquerade; }")
    out.append("}")
    out.extend(elements(shape, services, counts, used))
    return "\n".join(out) + "\n"


def elements(shape, services, counts, used):
    """The `add element` lines of one shape."""

    def line(name, items):
        return [f"add element ip t {name} {{ " + ", ".join(items) + " }"] if items else []

    key = lambda i: f"{cluster_ip(i)} . tcp . 80"  # noqa: E731
    out = []
    if shape == "kp":
        return line("sips", [f"{key(i)} : goto s{i}" for i in range(services)])
    for n in used:
        out += line(
            f"eps{n}",
            [
                f"{key(i)} . {j} : {endpoint(i, j)} . 8080"
                for i in range(services)
                if count_of(i, counts) == n
                for j in range(n)
            ],
        )
    if shape == "trie":
        for b in range(max(used).bit_length()):
            out += line(f"bit{b}", [key(i) for i in range(services) if count_of(i, counts) >> b & 1])
    elif shape == "goto":
        out += line("sips", [f"{key(i)} : goto d{count_of(i, counts)}" for i in range(services)])
    else:
        out += line("counts", [f"{key(i)} : {count_of(i, counts)}" for i in range(services)])
        out += line("disp", [f"{n} : goto d{n}" for n in used])
    return out


def checksum(data):
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


SOURCE = "10.127.255.1"


def syn(dst, sport):
    src, dst_b = socket.inet_aton(SOURCE), socket.inet_aton(dst)
    tcp = struct.pack("!HHIIBBHHH", sport, 80, 1, 0, 5 << 4, 2, 65535, 0, 0)
    tcp = tcp[:16] + struct.pack("!H", checksum(src + dst_b + struct.pack("!BBH", 0, 6, 20) + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 0, 0, 64, 6, 0, src, dst_b)
    return ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:] + tcp


def cpu_us_per_syn(netns, targets, flows, batches, dnat=True):
    """Median CPU µs (the sending thread's, user + system) per SYN to `targets`, sent from a thread inside `netns`; fails unless
    every flow of the last batch was DNATed (`dnat`) or none was."""
    result = []
    thread = threading.Thread(target=lambda: result.append(send_batches(netns, targets, flows, batches)))
    thread.start()
    thread.join()
    if not result:
        raise RuntimeError("the sending thread failed")
    cost, dnated = result[0]
    if dnated != (flows if dnat else 0):
        raise RuntimeError(f"{dnated} of {flows} flows were DNATed, expected {flows if dnat else 0}")
    return cost


def send_batches(netns, targets, flows, batches):
    """Runs in its own thread: enters `netns`, sends the batches, returns the median."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    # os.setns is Python 3.12+; Debian 12 has 3.11. CLONE_NEWNET = 0x40000000.
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.close(fd)
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    packets = [(syn(targets[k % len(targets)], 1024 + k), targets[k % len(targets)]) for k in range(flows)]
    costs = []
    for _ in range(batches):
        subprocess.run(["conntrack", "-F"], capture_output=True, check=False)
        # The thread's CPU clock is the scheduler's exact runtime; getrusage's system time is that
        # runtime split by sampled ticks. The Python loop's user time is the same for every
        # ruleset, so differences between rulesets are the rules' cost.
        before = time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)
        for packet, dst in packets:
            sock.sendto(packet, (dst, 0))
        costs.append((time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID) - before) / flows * 1e6)
    sock.close()
    # The last batch's flows that were DNATed (a child forked here inherits this namespace).
    listing = subprocess.run(["conntrack", "-L", "-p", "tcp", "--dst-nat"], capture_output=True, text=True, check=True)
    dnated = sum(1 for line in listing.stdout.splitlines() if "dport=" in line)
    return statistics.median(costs), dnated


def sh(*args):
    subprocess.run(args, check=True)


def in_ns(netns, *args, stdin=None):
    subprocess.run(["ip", "netns", "exec", netns, *args], check=True, input=stdin, text=True)


def setup(netns):
    sh("ip", "netns", "add", netns)
    steps = [
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", "fps0", "type", "veth", "peer", "name", "fps1"],
        ["ip", "addr", "add", f"{SOURCE}/30", "dev", "fps0"],
        ["ip", "link", "set", "fps0", "up"],
        ["ip", "neigh", "add", "10.127.255.2", "lladdr", "02:00:00:00:00:02", "dev", "fps0", "nud", "permanent"],
        ["ip", "route", "add", "10.128.0.0/9", "via", "10.127.255.2"],
        ["ip", "route", "add", "10.96.0.0/12", "via", "10.127.255.2"],
    ]
    for step in steps:
        in_ns(netns, *step)


def first_packets(netns, args):
    """Rows: target endpoint count -> {shape: µs}, shapes interleaved over two rounds."""
    targets = [1, args.counts]
    rows = {t: {s: [] for s in ("none",) + SHAPES} for t in targets}
    for _ in range(2):
        for shape in ("none",) + SHAPES:
            in_ns(netns, "nft", "flush", "ruleset")
            if shape != "none":
                in_ns(netns, "nft", "-f", "-", stdin=ruleset(shape, args.services, args.counts))
            for t in targets:
                ips = [cluster_ip(i) for i in range(args.services) if count_of(i, args.counts) == t]
                rows[t][shape].append(cpu_us_per_syn(netns, ips, args.flows, args.batches, shape != "none"))
    return rows


def commit_ms(netns, script, runs=30):
    """Median wall ms of `nft -f` of `script(i)` for i in 0..runs."""
    times = []
    for i in range(runs):
        start = time.perf_counter()
        in_ns(netns, "nft", "-f", "-", stdin=script(i))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def commit_table(services, verdicts):
    """A table with `services` elements in one map: plain DNAT targets, or `goto` one of 64 chains."""
    out = ["table ip t {"]
    if verdicts:
        out.append(" map m { type ipv4_addr . inet_proto . inet_service : verdict; }")
        out += [f" chain d{n} {{ meta l4proto tcp dnat ip to 10.128.0.{n}:80; }}" for n in range(64)]
        out.append(" chain c { type nat hook output priority -100; policy accept; "
                   "ip daddr . meta l4proto . th dport vmap @m; }")
        items = [f"{cluster_ip(i)} . tcp . 80 : goto d{i % 64}" for i in range(services)]
    else:
        out.append(" map m { typeof ip daddr . meta l4proto . th dport . numgen random mod 1"
                   " : ip daddr . th dport; }")
        out.append(" chain c { type nat hook output priority -100; policy accept; "
                   "dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 1 map @m; }")
        items = [f"{cluster_ip(i)} . tcp . 80 . 0 : 10.128.{i // 256 % 256}.{i % 256} . 80" for i in range(services)]
    out.append("}")
    out.append("add element ip t m { " + ", ".join(items) + " }")
    return "\n".join(out) + "\n"


def commits(netns, args):
    """Median ms to add one service's element with `commit-services` loaded, plain or `goto`."""
    out = {}
    for verdicts in (False, True):
        in_ns(netns, "nft", "flush", "ruleset")
        in_ns(netns, "nft", "-f", "-", stdin=commit_table(args.commit_services, verdicts))
        if verdicts:
            script = lambda i: f"add element ip t m {{ 10.200.0.{i} . tcp . 80 : goto d5 }}\n"  # noqa: E731
        else:
            script = lambda i: f"add element ip t m {{ 10.200.0.{i} . tcp . 80 . 0 : 10.1.1.1 . 80 }}\n"  # noqa: E731
        out[verdicts] = commit_ms(netns, script)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--counts", type=int, default=64)
    parser.add_argument("--flows", type=int, default=60000)
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--commit-services", type=int, default=44000)
    args = parser.parse_args()
    if args.services > 256 * 32 or args.counts > 255 or args.flows > 60000 or args.commit_services > 65280:
        sys.exit("at most 8192 services, 255 endpoints each, 60000 flows per batch, 65280 commit services")
    netns = f"swyds{os.getpid()}"
    try:
        setup(netns)
        rows = first_packets(netns, args)
        print(f"\n{args.services} services with 1..{args.counts} endpoints, CPU µs (the sending thread's) per new-flow SYN")
        print("(median of the batches; two rounds, shapes interleaved)\n")
        print("| to a service with | no rules | " + " | ".join(SHAPES) + " |")
        print("|---|---|" + "---|" * len(SHAPES))
        for t, cells in rows.items():
            text = " | ".join(" / ".join(f"{x:.2f}" for x in cells[s]) for s in ("none",) + SHAPES)
            print(f"| {t} endpoint(s) | {text} |")
        ms = commits(netns, args)
        print(f"\nAdding one service's element with {args.commit_services} services loaded (median of 30 `nft -f`)\n")
        print("| plain endpoint-map element | verdict-map `goto` element (goto, kp) |")
        print("|---|---|")
        print(f"| {ms[False]:.1f} ms | {ms[True]:.1f} ms |")
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)


if __name__ == "__main__":
    main()
