//! First-packet cost (issue 16): the CPU the kernel spends on the first packet of a new
//! connection to a ClusterIP, with a proxy's ruleset in place and without.
//!
//! A thread enters the node namespace and sends TCP SYNs through a raw socket (`IP_HDRINCL`), each
//! from a fresh source port, so that every packet is a new conntrack flow: it runs the nat
//! `output` hook (the proxy's dispatch and DNAT), routing, and the `postrouting` hook
//! (masquerade) in the sending thread's own system time. The endpoints' range is routed to a
//! veth whose peer is down inside the node namespace, which drops what it is given, so no other
//! namespace's work is counted. The cost is the thread's CPU clock over a batch divided by its packets;
//! conntrack is flushed before every batch so that each batch starts from an empty table.

use std::{
    fs::File,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsFd, AsRawFd},
    time::Duration,
};

use nix::{
    sched::{CloneFlags, setns},
    sys::socket::{AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn, sendto, socket},
    time::{ClockId, clock_gettime},
};

use super::sys::in_netns;
use crate::{Error, Result, io_err};

/// The veth end the endpoints' range is routed to inside the node namespace. Its peer stays
/// down, so the veth drops every packet at once in the sender's context (this kernel has no
/// `dummy` links): no other namespace's work is counted.
const SINK_LINK: &str = "fpsink0";
/// Its peer (down).
const SINK_PEER: &str = "fpsink1";
/// The range the benchmark's endpoints are allocated from (see `Model::alloc_ep`).
const ENDPOINT_RANGE: &str = "10.128.0.0/9";
/// The sink's own address (inside the node namespace only), so that masquerade finds a source.
const SINK_ADDR: &str = "10.127.255.1/30";
/// The next hop of the endpoints' route, with a permanent neighbour entry: no ARP is attempted.
const SINK_GATEWAY: &str = "10.127.255.2";

/// How one measurement is made.
#[derive(Debug, Clone, Copy)]
pub struct FlowOpts {
    /// New flows per batch (at most 60,000: one source port each).
    pub flows: usize,
    /// Batches; the result is their median.
    pub batches: usize,
}

impl Default for FlowOpts {
    fn default() -> Self {
        Self {
            flows: 20_000,
            batches: 7,
        }
    }
}

/// Routes the endpoints' range to a dropping link in `netns` (once per namespace).
pub fn install_sink(netns: &str) -> Result<()> {
    let steps: [&[&str]; 5] = [
        &[
            "ip", "link", "add", SINK_LINK, "type", "veth", "peer", "name", SINK_PEER,
        ],
        &["ip", "addr", "add", SINK_ADDR, "dev", SINK_LINK],
        &["ip", "link", "set", SINK_LINK, "up"],
        &[
            "ip",
            "neigh",
            "add",
            SINK_GATEWAY,
            "lladdr",
            "02:00:00:00:00:02",
            "dev",
            SINK_LINK,
            "nud",
            "permanent",
        ],
        &[
            "ip",
            "route",
            "add",
            ENDPOINT_RANGE,
            "via",
            SINK_GATEWAY,
            "dev",
            SINK_LINK,
            "onlink",
        ],
    ];
    for step in steps {
        in_netns(netns, step)?;
    }
    Ok(())
}

/// The Internet checksum of `parts` concatenated (each part of even length but the last).
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for part in parts {
        for pair in part.chunks(2) {
            let word = u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
            sum += u32::from(word);
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 TCP SYN from `src:sport` to `dst:dport` (the kernel fills the IP checksum and length).
pub fn syn_packet(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> [u8; 40] {
    let mut p = [0u8; 40];
    p[0] = 0x45; // version 4, 5 words
    p[2..4].copy_from_slice(&40u16.to_be_bytes());
    p[6] = 0x40; // don't fragment
    p[8] = 64; // TTL
    p[9] = 6; // TCP
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    let tcp = &mut p[20..40];
    tcp[0..2].copy_from_slice(&sport.to_be_bytes());
    tcp[2..4].copy_from_slice(&dport.to_be_bytes());
    tcp[4..8].copy_from_slice(&u32::from(sport).wrapping_mul(2_654_435_761).to_be_bytes());
    tcp[12] = 5 << 4; // data offset: 5 words
    tcp[13] = 0x02; // SYN
    tcp[14..16].copy_from_slice(&64_240u16.to_be_bytes());
    let mut pseudo = [0u8; 12];
    pseudo[0..4].copy_from_slice(&src.octets());
    pseudo[4..8].copy_from_slice(&dst.octets());
    pseudo[9] = 6;
    pseudo[10..12].copy_from_slice(&20u16.to_be_bytes());
    let sum = checksum(&[&pseudo, &p[20..40]]);
    p[36..38].copy_from_slice(&sum.to_be_bytes());
    p
}

fn thread_cpu() -> Result<Duration> {
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .map_err(|e| Error::Prerequisite(format!("thread CPU clock: {e}")))
}

/// What one measurement found.
#[derive(Debug, Clone, Copy)]
pub struct FlowCost {
    /// Median µs of thread CPU per new flow.
    pub us_per_flow: f64,
    /// Flows of the last batch that conntrack recorded as destination-NATed (all of them when a
    /// proxy's rules served them; none without rules).
    pub dnated: usize,
}

/// Thread CPU per new flow from `src` to `targets` (round robin) on `port`, in `netns`. Every send
/// must succeed: a refused packet would cost less and read as fast.
pub fn cost_per_flow(
    netns: &str,
    src: Ipv4Addr,
    targets: &[Ipv4Addr],
    port: u16,
    opts: FlowOpts,
) -> Result<FlowCost> {
    if targets.is_empty() || opts.flows == 0 || opts.flows > 60_000 || opts.batches == 0 {
        return Err(Error::Prerequisite(format!(
            "first-packet benchmark: bad options {opts:?} for {} targets",
            targets.len()
        )));
    }
    let path = format!("/run/netns/{netns}");
    let per_batch: Vec<f64> = std::thread::scope(|s| {
        s.spawn(|| -> Result<Vec<f64>> {
            let ns = File::open(&path).map_err(io_err(format!("open {path}")))?;
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET)
                .map_err(|e| Error::Prerequisite(format!("setns {netns}: {e}")))?;
            let sock = socket(
                AddressFamily::Inet,
                SockType::Raw,
                SockFlag::SOCK_CLOEXEC,
                SockProtocol::Raw,
            )
            .map_err(|e| Error::Prerequisite(format!("raw socket in {netns}: {e}")))?;
            let packets: Vec<([u8; 40], SockaddrIn)> = (0..opts.flows)
                .map(|i| {
                    let dst = targets[i % targets.len()];
                    let sport = 2_000 + i as u16;
                    (
                        syn_packet(src, sport, dst, port),
                        SockaddrIn::from(SocketAddrV4::new(dst, 0)),
                    )
                })
                .collect();
            // One batch more than asked, the first discarded: it warms caches and allocators.
            let mut out = Vec::with_capacity(opts.batches);
            for batch in 0..=opts.batches {
                in_netns(netns, &["conntrack", "-F"])?;
                let start = thread_cpu()?;
                for (packet, to) in &packets {
                    sendto(sock.as_raw_fd(), packet, to, MsgFlags::empty()).map_err(|e| {
                        Error::Prerequisite(format!("send a SYN to {} in {netns}: {e}", to.ip()))
                    })?;
                }
                let spent = thread_cpu()? - start;
                if batch > 0 {
                    out.push(spent.as_secs_f64() * 1e6 / opts.flows as f64);
                }
            }
            Ok(out)
        })
        .join()
        .map_err(|_| Error::Prerequisite(format!("first-packet thread in {netns} panicked")))?
    })?;
    let listing = in_netns(netns, &["conntrack", "-L", "-p", "tcp", "--dst-nat"])?;
    let dnated = listing.lines().filter(|l| l.contains("dport=")).count();
    in_netns(netns, &["conntrack", "-F"])?;
    Ok(FlowCost {
        us_per_flow: super::median(&per_batch),
        dnated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_syn_checksum_verifies() {
        let p = syn_packet(
            Ipv4Addr::new(192, 168, 1, 2),
            2000,
            Ipv4Addr::new(10, 96, 0, 16),
            80,
        );
        let mut pseudo = [0u8; 12];
        pseudo[0..4].copy_from_slice(&p[12..16]);
        pseudo[4..8].copy_from_slice(&p[16..20]);
        pseudo[9] = 6;
        pseudo[10..12].copy_from_slice(&20u16.to_be_bytes());
        // Summing a segment with its correct checksum in place gives 0 (all ones, inverted).
        assert_eq!(checksum(&[&pseudo, &p[20..40]]), 0);
        assert_eq!(p[33], 0x02, "SYN flag");
        assert_eq!(&p[22..24], &80u16.to_be_bytes());
    }
}
