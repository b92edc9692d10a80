//! The nftables ruleset as data: sets, maps, chains and rules built from a small closed set of
//! expressions. Each expression knows its `nft` text (for `--render`, loadable with `nft -f`) and
//! its netlink bytecode ([`super::encode`]), the same bytecode `nft` itself generates, so that
//! `nft list table ip switchyard` decompiles every rule we write.

use std::{fmt::Write as _, net::Ipv4Addr};

use crate::model::{Ipv4Net, Protocol};

/// Name of our table (family `ip`).
pub const TABLE: &str = "switchyard";

/// A verdict.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
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
    fn text(&self) -> String {
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
    DaddrIs(Ipv4Addr),
    /// `ip saddr ADDR`.
    SaddrIs(Ipv4Addr),
    /// `ip saddr [!=] NET`.
    SaddrIn(Ipv4Net, bool),
    /// `ip daddr != 127.0.0.0/8` style (negated when `true`).
    DaddrIn(Ipv4Net, bool),
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
    /// `meta mark & MARK == 0`.
    MarkUnset(u32),
    /// `meta mark set meta mark | MARK`.
    SetMarkOr(u32),
    /// `meta mark set meta mark ^ MARK`.
    SetMarkXor(u32),
    /// `dnat to ADDR:PORT` (after an `L4Proto` match).
    Dnat(Ipv4Addr, u16),
    /// `dnat ip to ip daddr . meta l4proto . th dport . numgen random mod N map @MAP`: endpoint
    /// slot `numgen` of the destination, from a map of destinations with N endpoints.
    DnatDaddrProtoPortSlot(u32, String),
    /// `dnat ip to meta l4proto . th dport . numgen random mod N map @MAP` (NodePorts).
    DnatProtoPortSlot(u32, String),
    /// `masquerade fully-random`.
    Masquerade,
    /// `reject` (ICMP port unreachable).
    Reject,
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
    /// nft syntax.
    pub fn text(&self) -> String {
        match self {
            Expr::CtStateNew => "ct state new".into(),
            Expr::CtStatusDnat => "ct status dnat".into(),
            Expr::DaddrIs(a) => format!("ip daddr {a}"),
            Expr::SaddrIs(a) => format!("ip saddr {a}"),
            Expr::SaddrIn(n, neg) => format!("ip saddr {}{n}", if *neg { "!= " } else { "" }),
            Expr::DaddrIn(n, neg) => format!("ip daddr {}{n}", if *neg { "!= " } else { "" }),
            Expr::DaddrInSet(s) => format!("ip daddr @{s}"),
            Expr::SaddrInSet(s) => format!("ip saddr @{s}"),
            Expr::SaddrDaddrInSet(s) => format!("ip saddr . ip daddr @{s}"),
            Expr::DaddrProtoPortInSet(s) => format!("ip daddr . meta l4proto . th dport @{s}"),
            Expr::ProtoPortInSet(s) => format!("meta l4proto . th dport @{s}"),
            Expr::FibSaddrLocal => "fib saddr type local".into(),
            Expr::FibDaddrLocal => "fib daddr type local".into(),
            Expr::NumgenZero(m) => format!("numgen random mod {m} 0"),
            Expr::L4Proto(p) => format!("meta l4proto {}", p.as_str()),
            Expr::MarkUnset(m) => format!("meta mark & {} == 0x00000000", mark_text(*m)),
            Expr::SetMarkOr(m) => format!("meta mark set meta mark | {}", mark_text(*m)),
            Expr::SetMarkXor(m) => format!("meta mark set meta mark ^ {}", mark_text(*m)),
            Expr::Dnat(a, p) => format!("dnat to {a}:{p}"),
            Expr::DnatDaddrProtoPortSlot(n, m) => {
                format!("dnat ip to ip daddr . meta l4proto . th dport . numgen random mod {n} map @{m}")
            }
            Expr::DnatProtoPortSlot(n, m) => format!("dnat ip to meta l4proto . th dport . numgen random mod {n} map @{m}"),
            Expr::Masquerade => "masquerade fully-random".into(),
            Expr::Reject => "reject".into(),
            Expr::UpdateSaddr(s) => format!("update @{s} {{ ip saddr }}"),
            Expr::VmapDaddrProtoPort(m) => format!("ip daddr . meta l4proto . th dport vmap @{m}"),
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

    /// nft syntax.
    pub fn text(&self) -> String {
        let mut s = self.exprs.iter().map(Expr::text).collect::<Vec<_>>().join(" ");
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
    fn text(self) -> &'static str {
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

/// Key type of a set or map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    /// `ipv4_addr`.
    Ipv4,
    /// `inet_proto . inet_service`.
    ProtoPort,
    /// `ipv4_addr . inet_proto . inet_service`.
    Ipv4ProtoPort,
    /// `ipv4_addr . ipv4_addr`.
    Ipv4Ipv4,
    /// An endpoint map of destinations with N endpoints:
    /// `typeof ip daddr . meta l4proto . th dport . numgen random mod N : ip daddr . th dport`.
    Ipv4ProtoPortSlot(u32),
    /// The same for NodePorts: `typeof meta l4proto . th dport . numgen random mod N : ip daddr . th dport`.
    ProtoPortSlot(u32),
}

impl KeyType {
    /// The `type …` or `typeof …` line of a set or map definition.
    fn declaration(self, verdict_map: bool) -> String {
        let verdict = if verdict_map { " : verdict" } else { "" };
        match self {
            KeyType::Ipv4 => format!("type ipv4_addr{verdict}"),
            KeyType::ProtoPort => format!("type inet_proto . inet_service{verdict}"),
            KeyType::Ipv4ProtoPort => format!("type ipv4_addr . inet_proto . inet_service{verdict}"),
            KeyType::Ipv4Ipv4 => format!("type ipv4_addr . ipv4_addr{verdict}"),
            KeyType::Ipv4ProtoPortSlot(n) => {
                format!("typeof ip daddr . meta l4proto . th dport . numgen random mod {n} : ip daddr . th dport")
            }
            KeyType::ProtoPortSlot(n) => format!("typeof meta l4proto . th dport . numgen random mod {n} : ip daddr . th dport"),
        }
    }

    /// Whether the set maps keys to DNAT targets.
    pub fn is_endpoint_map(self) -> bool {
        matches!(self, KeyType::Ipv4ProtoPortSlot(_) | KeyType::ProtoPortSlot(_))
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
    Ipv4(Ipv4Addr),
    /// Protocol and port.
    ProtoPort(Protocol, u16),
    /// Address, protocol and port.
    Ipv4ProtoPort(Ipv4Addr, Protocol, u16),
    /// Two addresses.
    Ipv4Ipv4(Ipv4Addr, Ipv4Addr),
    /// Address, protocol, port and endpoint slot.
    Ipv4ProtoPortSlot(Ipv4Addr, Protocol, u16, Slot),
    /// Protocol, port and endpoint slot (NodePorts).
    ProtoPortSlot(Protocol, u16, Slot),
}

impl Key {
    fn text(&self) -> String {
        match self {
            Key::Ipv4(a) => a.to_string(),
            Key::ProtoPort(p, n) => format!("{} . {n}", p.as_str()),
            Key::Ipv4ProtoPort(a, p, n) => format!("{a} . {} . {n}", p.as_str()),
            Key::Ipv4Ipv4(a, b) => format!("{a} . {b}"),
            Key::Ipv4ProtoPortSlot(a, p, n, s) => format!("{a} . {} . {n} . {}", p.as_str(), s.index),
            Key::ProtoPortSlot(p, n, s) => format!("{} . {n} . {}", p.as_str(), s.index),
        }
    }

    /// The endpoint slot of keys of endpoint maps.
    pub fn slot(&self) -> Option<Slot> {
        match self {
            Key::Ipv4ProtoPortSlot(.., s) | Key::ProtoPortSlot(.., s) => Some(*s),
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
    pub dnat: Option<(Ipv4Addr, u16)>,
    /// Comment (`ns/svc:port`).
    pub comment: Option<String>,
}

impl SetDef {
    /// nft syntax of the definition.
    pub fn text(&self) -> String {
        let kind = if self.verdict_map || self.key.is_endpoint_map() { "map" } else { "set" };
        let mut s = format!("\t{kind} {} {{\n\t\t{}\n", self.name, self.key.declaration(self.verdict_map));
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

/// The whole desired table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ruleset {
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
        self.chains.iter().map(|c| c.rules.len()).sum::<usize>() + self.elements.values().map(Vec::len).sum::<usize>()
    }

    /// A complete `nft -f` script that (re)creates the table, for `--render` and as a test oracle.
    pub fn text(&self) -> String {
        let mut s = format!("table ip {TABLE} {{\n\tcomment \"rules for switchyard\"\n");
        for set in &self.sets {
            s.push_str(&set.text());
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
                let _ = writeln!(s, "\t\t{}", rule.text());
            }
            s.push_str("\t}\n");
        }
        s.push_str("}\n");
        for (set, elements) in &self.elements {
            if !elements.is_empty() {
                let list = elements.iter().map(Element::text).collect::<Vec<_>>().join(", ");
                let _ = writeln!(s, "add element ip {TABLE} {set} {{ {list} }}");
            }
        }
        s
    }
}
