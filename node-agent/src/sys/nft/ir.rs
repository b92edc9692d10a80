//! The nftables ruleset as data: sets, maps, chains and rules built from a small closed set of
//! expressions. Each expression knows its `nft` text (for `--render`, loadable with `nft -f`) and
//! its netlink bytecode ([`super::codec`]), the same bytecode `nft` itself generates, so that
//! `nft list table ip switchyard` (and `ip6 switchyard`) decompiles every rule we write. One
//! ruleset is one family's table; expressions take their `ip`/`ip6` spelling and address layout
//! from the family they are rendered for.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv6Addr},
    sync::Arc,
};

use crate::model::{IpFamily, IpNet, Protocol};

/// Name of our tables (families `ip` and `ip6`).
pub const TABLE: &str = "switchyard";

/// nft's name of a table family (`ip`, `ip6`), also the prefix of address matches.
pub fn family_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// An address as nft prints it inside `dnat to`: IPv6 in brackets.
fn addr_port(addr: &IpAddr, port: u16) -> String {
    match addr {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// The loopback network NodePorts are not served on (`127.0.0.0/8`, `::1`).
pub fn loopback(family: IpFamily) -> IpNet {
    match family {
        IpFamily::V4 => {
            IpNet::V4(ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(127, 0, 0, 0), 8).unwrap_or_default())
        }
        IpFamily::V6 => IpNet::V6(ipnet::Ipv6Net::new(Ipv6Addr::LOCALHOST, 128).unwrap_or_default()),
    }
}

/// A network as nft prints it: a host prefix prints as the bare address.
fn net_text(net: &IpNet) -> String {
    if net.prefix_len() == net.max_prefix_len() {
        net.addr().to_string()
    } else {
        net.to_string()
    }
}

/// A verdict.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    /// `drop`.
    Drop,
    /// `return`.
    Return,
    /// `jump CHAIN`.
    Jump(String),
    /// `goto CHAIN`.
    Goto(String),
}

impl Verdict {
    /// nft syntax.
    pub fn text(&self) -> String {
        match self {
            Verdict::Drop => "drop".into(),
            Verdict::Return => "return".into(),
            Verdict::Jump(c) => format!("jump {c}"),
            Verdict::Goto(c) => format!("goto {c}"),
        }
    }
}

/// One expression or statement of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    /// `ct state new`.
    CtStateNew,
    /// `ct status dnat`.
    CtStatusDnat,
    /// `ip daddr ADDR`.
    DaddrIs(IpAddr),
    /// `ip saddr ADDR`.
    SaddrIs(IpAddr),
    /// `ip saddr [!=] NET`.
    SaddrIn(IpNet, bool),
    /// `ip daddr != 127.0.0.0/8` style (negated when `true`).
    DaddrIn(IpNet, bool),
    /// `ip daddr @SET`.
    DaddrInSet(String),
    /// `ip saddr @SET`.
    SaddrInSet(String),
    /// `ip saddr . ip daddr @SET`.
    SaddrDaddrInSet(String),
    /// `ip daddr . meta l4proto . th dport @SET`.
    DaddrProtoPortInSet(String),
    /// `meta l4proto . th dport @SET`.
    ProtoPortInSet(String),
    /// `fib saddr type local`.
    FibSaddrLocal,
    /// `fib daddr type local`.
    FibDaddrLocal,
    /// `numgen random mod N 0`: true with probability 1/N.
    NumgenZero(u32),
    /// `meta l4proto PROTO`.
    L4Proto(Protocol),
    /// `meta mark & MARK != 0`.
    MarkSet(u32),
    /// `meta mark set meta mark | MARK`.
    SetMarkOr(u32),
    /// `meta mark set meta mark ^ MARK`.
    SetMarkXor(u32),
    /// `dnat to ADDR:PORT` (after an `L4Proto` match).
    Dnat(IpAddr, u16),
    /// `dnat ip to ip daddr . meta l4proto . th dport . numgen random mod N map @MAP`: endpoint
    /// slot `numgen` of the destination, from a map of destinations with N endpoints.
    DnatDaddrProtoPortSlot(u32, String),
    /// `dnat ip to meta l4proto . th dport . numgen random mod N map @MAP` (NodePorts).
    DnatProtoPortSlot(u32, String),
    /// `masquerade fully-random`.
    Masquerade,
    /// `reject` (ICMP port unreachable).
    Reject,
    /// `reject with tcp reset` (after an `L4Proto(Tcp)` match).
    RejectTcpReset,
    /// `reject with icmp prot-unreachable` (IPv4, after an `L4Proto(Sctp)` match).
    RejectProtocolUnreachable,
    /// `update @SET { ip saddr }`.
    UpdateSaddr(String),
    /// `ip daddr . meta l4proto . th dport vmap @MAP`.
    VmapDaddrProtoPort(String),
    /// `meta l4proto . th dport vmap @MAP`.
    VmapProtoPort(String),
    /// A verdict.
    Verdict(Verdict),
}

fn mark_text(mark: u32) -> String {
    format!("0x{mark:08x}")
}

impl Expr {
    /// nft syntax in a table of `family`.
    pub fn text(&self, family: IpFamily) -> String {
        let ip = family_name(family);
        let not = |neg: &bool| if *neg { "!= " } else { "" };
        match self {
            Expr::CtStateNew => "ct state new".into(),
            Expr::CtStatusDnat => "ct status dnat".into(),
            Expr::DaddrIs(a) => format!("{ip} daddr {a}"),
            Expr::SaddrIs(a) => format!("{ip} saddr {a}"),
            Expr::SaddrIn(n, neg) => format!("{ip} saddr {}{}", not(neg), net_text(n)),
            Expr::DaddrIn(n, neg) => format!("{ip} daddr {}{}", not(neg), net_text(n)),
            Expr::DaddrInSet(s) => format!("{ip} daddr @{s}"),
            Expr::SaddrInSet(s) => format!("{ip} saddr @{s}"),
            Expr::SaddrDaddrInSet(s) => format!("{ip} saddr . {ip} daddr @{s}"),
            Expr::DaddrProtoPortInSet(s) => format!("{ip} daddr . meta l4proto . th dport @{s}"),
            Expr::ProtoPortInSet(s) => format!("meta l4proto . th dport @{s}"),
            Expr::FibSaddrLocal => "fib saddr type local".into(),
            Expr::FibDaddrLocal => "fib daddr type local".into(),
            Expr::NumgenZero(m) => format!("numgen random mod {m} 0"),
            Expr::L4Proto(p) => format!("meta l4proto {}", p.as_str()),
            Expr::MarkSet(m) => format!("meta mark & {} != 0x00000000", mark_text(*m)),
            Expr::SetMarkOr(m) => format!("meta mark set meta mark | {}", mark_text(*m)),
            Expr::SetMarkXor(m) => format!("meta mark set meta mark ^ {}", mark_text(*m)),
            Expr::Dnat(a, p) => format!("dnat to {}", addr_port(a, *p)),
            Expr::DnatDaddrProtoPortSlot(n, m) => {
                format!("dnat {ip} to {ip} daddr . meta l4proto . th dport . numgen random mod {n} map @{m}")
            }
            Expr::DnatProtoPortSlot(n, m) => {
                format!("dnat {ip} to meta l4proto . th dport . numgen random mod {n} map @{m}")
            }
            Expr::Masquerade => "masquerade fully-random".into(),
            Expr::Reject => "reject".into(),
            Expr::RejectTcpReset => "reject with tcp reset".into(),
            Expr::RejectProtocolUnreachable => "reject with icmp prot-unreachable".into(),
            Expr::UpdateSaddr(s) => format!("update @{s} {{ {ip} saddr }}"),
            Expr::VmapDaddrProtoPort(m) => format!("{ip} daddr . meta l4proto . th dport vmap @{m}"),
            Expr::VmapProtoPort(m) => format!("meta l4proto . th dport vmap @{m}"),
            Expr::Verdict(v) => v.text(),
        }
    }
}

/// A rule: expressions in order, and an optional comment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Expressions and statements.
    pub exprs: Vec<Expr>,
    /// Comment shown by `nft list`.
    pub comment: Option<String>,
}

impl Rule {
    /// A rule without comment.
    pub fn new(exprs: Vec<Expr>) -> Self {
        Self { exprs, comment: None }
    }

    /// The same rule with a comment.
    pub fn comment(mut self, text: impl Into<String>) -> Self {
        self.comment = Some(text.into());
        self
    }

    /// nft syntax in a table of `family`.
    pub fn text(&self, family: IpFamily) -> String {
        let mut s = self
            .exprs
            .iter()
            .map(|e| e.text(family))
            .collect::<Vec<_>>()
            .join(" ");
        if let Some(c) = &self.comment {
            let _ = write!(s, " comment \"{c}\"");
        }
        s
    }
}

/// Netfilter hook of a base chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// prerouting.
    Prerouting,
    /// input.
    Input,
    /// forward.
    Forward,
    /// output.
    Output,
    /// postrouting.
    Postrouting,
}

impl Hook {
    /// Kernel hook number.
    pub fn number(self) -> u32 {
        match self {
            Hook::Prerouting => 0,
            Hook::Input => 1,
            Hook::Forward => 2,
            Hook::Output => 3,
            Hook::Postrouting => 4,
        }
    }
    /// nft's name of the hook.
    pub fn text(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

/// Base-chain attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseChain {
    /// `nat` or `filter`.
    pub nat: bool,
    /// Hook.
    pub hook: Hook,
    /// Priority.
    pub priority: i32,
}

/// A chain and its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Name.
    pub name: String,
    /// Set for base chains.
    pub base: Option<BaseChain>,
    /// Rules in order.
    pub rules: Vec<Rule>,
}

/// Key type of a set or map; addresses are of the table's family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    /// `ipv4_addr` / `ipv6_addr`.
    Addr,
    /// `inet_proto . inet_service`.
    ProtoPort,
    /// `ipv4_addr . inet_proto . inet_service` (or `ipv6_addr . …`).
    AddrProtoPort,
    /// `ipv4_addr . ipv4_addr` (or `ipv6_addr . ipv6_addr`).
    AddrAddr,
    /// An endpoint map of destinations with N endpoints:
    /// `typeof ip daddr . meta l4proto . th dport . numgen random mod N : ip daddr . th dport`.
    AddrProtoPortSlot(u32),
    /// The same for NodePorts: `typeof meta l4proto . th dport . numgen random mod N : ip daddr . th dport`.
    ProtoPortSlot(u32),
}

impl KeyType {
    /// The `type …` or `typeof …` line of a set or map definition in a table of `family`.
    pub fn declaration(self, family: IpFamily, verdict_map: bool) -> String {
        let verdict = if verdict_map { " : verdict" } else { "" };
        let (addr, ip) = match family {
            IpFamily::V4 => ("ipv4_addr", "ip"),
            IpFamily::V6 => ("ipv6_addr", "ip6"),
        };
        match self {
            KeyType::Addr => format!("type {addr}{verdict}"),
            KeyType::ProtoPort => format!("type inet_proto . inet_service{verdict}"),
            KeyType::AddrProtoPort => format!("type {addr} . inet_proto . inet_service{verdict}"),
            KeyType::AddrAddr => format!("type {addr} . {addr}{verdict}"),
            KeyType::AddrProtoPortSlot(n) => {
                format!(
                    "typeof {ip} daddr . meta l4proto . th dport . numgen random mod {n} : {ip} daddr . th dport"
                )
            }
            KeyType::ProtoPortSlot(n) => {
                format!("typeof meta l4proto . th dport . numgen random mod {n} : {ip} daddr . th dport")
            }
        }
    }

    /// Whether the set maps keys to DNAT targets.
    pub fn is_endpoint_map(self) -> bool {
        matches!(self, KeyType::AddrProtoPortSlot(_) | KeyType::ProtoPortSlot(_))
    }
}

/// Endpoint slot `index` of a destination with `count` endpoints: the `numgen random mod count`
/// value that selects it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slot {
    /// Slot number, `0..count`.
    pub index: u32,
    /// Endpoints of the destination (the numgen modulus, and the map it lives in).
    pub count: u32,
}

/// An element key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key {
    /// One address.
    Addr(IpAddr),
    /// Protocol and port.
    ProtoPort(Protocol, u16),
    /// Address, protocol and port.
    AddrProtoPort(IpAddr, Protocol, u16),
    /// Two addresses.
    AddrAddr(IpAddr, IpAddr),
    /// Address, protocol, port and endpoint slot.
    AddrProtoPortSlot(IpAddr, Protocol, u16, Slot),
    /// Protocol, port and endpoint slot (NodePorts).
    ProtoPortSlot(Protocol, u16, Slot),
}

impl Key {
    /// nft syntax.
    pub fn text(&self) -> String {
        match self {
            Key::Addr(a) => a.to_string(),
            Key::ProtoPort(p, n) => format!("{} . {n}", p.as_str()),
            Key::AddrProtoPort(a, p, n) => format!("{a} . {} . {n}", p.as_str()),
            Key::AddrAddr(a, b) => format!("{a} . {b}"),
            Key::AddrProtoPortSlot(a, p, n, s) => format!("{a} . {} . {n} . {}", p.as_str(), s.index),
            Key::ProtoPortSlot(p, n, s) => format!("{} . {n} . {}", p.as_str(), s.index),
        }
    }

    /// The endpoint slot of keys of endpoint maps.
    pub fn slot(&self) -> Option<Slot> {
        match self {
            Key::AddrProtoPortSlot(.., s) | Key::ProtoPortSlot(.., s) => Some(*s),
            _ => None,
        }
    }
}

/// A set or verdict map definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetDef {
    /// Name.
    pub name: String,
    /// Key type.
    pub key: KeyType,
    /// A verdict map (`: verdict`).
    pub verdict_map: bool,
    /// Dynamic set with this element timeout (ClientIP affinity).
    pub timeout_seconds: Option<u32>,
    /// Comment.
    pub comment: Option<String>,
}

/// One element of a set or map.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Element {
    /// Key.
    pub key: Key,
    /// Value, for verdict maps.
    pub verdict: Option<Verdict>,
    /// Value, for endpoint maps: the DNAT target.
    pub dnat: Option<(IpAddr, u16)>,
    /// Comment (`ns/svc:port`), shared by the elements of one service port: a copy per element
    /// would be an allocation per endpoint, several times over (fragments, the element index).
    pub comment: Option<Arc<str>>,
}

impl SetDef {
    /// nft syntax of the definition in a table of `family`.
    pub fn text(&self, family: IpFamily) -> String {
        let kind = if self.verdict_map || self.key.is_endpoint_map() {
            "map"
        } else {
            "set"
        };
        let mut s = format!(
            "\t{kind} {} {{\n\t\t{}\n",
            self.name,
            self.key.declaration(family, self.verdict_map)
        );
        if let Some(t) = self.timeout_seconds {
            let _ = write!(s, "\t\tflags dynamic,timeout\n\t\ttimeout {t}s\n");
        }
        if let Some(c) = &self.comment {
            let _ = writeln!(s, "\t\tcomment \"{c}\"");
        }
        s.push_str("\t}\n");
        s
    }
}

impl Element {
    /// nft syntax (`KEY [comment "C"] [: VERDICT | : ADDR . PORT]`).
    pub fn text(&self) -> String {
        let mut s = self.key.text();
        if let Some(c) = &self.comment {
            let _ = write!(s, " comment \"{c}\"");
        }
        if let Some(v) = &self.verdict {
            let _ = write!(s, " : {}", v.text());
        }
        if let Some((a, p)) = &self.dnat {
            let _ = write!(s, " : {a} . {p}");
        }
        s
    }
}

/// The whole desired table of one family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ruleset {
    /// The table's family.
    pub family: IpFamily,
    /// Sets and maps, in creation order.
    pub sets: Vec<SetDef>,
    /// Elements per set name.
    pub elements: std::collections::BTreeMap<String, Vec<Element>>,
    /// Chains in creation order.
    pub chains: Vec<Chain>,
}

impl Ruleset {
    /// Number of rules plus elements: the size of the ruleset.
    pub fn object_count(&self) -> usize {
        self.chains.iter().map(|c| c.rules.len()).sum::<usize>()
            + self.elements.values().map(Vec::len).sum::<usize>()
    }

    /// A complete `nft -f` script that (re)creates the table, for `--render` and as a test oracle.
    pub fn text(&self) -> String {
        let family = family_name(self.family);
        let mut s = format!("table {family} {TABLE} {{\n\tcomment \"rules for switchyard\"\n");
        for set in &self.sets {
            s.push_str(&set.text(self.family));
        }
        for chain in &self.chains {
            let _ = writeln!(s, "\tchain {} {{", chain.name);
            if let Some(b) = chain.base {
                let _ = writeln!(
                    s,
                    "\t\ttype {} hook {} priority {}; policy accept;",
                    if b.nat { "nat" } else { "filter" },
                    b.hook.text(),
                    b.priority
                );
            }
            for rule in &chain.rules {
                let _ = writeln!(s, "\t\t{}", rule.text(self.family));
            }
            s.push_str("\t}\n");
        }
        s.push_str("}\n");
        for (set, elements) in &self.elements {
            if !elements.is_empty() {
                let list = elements.iter().map(Element::text).collect::<Vec<_>>().join(", ");
                let _ = writeln!(s, "add element {family} {TABLE} {set} {{ {list} }}");
            }
        }
        s
    }
}
