//! The pure render of a [`Snapshot`] into the desired IPVS-mode state: virtual servers and their
//! real servers, the addresses bound on `swy-ipvs0`, the `SWY-*` ipsets and the few iptables rules
//! (chains `SWY-IPVS-*`). No kernel access; golden-tested.
//!
//! Layout (kube-proxy's IPVS mode, kubeproxy.md §3, with our names):
//! - one virtual server per ClusterIP, external IP, load-balancer IP and node address + NodePort
//!   of every service port, scheduler from the settings (default `rr`; `mh` adds `mh-port`),
//!   `persistent` with the affinity timeout for ClientIP affinity; real servers masqueraded with
//!   weight 1: the cluster endpoints, or the node-local ones for `Local` traffic policies. A
//!   service without endpoints keeps its virtual server with no real servers: IPVS then answers
//!   new connections with ICMP port-unreachable (a reject), as in kube-proxy's IPVS mode.
//! - ClusterIPs, external IPs and load-balancer IPs that are not node addresses are bound to the
//!   dummy link so IPVS sees their traffic in LOCAL_IN.
//! - ipsets tell the iptables rules which destinations are services: masquerade marks (cluster
//!   IPs from outside the cluster CIDR, external IPs, load balancers and node ports unless their
//!   policy is Local), hairpin masquerade (`SWY-LOOP-BACK`), load-balancer source ranges, and
//!   `SWY-IPVS-FILTER`, which rejects new connections to service addresses on ports that are not
//!   services (kubernetes#72236).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use crate::backend::Settings;
use crate::backend::iptables::render::{comment, forward_rules, postrouting_rules};
use crate::model::{Endpoint, IpFamily, Protocol, ServicePort, Snapshot, categorize};
use crate::sys::ipset::SetSpec;
use crate::sys::ipvs::{self, FLAG_PERSISTENT, FLAG_SCHED2, VirtualAddr};

/// The dummy link carrying service addresses.
pub const LINK: &str = "swy-ipvs0";
/// Prefix of every iptables chain of IPVS mode.
pub const CHAIN_PREFIX: &str = "SWY-IPVS-";
/// nat: entry from PREROUTING and OUTPUT.
pub const SERVICES: &str = "SWY-IPVS-SERVICES";
/// nat: masquerade of marked traffic (from POSTROUTING).
pub const POSTROUTING: &str = "SWY-IPVS-POSTROUTING";
/// nat: sets the masquerade mark.
pub const MARK_MASQ: &str = "SWY-IPVS-MARK-MASQ";
/// nat: node ports; filter: health-check node ports (from INPUT).
pub const NODE_PORT: &str = "SWY-IPVS-NODE-PORT";
/// nat: load balancers.
pub const LOAD_BALANCER: &str = "SWY-IPVS-LOAD-BALANCER";
/// filter: forwarding of service traffic (from FORWARD).
pub const FORWARD: &str = "SWY-IPVS-FORWARD";
/// filter: load-balancer source ranges (from INPUT and FORWARD).
pub const FIREWALL: &str = "SWY-IPVS-FIREWALL";
/// filter: drop what no source range allows.
pub const SOURCE_RANGES: &str = "SWY-IPVS-SRC-RANGES";
/// filter: reject new connections to service addresses on non-service ports (from INPUT).
pub const FILTER: &str = "SWY-IPVS-FILTER";
/// filter: while the backend is bypassed, the only chain jumped to (from INPUT): rejects new
/// connections to every IPVS destination (service addresses, external and load-balancer
/// addresses, node ports) before IPVS sees them in LOCAL_IN.
pub const BYPASS: &str = "SWY-IPVS-BYPASS";

/// Sets (name, type and create options), in the order they are created.
pub const SETS: [(&str, &str); 16] = [
    (
        CLUSTER_IP,
        "hash:ip,port family inet hashsize 1024 maxelem 1048576",
    ),
    (
        EXTERNAL_IP,
        "hash:ip,port family inet hashsize 1024 maxelem 1048576",
    ),
    (
        EXTERNAL_IP_LOCAL,
        "hash:ip,port family inet hashsize 1024 maxelem 1048576",
    ),
    (LB, "hash:ip,port family inet hashsize 1024 maxelem 1048576"),
    (LB_LOCAL, "hash:ip,port family inet hashsize 1024 maxelem 1048576"),
    (LB_FW, "hash:ip,port family inet hashsize 1024 maxelem 1048576"),
    (
        LB_SOURCE_CIDR,
        "hash:ip,port,net family inet hashsize 1024 maxelem 1048576",
    ),
    (NODE_PORT_TCP, "bitmap:port range 0-65535"),
    (NODE_PORT_LOCAL_TCP, "bitmap:port range 0-65535"),
    (NODE_PORT_UDP, "bitmap:port range 0-65535"),
    (NODE_PORT_LOCAL_UDP, "bitmap:port range 0-65535"),
    (
        NODE_PORT_SCTP,
        "hash:ip,port family inet hashsize 1024 maxelem 1048576",
    ),
    (
        NODE_PORT_LOCAL_SCTP,
        "hash:ip,port family inet hashsize 1024 maxelem 1048576",
    ),
    (HEALTH_CHECK_NODE_PORT, "bitmap:port range 0-65535"),
    (
        LOOP_BACK,
        "hash:ip,port,ip family inet hashsize 1024 maxelem 1048576",
    ),
    (IPVS_IPS, "hash:ip family inet hashsize 1024 maxelem 1048576"),
];
/// Every ClusterIP,proto:port.
pub const CLUSTER_IP: &str = "SWY-CLUSTER-IP";
/// External IPs of Cluster-policy services.
pub const EXTERNAL_IP: &str = "SWY-EXTERNAL-IP";
/// External IPs of Local-policy services.
pub const EXTERNAL_IP_LOCAL: &str = "SWY-EXTERNAL-IP-LOCAL";
/// Every load-balancer IP,proto:port.
pub const LB: &str = "SWY-LOAD-BALANCER";
/// Load-balancer IPs of Local-policy services.
pub const LB_LOCAL: &str = "SWY-LOAD-BALANCER-LOCAL";
/// Load-balancer IPs with source ranges.
pub const LB_FW: &str = "SWY-LOAD-BALANCER-FW";
/// Allowed `lbIP,proto:port,sourceCIDR`.
pub const LB_SOURCE_CIDR: &str = "SWY-LOAD-BALANCER-SOURCE-CIDR";
/// TCP node ports.
pub const NODE_PORT_TCP: &str = "SWY-NODE-PORT-TCP";
/// TCP node ports of Local-policy services.
pub const NODE_PORT_LOCAL_TCP: &str = "SWY-NODE-PORT-LOCAL-TCP";
/// UDP node ports.
pub const NODE_PORT_UDP: &str = "SWY-NODE-PORT-UDP";
/// UDP node ports of Local-policy services.
pub const NODE_PORT_LOCAL_UDP: &str = "SWY-NODE-PORT-LOCAL-UDP";
/// SCTP node ports (`nodeIP,sctp:port`).
pub const NODE_PORT_SCTP: &str = "SWY-NODE-PORT-SCTP-HASH";
/// SCTP node ports of Local-policy services.
pub const NODE_PORT_LOCAL_SCTP: &str = "SWY-NODE-PORT-LOCAL-SCTP-HASH";
/// Health-check node ports.
pub const HEALTH_CHECK_NODE_PORT: &str = "SWY-HEALTH-CHECK-NODE-PORT";
/// Local endpoints `ip,proto:port,ip` (hairpin).
pub const LOOP_BACK: &str = "SWY-LOOP-BACK";
/// Every address bound on the dummy link.
pub const IPVS_IPS: &str = "SWY-IPVS-IPS";

/// The range Kubernetes allocates node ports from; virtual servers on node addresses in this
/// range are treated as ours.
pub const NODE_PORT_RANGE: std::ops::RangeInclusive<u16> = 30000..=32767;

/// A jump from a built-in chain into one of ours: `(table is nat, built-in chain, our chain)`.
pub const JUMPS: [(bool, &str, &str); 8] = [
    (true, "PREROUTING", SERVICES),
    (true, "OUTPUT", SERVICES),
    (true, "POSTROUTING", POSTROUTING),
    (false, "FORWARD", FORWARD),
    (false, "INPUT", NODE_PORT),
    (false, "INPUT", FIREWALL),
    (false, "FORWARD", FIREWALL),
    (false, "INPUT", FILTER),
];

/// Every chain IPVS mode writes, with its table (nat?): the cleanup asks for these by name, so a
/// table without them is never read whole (see `IpvsBackend::cleanup`).
pub const CHAINS: [(bool, &str); 11] = [
    (true, SERVICES),
    (true, POSTROUTING),
    (true, MARK_MASQ),
    (true, NODE_PORT),
    (true, LOAD_BALANCER),
    (false, NODE_PORT),
    (false, FORWARD),
    (false, FIREWALL),
    (false, SOURCE_RANGES),
    (false, FILTER),
    (false, BYPASS),
];

/// The chains of [`CHAINS`] in one table.
pub fn chains(nat: bool) -> Vec<&'static str> {
    CHAINS
        .iter()
        .filter(|(n, _)| *n == nat)
        .map(|(_, c)| *c)
        .collect()
}

/// The comment of every jump rule (so cleanup finds exactly ours).
pub const JUMP_COMMENT: &str = "switchyard IPVS mode";

/// The jump from filter INPUT into [`BYPASS`], present only while the backend is bypassed
/// (instead of every jump in [`JUMPS`]).
pub const BYPASS_JUMP: (bool, &str, &str) = (false, "INPUT", BYPASS);

/// The comment of the bypass jump.
pub const BYPASS_COMMENT: &str = "switchyard IPVS mode bypassed";

/// A jump rule from a built-in chain into one of ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Jump {
    /// In table nat (else filter).
    pub nat: bool,
    /// The built-in chain.
    pub chain: &'static str,
    /// Our chain.
    pub target: &'static str,
    /// Its comment.
    pub comment: &'static str,
    /// Present while bypassed (the bypass jump) or while not (every other one).
    pub when_bypassed: bool,
}

impl Jump {
    /// The rule as `iptables` arguments after the chain (`-m comment --comment C -j TARGET`).
    pub fn spec(&self) -> Vec<&'static str> {
        vec!["-m", "comment", "--comment", self.comment, "-j", self.target]
    }

    /// The rule as `iptables-save` prints it, with `op` (`-A CHAIN`, `-D CHAIN`, `-I CHAIN 1`)
    /// in front.
    pub fn line(&self, op: &str) -> String {
        format!(
            "{op} -m comment --comment {} -j {}",
            crate::backend::iptables::render::save_string(self.comment),
            self.target
        )
    }
}

/// Every jump rule of IPVS mode: [`JUMPS`] in order, then [`BYPASS_JUMP`].
pub fn all_jumps() -> Vec<Jump> {
    let normal = JUMPS.iter().map(|(nat, chain, target)| Jump {
        nat: *nat,
        chain,
        target,
        comment: JUMP_COMMENT,
        when_bypassed: false,
    });
    let (nat, chain, target) = BYPASS_JUMP;
    normal
        .chain(std::iter::once(Jump {
            nat,
            chain,
            target,
            comment: BYPASS_COMMENT,
            when_bypassed: true,
        }))
        .collect()
}

/// `iptables-restore --noflush` input that removes everything of IPVS mode from one table, given
/// its `iptables-save` output: our `SWY-IPVS-*` chains are declared (flushed), every copy of our
/// jump rules is deleted, then the chains are deleted (`-X`), all in one commit. `None` when
/// the table holds none of our chains. Pure.
pub fn cleanup_input(nat: bool, save: &str) -> Option<String> {
    let ours: BTreeSet<&str> = save
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| c.starts_with(CHAIN_PREFIX))
        .collect();
    if ours.is_empty() {
        return None;
    }
    let table = if nat { "nat" } else { "filter" };
    let mut out = format!("*{table}\n");
    for c in &ours {
        out.push_str(&format!(":{c} - [0:0]\n"));
    }
    for jump in all_jumps().iter().filter(|j| j.nat == nat) {
        let present = jump.line(&format!("-A {}", jump.chain));
        for _ in save.lines().filter(|l| l.trim_end() == present) {
            out.push_str(&jump.line(&format!("-D {}", jump.chain)));
            out.push('\n');
        }
    }
    for c in &ours {
        out.push_str(&format!("-X {c}\n"));
    }
    out.push_str("COMMIT\n");
    Some(out)
}

/// `iptables-restore --noflush` lines that bring the jump rules of one bypass state about, per
/// table: `-I CHAIN 1 ...` for a missing wanted jump (in reverse order, so [`JUMPS`]' order ends
/// up at the top of each built-in chain) and one `-D CHAIN ...` per copy of an unwanted one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JumpEdits {
    /// filter table lines.
    pub filter: Vec<String>,
    /// nat table lines.
    pub nat: Vec<String>,
}

impl JumpEdits {
    /// The edits that move the kernel (as `iptables-save -t filter` / `-t nat` print it) to
    /// `bypassed`. Pure.
    pub fn compute(bypassed: bool, filter_save: &str, nat_save: &str) -> Self {
        let mut edits = Self::default();
        for jump in all_jumps().iter().rev() {
            let (save, out) = if jump.nat {
                (nat_save, &mut edits.nat)
            } else {
                (filter_save, &mut edits.filter)
            };
            let present = jump.line(&format!("-A {}", jump.chain));
            let copies = save.lines().filter(|l| l.trim_end() == present).count();
            if jump.when_bypassed == bypassed {
                if copies == 0 {
                    out.push(jump.line(&format!("-I {} 1", jump.chain)));
                }
            } else {
                for _ in 0..copies {
                    out.push(jump.line(&format!("-D {}", jump.chain)));
                }
            }
        }
        edits
    }

    /// Whether nothing changes.
    pub fn is_empty(&self) -> bool {
        self.filter.is_empty() && self.nat.is_empty()
    }

    /// Number of edited rules.
    pub fn len(&self) -> usize {
        self.filter.len() + self.nat.len()
    }

    /// Restore input with only these edits (no chain declarations: with `--noflush` nothing
    /// else changes). Each table commits atomically on its own, so the order matters:
    /// `closing` (entering the bypass) commits filter first, which starts rejecting new
    /// connections at once, then nat; opening commits nat first (masquerade marks in place),
    /// then filter, which lets new connections through to IPVS last.
    pub fn restore_input(&self, closing: bool) -> String {
        let table = |name: &str, lines: &[String]| {
            if lines.is_empty() {
                return String::new();
            }
            let mut out = format!("*{name}\n");
            for l in lines {
                out.push_str(l);
                out.push('\n');
            }
            out.push_str("COMMIT\n");
            out
        };
        let (filter, nat) = (table("filter", &self.filter), table("nat", &self.nat));
        if closing { filter + &nat } else { nat + &filter }
    }
}

/// One virtual server with its real servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualServer {
    /// Scheduler, flags and persistence timeout.
    pub service: ipvs::Service,
    /// Real servers (address, port), all masqueraded with weight 1.
    pub reals: BTreeSet<(Ipv4Addr, u16)>,
}

/// Rules of one table: chains in declaration order with their rule lines.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chains {
    /// Chain name -> `-A CHAIN ...` lines.
    pub chains: BTreeMap<&'static str, Vec<String>>,
}

impl Chains {
    fn add(&mut self, chain: &'static str, spec: impl AsRef<str>) {
        self.chains
            .entry(chain)
            .or_default()
            .push(format!("-A {chain} {}", spec.as_ref()));
    }

    /// Number of rules.
    pub fn rule_count(&self) -> usize {
        self.chains.values().map(Vec::len).sum()
    }

    /// `*table ... COMMIT`, flushing and rewriting our chains; `delete` adds `-X` for each.
    pub fn write(&self, table: &str, delete: bool, out: &mut String) {
        self.write_with(table, delete, &[], out);
    }

    /// Like [`Chains::write`], with `extra` lines (jump rule edits in built-in chains) before
    /// the `COMMIT`, so they land in the same atomic table commit.
    pub fn write_with(&self, table: &str, delete: bool, extra: &[String], out: &mut String) {
        out.push_str(&format!("*{table}\n"));
        for chain in self.chains.keys() {
            out.push_str(&format!(":{chain} - [0:0]\n"));
        }
        if delete {
            for chain in self.chains.keys() {
                out.push_str(&format!("-X {chain}\n"));
            }
        } else {
            for rule in self.chains.values().flatten() {
                out.push_str(rule);
                out.push('\n');
            }
        }
        for line in extra {
            out.push_str(line);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
}

/// The whole desired state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// Virtual servers by identity.
    pub virtual_servers: BTreeMap<VirtualAddr, VirtualServer>,
    /// Addresses bound (as /32) on [`LINK`].
    pub bind: BTreeSet<Ipv4Addr>,
    /// Every `SWY-*` set with its entries (empty sets included).
    pub sets: BTreeMap<String, SetSpec>,
    /// filter table chains.
    pub filter: Chains,
    /// nat table chains.
    pub nat: Chains,
    /// Service ports rendered.
    pub services: usize,
    /// Real servers in all virtual servers.
    pub endpoints: usize,
}

impl Desired {
    /// `iptables-restore --noflush` input writing our chains.
    pub fn restore_input(&self) -> String {
        self.restore_input_with(&JumpEdits::default())
    }

    /// [`Desired::restore_input`] plus jump rule edits, each in its table's commit.
    pub fn restore_input_with(&self, jumps: &JumpEdits) -> String {
        let mut out = String::new();
        self.filter.write_with("filter", false, &jumps.filter, &mut out);
        self.nat.write_with("nat", false, &jumps.nat, &mut out);
        out
    }

    /// Rules, virtual servers, real servers, addresses and set entries in the desired state.
    pub fn objects(&self) -> usize {
        self.filter.rule_count()
            + self.nat.rule_count()
            + self.virtual_servers.len()
            + self.endpoints
            + self.bind.len()
            + self.sets.values().map(|s| s.entries.len()).sum::<usize>()
    }

    /// The virtual servers as `ipvsadm -Ln` lists them, in canonical order (protocol, address,
    /// port; real servers by address and port), connection counters 0, trailing blanks trimmed.
    pub fn ipvsadm_text(&self) -> String {
        let mut out = String::from(IPVSADM_HEADER);
        for vs in self.virtual_servers.values() {
            out.push_str(&service_line(&vs.service));
            out.push('\n');
            for (ip, port) in &vs.reals {
                out.push_str(&dest_line(&format!("{ip}:{port}"), "Masq", 1));
                out.push('\n');
            }
        }
        out
    }

    /// The whole render as text: IPVS table, bound addresses, ipsets, iptables rules.
    pub fn text(&self) -> String {
        let mut out = String::from("# ipvsadm -Ln\n");
        out.push_str(&self.ipvsadm_text());
        out.push_str(&format!("# ip addr show dev {LINK}\n"));
        for a in &self.bind {
            out.push_str(&format!("{a}/32\n"));
        }
        out.push_str("# ipset save\n");
        for set in self.sets.values() {
            out.push_str(&format!("create {} {}\n", set.name, set.kind));
            for e in &set.entries {
                out.push_str(&format!("add {} {e}\n", set.name));
            }
        }
        out.push_str("# iptables-restore --noflush\n");
        out.push_str(&self.restore_input());
        out
    }
}

/// The three header lines of `ipvsadm -Ln` (6.1 kernel, default table size).
pub const IPVSADM_HEADER: &str = "IP Virtual Server version 1.2.1 (size=4096)\n\
Prot LocalAddress:Port Scheduler Flags\n  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n";

/// A virtual server's line as `ipvsadm -Ln` prints it.
pub(super) fn service_line(svc: &ipvs::Service) -> String {
    let addr = match svc.addr.addr {
        IpAddr::V4(a) => format!("{a}:{}", svc.addr.port),
        IpAddr::V6(a) => format!("[{a}]:{}", svc.addr.port),
    };
    // ipvsadm pads the protocol to four columns: `TCP  10.96.0.1:80`, `SCTP 10.96.0.1:80`.
    let mut line = format!("{:<4} {addr} {}", svc.addr.protocol.k8s_name(), svc.scheduler);
    if svc.flags & FLAG_SCHED2 != 0 && (svc.scheduler == "mh" || svc.scheduler == "sh") {
        line.push_str(&format!(" ({}-port)", svc.scheduler));
    }
    if svc.flags & FLAG_PERSISTENT != 0 {
        line.push_str(&format!(" persistent {}", svc.timeout));
    }
    line
}

/// A real server's line as `ipvsadm -Ln` prints it, with zero connection counters.
pub(super) fn dest_line(addr: &str, fwd: &str, weight: u32) -> String {
    format!("  -> {addr:<28} {fwd:<7} {weight:<6} {:<10} {:<10}", 0, 0)
        .trim_end()
        .to_owned()
}

/// Re-sorts an `ipvsadm -Ln` listing into [`Desired::ipvsadm_text`]'s canonical order with the
/// connection counters zeroed, keeping only services `keep` accepts (by their line, such as
/// `TCP  10.96.0.1:80 rr`). Lines it does not understand are kept in place.
pub fn normalize_ipvsadm(text: &str, keep: impl Fn(&str) -> bool) -> String {
    let mut lines = text.lines();
    let mut out = String::new();
    for _ in 0..3 {
        if let Some(l) = lines.next() {
            out.push_str(l.trim_end());
            out.push('\n');
        }
    }
    type Block = ((u16, IpAddr, u16), String, Vec<((IpAddr, u16), String)>);
    let mut blocks: Vec<Block> = Vec::new();
    for line in lines {
        let line = line.trim_end();
        if let Some(rest) = line.trim_start().strip_prefix("-> ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let key = f.first().and_then(|a| parse_sock(a));
            if let (Some(block), Some(key), Some(fwd), Some(weight)) = (
                blocks.last_mut(),
                key,
                f.get(1),
                f.get(2).and_then(|w| w.parse::<u32>().ok()),
            ) {
                block.2.push((key, dest_line(f[0], fwd, weight)));
            }
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let proto = match f.first() {
            Some(&"TCP") => 6,
            Some(&"UDP") => 17,
            Some(&"SCTP") => 132,
            _ => 0,
        };
        let key = f
            .get(1)
            .and_then(|a| parse_sock(a))
            .unwrap_or((IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
        blocks.push(((proto, key.0, key.1), line.to_owned(), Vec::new()));
    }
    blocks.sort_by_key(|b| b.0);
    for (_, line, mut dests) in blocks {
        if !keep(&line) {
            continue;
        }
        dests.sort_by_key(|d| d.0);
        out.push_str(&line);
        out.push('\n');
        for (_, d) in dests {
            out.push_str(&d);
            out.push('\n');
        }
    }
    out
}

fn parse_sock(s: &str) -> Option<(IpAddr, u16)> {
    let sock: std::net::SocketAddr = s.parse().ok()?;
    Some((sock.ip(), sock.port()))
}

/// Renders `snapshot` for a node whose NodePort virtual servers go on `node_port_ips`.
/// Pure and deterministic.
pub fn render(snapshot: &Snapshot, settings: &Settings, node_port_ips: &[Ipv4Addr]) -> Desired {
    let mut d = Desired {
        services: snapshot.services.len(),
        ..Desired::default()
    };
    for (name, kind) in SETS {
        d.sets.insert(
            name.to_owned(),
            SetSpec {
                name: name.to_owned(),
                kind: kind.to_owned(),
                entries: BTreeSet::new(),
            },
        );
    }
    let no_endpoints: Vec<Endpoint> = Vec::new();
    for (name, sp) in &snapshot.services {
        let eps = snapshot.endpoints.get(name).unwrap_or(&no_endpoints);
        render_service(sp, eps, settings, node_port_ips, &mut d);
    }
    let bound: Vec<String> = d.bind.iter().map(Ipv4Addr::to_string).collect();
    set(&mut d, IPVS_IPS).extend(bound);
    d.endpoints = d.virtual_servers.values().map(|v| v.reals.len()).sum();
    rules(&mut d, settings);
    d
}

/// The address if it is IPv4 (IPVS mode programs IPv4 only).
fn ipv4(ip: &IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(a) => Some(*a),
        IpAddr::V6(_) => None,
    }
}

/// The IPv4 addresses of `ips`.
pub fn ipv4s(ips: &[IpAddr]) -> Vec<Ipv4Addr> {
    ips.iter().filter_map(ipv4).collect()
}

fn set<'a>(d: &'a mut Desired, name: &str) -> &'a mut BTreeSet<String> {
    &mut d
        .sets
        .entry(name.to_owned())
        .or_insert_with(|| SetSpec {
            name: name.to_owned(),
            kind: String::new(),
            entries: BTreeSet::new(),
        })
        .entries
}

/// Renders one service port into `d`: its virtual servers, bound addresses and set entries.
fn render_service(
    sp: &ServicePort,
    eps: &[Endpoint],
    settings: &Settings,
    node_port_ips: &[Ipv4Addr],
    d: &mut Desired,
) {
    // IPVS mode programs IPv4 only (the backend renders the IPv4 snapshot).
    let IpAddr::V4(cluster_ip) = sp.cluster_ip else {
        return;
    };
    let dest = Destinations {
        cluster_ip,
        external_ips: ipv4s(&sp.external_ips),
        load_balancer_ips: ipv4s(&sp.load_balancer_ips),
    };
    add_virtual_servers(sp, eps, settings, &dest, node_port_ips, d);
    add_cluster_ip(sp, cluster_ip, d);
    add_external_ips(sp, settings, &dest.external_ips, d);
    add_load_balancer_ips(sp, settings, &dest.load_balancer_ips, d);
    if let Some(np) = sp.node_port {
        add_node_port(sp, np, node_port_ips, d);
    }
    if let Some(hc) = sp.health_check_node_port {
        set(d, HEALTH_CHECK_NODE_PORT).insert(hc.to_string());
    }
    let p = sp.name.protocol.as_str();
    for ep in &categorize(eps, &settings.node).local {
        set(d, LOOP_BACK).insert(format!("{},{p}:{},{}", ep.ip, ep.port, ep.ip));
    }
}

/// The IPv4 destinations of a service port.
struct Destinations {
    cluster_ip: Ipv4Addr,
    external_ips: Vec<Ipv4Addr>,
    load_balancer_ips: Vec<Ipv4Addr>,
}

/// One virtual server per destination: the ClusterIP with the internal policy's endpoints,
/// external IPs, load-balancer IPs and node addresses + NodePort with the external policy's.
fn add_virtual_servers(
    sp: &ServicePort,
    eps: &[Endpoint],
    settings: &Settings,
    dest: &Destinations,
    node_port_ips: &[Ipv4Addr],
    d: &mut Desired,
) {
    let cat = categorize(eps, &settings.node);
    let to_reals = |list: &[&Endpoint]| -> BTreeSet<(Ipv4Addr, u16)> {
        list.iter().filter_map(|e| Some((ipv4(&e.ip)?, e.port))).collect()
    };
    let policy = |local: bool| to_reals(if local { &cat.local } else { &cat.cluster });
    let internal = policy(sp.internal_policy_local);
    let external = policy(sp.external_policy_local);
    let mut vs = |addr: Ipv4Addr, port: u16, reals: &BTreeSet<(Ipv4Addr, u16)>| {
        let service = ipvs_service(sp, settings, addr, port);
        let reals = reals.clone();
        d.virtual_servers
            .insert(service.addr, VirtualServer { service, reals });
    };
    vs(dest.cluster_ip, sp.port, &internal);
    for ip in &dest.external_ips {
        vs(*ip, sp.port, &external);
    }
    for ip in &dest.load_balancer_ips {
        vs(*ip, sp.port, &external);
    }
    if let Some(np) = sp.node_port {
        for ip in node_port_ips {
            vs(*ip, np, &external);
        }
    }
}

/// The IPVS service of `sp` on `addr:port`: the settings' scheduler (`mh` with its
/// `mh-port` flag), persistent with the timeout for ClientIP affinity.
fn ipvs_service(sp: &ServicePort, settings: &Settings, addr: Ipv4Addr, port: u16) -> ipvs::Service {
    let scheduler = settings.ipvs.scheduler.clone();
    let mut flags = 0;
    if scheduler == "mh" {
        flags |= FLAG_SCHED2;
    }
    let timeout = match sp.affinity_timeout_seconds {
        Some(t) => {
            flags |= FLAG_PERSISTENT;
            t
        }
        None => 0,
    };
    ipvs::Service {
        addr: VirtualAddr {
            protocol: sp.name.protocol,
            addr: IpAddr::V4(addr),
            port,
        },
        scheduler,
        flags,
        timeout,
    }
}

/// The ClusterIP: bound, and in the set of cluster IPs.
fn add_cluster_ip(sp: &ServicePort, cluster_ip: Ipv4Addr, d: &mut Desired) {
    d.bind.insert(cluster_ip);
    let (p, port) = (sp.name.protocol.as_str(), sp.port);
    set(d, CLUSTER_IP).insert(format!("{cluster_ip},{p}:{port}"));
}

/// External IPs: bound unless they are node addresses, and in the external-IP set of their
/// policy.
fn add_external_ips(sp: &ServicePort, settings: &Settings, ips: &[Ipv4Addr], d: &mut Desired) {
    let (p, port) = (sp.name.protocol.as_str(), sp.port);
    let name = if sp.external_policy_local {
        EXTERNAL_IP_LOCAL
    } else {
        EXTERNAL_IP
    };
    for ip in ips {
        if !settings.node.addresses.contains(&IpAddr::V4(*ip)) {
            d.bind.insert(*ip);
        }
        set(d, name).insert(format!("{ip},{p}:{port}"));
    }
}

/// Load-balancer IPs: bound unless they are node addresses, in the load-balancer sets (Local
/// policy, source ranges) and with their allowed source ranges.
fn add_load_balancer_ips(sp: &ServicePort, settings: &Settings, ips: &[Ipv4Addr], d: &mut Desired) {
    let (p, port) = (sp.name.protocol.as_str(), sp.port);
    for ip in ips {
        if !settings.node.addresses.contains(&IpAddr::V4(*ip)) {
            d.bind.insert(*ip);
        }
        let entry = format!("{ip},{p}:{port}");
        set(d, LB).insert(entry.clone());
        if sp.external_policy_local {
            set(d, LB_LOCAL).insert(entry.clone());
        }
        if sp.has_source_ranges() {
            set(d, LB_FW).insert(entry);
            for range in &sp.load_balancer_source_ranges {
                set(d, LB_SOURCE_CIDR).insert(format!("{ip},{p}:{port},{}", range.trunc()));
            }
        }
    }
}

/// The NodePort in the node-port sets: bitmaps of ports for TCP and UDP, `nodeIP,sctp:port`
/// hashes for SCTP; the `-LOCAL` ones too with a Local policy.
fn add_node_port(sp: &ServicePort, np: u16, node_port_ips: &[Ipv4Addr], d: &mut Desired) {
    let local = sp.external_policy_local;
    let proto = sp.name.protocol;
    match proto {
        Protocol::Tcp | Protocol::Udp => {
            let (all, loc) = if proto == Protocol::Tcp {
                (NODE_PORT_TCP, NODE_PORT_LOCAL_TCP)
            } else {
                (NODE_PORT_UDP, NODE_PORT_LOCAL_UDP)
            };
            set(d, all).insert(np.to_string());
            if local {
                set(d, loc).insert(np.to_string());
            }
        }
        Protocol::Sctp => {
            for ip in node_port_ips {
                set(d, NODE_PORT_SCTP).insert(format!("{ip},sctp:{np}"));
                if local {
                    set(d, NODE_PORT_LOCAL_SCTP).insert(format!("{ip},sctp:{np}"));
                }
            }
        }
    }
}

/// The fixed iptables rules; they only reference sets, so they do not depend on the services.
fn rules(d: &mut Desired, settings: &Settings) {
    let mark = settings.masquerade_mark;
    services_rules(&mut d.nat, settings);
    masquerade_rules(&mut d.nat, mark);
    for rule in forward_rules(mark) {
        d.filter.add(FORWARD, rule);
    }
    filter_rules(&mut d.filter);
    bypass_rules(&mut d.filter, settings);
}

/// nat `SWY-IPVS-SERVICES`: masquerade marks for cluster and external IPs, load balancers and
/// node ports to their chains, and accept the rest of the service traffic for IPVS.
fn services_rules(nat: &mut Chains, settings: &Settings) {
    nat.add(SERVICES, "-s 127.0.0.0/8 -j RETURN");
    let cluster_masq = format!(
        "{} -m set --match-set {CLUSTER_IP} dst,dst -j {MARK_MASQ}",
        comment("switchyard cluster IP + port for masquerade purpose")
    );
    if settings.masquerade_all {
        nat.add(SERVICES, cluster_masq);
    } else if let Some(cidr) = settings.cluster_cidr(IpFamily::V4) {
        nat.add(SERVICES, format!("! -s {} {cluster_masq}", cidr.trunc()));
    }
    nat.add(
        SERVICES,
        format!(
            "{} -m set --match-set {EXTERNAL_IP} dst,dst -j {MARK_MASQ}",
            comment("switchyard external IP + port for masquerade purpose")
        ),
    );
    nat.add(
        SERVICES,
        format!(
            "{} -m set --match-set {LB} dst,dst -j {LOAD_BALANCER}",
            comment("switchyard load balancer IP + port")
        ),
    );
    match settings.node_port_addresses(IpFamily::V4) {
        None => nat.add(SERVICES, format!("-m addrtype --dst-type LOCAL -j {NODE_PORT}")),
        Some(addresses) => {
            for ip in addresses {
                nat.add(SERVICES, format!("-d {ip}/32 -j {NODE_PORT}"));
            }
        }
    }
    nat.add(
        SERVICES,
        format!("-m set --match-set {CLUSTER_IP} dst,dst -j ACCEPT"),
    );
    nat.add(SERVICES, format!("-m set --match-set {LB} dst,dst -j ACCEPT"));
}

/// nat: load balancers and node ports are marked for masquerade unless their policy is
/// Local; the mark itself; the hairpin and marked-traffic masquerade in postrouting.
fn masquerade_rules(nat: &mut Chains, mark: u32) {
    nat.add(
        LOAD_BALANCER,
        format!("-m set --match-set {LB_LOCAL} dst,dst -j RETURN"),
    );
    nat.add(LOAD_BALANCER, format!("-j {MARK_MASQ}"));
    for (p, all, local) in [
        ("tcp", NODE_PORT_TCP, NODE_PORT_LOCAL_TCP),
        ("udp", NODE_PORT_UDP, NODE_PORT_LOCAL_UDP),
    ] {
        nat.add(
            NODE_PORT,
            format!("-p {p} -m set --match-set {local} dst -j RETURN"),
        );
        nat.add(
            NODE_PORT,
            format!("-p {p} -m set --match-set {all} dst -j {MARK_MASQ}"),
        );
    }
    nat.add(
        NODE_PORT,
        format!("-p sctp -m set --match-set {NODE_PORT_LOCAL_SCTP} dst,dst -j RETURN"),
    );
    nat.add(
        NODE_PORT,
        format!("-p sctp -m set --match-set {NODE_PORT_SCTP} dst,dst -j {MARK_MASQ}"),
    );
    nat.add(MARK_MASQ, format!("-j MARK --set-xmark {mark:#x}/{mark:#x}"));
    nat.add(
        POSTROUTING,
        format!(
            "{} -m set --match-set {LOOP_BACK} dst,dst,src -j MASQUERADE",
            comment("switchyard endpoint hairpin")
        ),
    );
    for rule in postrouting_rules(mark) {
        nat.add(POSTROUTING, rule);
    }
}

/// filter: health-check node ports accepted, load-balancer source ranges, and new
/// connections to service addresses on non-service ports rejected.
fn filter_rules(filter: &mut Chains) {
    filter.add(
        NODE_PORT,
        format!(
            "{} -m set --match-set {HEALTH_CHECK_NODE_PORT} dst -j ACCEPT",
            comment("switchyard health check node port")
        ),
    );
    filter.add(
        FIREWALL,
        format!("-m set --match-set {LB_FW} dst,dst -j {SOURCE_RANGES}"),
    );
    filter.add(
        SOURCE_RANGES,
        format!("-m set --match-set {LB_SOURCE_CIDR} dst,dst,src -j RETURN"),
    );
    filter.add(
        SOURCE_RANGES,
        format!("{} -j DROP", comment("switchyard load balancer source ranges")),
    );
    for name in [CLUSTER_IP, EXTERNAL_IP, EXTERNAL_IP_LOCAL, LB] {
        filter.add(FILTER, format!("-m set --match-set {name} dst,dst -j RETURN"));
    }
    filter.add(
        FILTER,
        format!("-m set --match-set {HEALTH_CHECK_NODE_PORT} dst -j RETURN"),
    );
    filter.add(
        FILTER,
        format!(
            "{} -m conntrack --ctstate NEW -m set --match-set {IPVS_IPS} dst -j REJECT --reject-with icmp-port-unreachable",
            comment("switchyard service addresses on non-service ports")
        ),
    );
}

/// filter [`BYPASS`]: rejects new connections to every IPVS destination.
fn bypass_rules(filter: &mut Chains, settings: &Settings) {
    // The bypass: only new connections are refused, so connections IPVS already serves keep
    // reaching it (their addresses stay bound) until the backend is cleaned up.
    let reject = format!(
        "{} -j REJECT --reject-with icmp-port-unreachable",
        comment("switchyard IPVS mode bypassed")
    );
    let new = "-m conntrack --ctstate NEW";
    filter.add(
        BYPASS,
        format!("{new} -m set --match-set {IPVS_IPS} dst {reject}"),
    );
    for name in [EXTERNAL_IP, EXTERNAL_IP_LOCAL, LB] {
        filter.add(
            BYPASS,
            format!("{new} -m set --match-set {name} dst,dst {reject}"),
        );
    }
    let node_dsts: Vec<String> = match settings.node_port_addresses(IpFamily::V4) {
        None => vec!["-m addrtype --dst-type LOCAL".to_owned()],
        Some(addresses) => addresses.iter().map(|ip| format!("-d {ip}/32")).collect(),
    };
    for dst in &node_dsts {
        for (p, set, dir) in [
            ("tcp", NODE_PORT_TCP, "dst"),
            ("udp", NODE_PORT_UDP, "dst"),
            ("sctp", NODE_PORT_SCTP, "dst,dst"),
        ] {
            filter.add(
                BYPASS,
                format!("{dst} -p {p} {new} -m set --match-set {set} {dir} {reject}"),
            );
        }
    }
}
