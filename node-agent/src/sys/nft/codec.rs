//! Pure netlink encoding of the nftables IR: the bytes of `NEWTABLE`, `NEWCHAIN`, `NEWRULE`,
//! `NEWSET`, `NEWSETELEM` and friends, matching what `nft` itself sends (checked with
//! `nft --debug=netlink,mnl`), so the kernel state we create lists back as the same rules.
//!
//! A [`Batch`] is one transaction: it holds both its netlink bytes (for the kernel) and its
//! operations as data ([`Op`], for the fake adapter), built by the same calls.

use std::net::IpAddr;

use super::ir::{BaseChain, Element, Expr, Key, KeyType, Rule, SetDef, TABLE, Verdict};
use crate::{
    model::{IpFamily, IpNet},
    sys::netlink::{MessageBuilder, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST},
};

const NFNL_SUBSYS_NFTABLES: u16 = 10;

const NLA_F_NESTED: u16 = 0x8000;
/// `NLM_F_DUMP`.
pub const NLM_F_DUMP: u16 = 0x300;

/// nf_tables message types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Msg {
    /// NFT_MSG_NEWTABLE.
    NewTable = 0,
    /// NFT_MSG_GETTABLE.
    GetTable = 1,
    /// NFT_MSG_DELTABLE.
    DelTable = 2,
    /// NFT_MSG_NEWCHAIN.
    NewChain = 3,
    /// NFT_MSG_GETCHAIN.
    GetChain = 4,
    /// NFT_MSG_DELCHAIN.
    DelChain = 5,
    /// NFT_MSG_NEWRULE.
    NewRule = 6,
    /// NFT_MSG_GETRULE.
    GetRule = 7,
    /// NFT_MSG_DELRULE.
    DelRule = 8,
    /// NFT_MSG_NEWSET.
    NewSet = 9,
    /// NFT_MSG_GETSET.
    GetSet = 10,
    /// NFT_MSG_DELSET.
    DelSet = 11,
    /// NFT_MSG_NEWSETELEM.
    NewSetElem = 12,
    /// NFT_MSG_GETSETELEM.
    GetSetElem = 13,
    /// NFT_MSG_DELSETELEM.
    DelSetElem = 14,
}

/// Netlink message type of an nf_tables message.
pub fn kind(msg: Msg) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg as u16
}

/// Nested attribute buffer.
#[derive(Debug, Default, Clone)]
pub struct Nla(Vec<u8>);

impl Nla {
    fn put(mut self, kind: u16, payload: &[u8]) -> Self {
        self.0
            .extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(payload);
        self.0.resize((self.0.len() + 3) & !3, 0);
        self
    }
    fn u32(self, kind: u16, v: u32) -> Self {
        self.put(kind, &v.to_be_bytes())
    }
    fn str(self, kind: u16, s: &str) -> Self {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        self.put(kind, &b)
    }
    fn nest(self, kind: u16, inner: Nla) -> Self {
        self.put(kind | NLA_F_NESTED, &inner.0)
    }
    /// The encoded bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn nfgenmsg(family: u8) -> [u8; 4] {
    [family, 0, 0, 0]
}

fn message(family: IpFamily, msg: Msg, flags: u16, seq: u32, attrs: Nla) -> Vec<u8> {
    let mut b =
        MessageBuilder::new(kind(msg), NLM_F_REQUEST | flags, seq, &nfgenmsg(family.nfproto())).finish();
    b.extend_from_slice(&attrs.0);
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b
}

/// One operation of a transaction, as data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `add table` with its comment.
    AddTable(String),
    /// `delete table`.
    DeleteTable,
    /// `add chain` (a base chain with its hook).
    AddChain(String, Option<BaseChain>),
    /// `flush chain`.
    FlushChain(String),
    /// `delete chain`.
    DeleteChain(String),
    /// `add rule` at the end of a chain.
    AddRule(String, Rule),
    /// `add set` / `add map`.
    AddSet(SetDef),
    /// `delete set`.
    DeleteSet(String),
    /// `flush set`.
    FlushSet(String),
    /// `add element` (`true`) or `delete element` (`false`) of a set.
    Elements(String, Vec<Element>, bool),
}

/// A batch under construction for one family's table: messages get consecutive sequence numbers.
#[derive(Debug, Default)]
pub struct Batch {
    family: IpFamily,
    messages: Vec<u8>,
    count: u32,
    set_ids: u32,
    last: usize,
    ops: Vec<Op>,
}

impl Batch {
    /// An empty batch for the table of `family`.
    pub fn new(family: IpFamily) -> Self {
        Self {
            family,
            ..Self::default()
        }
    }

    /// Messages in the batch.
    pub fn len(&self) -> u32 {
        self.count
    }

    /// Whether the batch has no messages.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The family whose table the batch edits.
    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// The batch's operations, in order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    fn push(&mut self, msg: Msg, flags: u16, attrs: Nla) {
        self.count += 1;
        self.last = self.messages.len();
        self.messages
            .extend(message(self.family, msg, flags, self.count, attrs));
    }

    /// The framed batch (begin, messages 1..=n, end) and the sequence number to await.
    ///
    /// Only the last message asks for an ack: the kernel reports every failing message anyway, in
    /// order, before that ack, so one ack proves the whole transaction was processed without
    /// needing a receive buffer for one ack per message.
    pub fn finish(mut self) -> (Vec<u8>, Vec<u32>) {
        if self.count > 0 {
            let at = self.last + 6;
            let flags = u16::from_ne_bytes([self.messages[at], self.messages[at + 1]]) | NLM_F_ACK;
            self.messages[at..at + 2].copy_from_slice(&flags.to_ne_bytes());
        }
        let begin_end = |k: u16, seq: u32| {
            let id = NFNL_SUBSYS_NFTABLES.to_be_bytes();
            MessageBuilder::new(k, NLM_F_REQUEST, seq, &[0, 0, id[0], id[1]]).finish()
        };
        let mut out = begin_end(0x10, 0);
        out.extend_from_slice(&self.messages);
        out.extend(begin_end(0x11, self.count + 1));
        (out, vec![self.count])
    }

    /// `add table ip switchyard` / `ip6 switchyard` (no error if it exists).
    pub fn add_table(&mut self, comment: &str) {
        let attrs = Nla::default()
            .str(1, TABLE)
            .u32(2, 0)
            .put(6, &udata_string(0, comment));
        self.push(Msg::NewTable, NLM_F_CREATE, attrs);
        self.ops.push(Op::AddTable(comment.to_owned()));
    }

    /// `delete table ip switchyard` / `ip6 switchyard`.
    pub fn delete_table(&mut self) {
        self.push(Msg::DelTable, 0, Nla::default().str(1, TABLE));
        self.ops.push(Op::DeleteTable);
    }

    /// `add chain` (no error if it exists).
    pub fn add_chain(&mut self, name: &str, base: Option<BaseChain>) {
        let mut attrs = Nla::default().str(1, TABLE).str(3, name);
        if let Some(b) = base {
            attrs = attrs
                .nest(
                    4,
                    Nla::default().u32(1, b.hook.number()).u32(2, b.priority as u32),
                )
                .u32(5, 1) // policy accept
                .str(7, if b.nat { "nat" } else { "filter" });
        }
        self.push(Msg::NewChain, NLM_F_CREATE, attrs);
        self.ops.push(Op::AddChain(name.to_owned(), base));
    }

    /// `flush chain`.
    pub fn flush_chain(&mut self, name: &str) {
        self.push(Msg::DelRule, 0, Nla::default().str(1, TABLE).str(2, name));
        self.ops.push(Op::FlushChain(name.to_owned()));
    }

    /// `delete chain`.
    pub fn delete_chain(&mut self, name: &str) {
        self.push(Msg::DelChain, 0, Nla::default().str(1, TABLE).str(3, name));
        self.ops.push(Op::DeleteChain(name.to_owned()));
    }

    /// `add rule` at the end of `chain`.
    pub fn add_rule(&mut self, chain: &str, rule: &Rule) {
        let mut list = Nla::default();
        for e in &rule.exprs {
            for (name, data) in encode_expr(e, self.family) {
                list = list.nest(1, Nla::default().str(1, name).nest(2, data));
            }
        }
        let mut attrs = Nla::default().str(1, TABLE).str(2, chain).nest(4, list);
        if let Some(c) = &rule.comment {
            attrs = attrs.put(7, &udata_string(0, c));
        }
        self.push(Msg::NewRule, NLM_F_CREATE | 0x800 /* NLM_F_APPEND */, attrs);
        self.ops.push(Op::AddRule(chain.to_owned(), rule.clone()));
    }

    /// `add set` / `add map` (no error if it exists with the same definition).
    pub fn add_set(&mut self, set: &SetDef) {
        let (key_type, key_len) = key_type(set.key, self.family);
        let mut flags = 0u32;
        if set.verdict_map || set.key.is_endpoint_map() {
            flags |= 0x8; // NFT_SET_MAP
        }
        if set.timeout_seconds.is_some() {
            flags |= 0x10 | 0x20; // NFT_SET_TIMEOUT | NFT_SET_EVAL (dynamic)
        }
        self.set_ids += 1;
        let mut attrs = Nla::default()
            .str(1, TABLE)
            .str(2, &set.name)
            .u32(3, flags)
            .u32(4, key_type)
            .u32(5, key_len);
        if set.verdict_map {
            attrs = attrs.u32(6, 0xffff_ff00).u32(7, 0);
        } else if set.key.is_endpoint_map() {
            // Data `ipv4_addr . inet_service` / `ipv6_addr . inet_service`.
            let (addr, len) = addr_type(self.family);
            attrs = attrs.u32(6, (addr << 6) | SERVICE).u32(7, len + 4);
        }
        // The kernel requires a transaction-unique set id.
        attrs = attrs.u32(10, self.set_ids);
        if let Some(t) = set.timeout_seconds {
            attrs = attrs.put(11, &(u64::from(t) * 1000).to_be_bytes());
        }
        let mut udata = Vec::new();
        // Key byte order: big endian (2) for addresses, as nft records it for dynamic sets.
        if set.timeout_seconds.is_some() {
            udata.extend_from_slice(&[0, 4, 2, 0, 0, 0]);
        }
        if let Some(typeof_) = typeof_udata(set.key, self.family) {
            udata.extend(typeof_);
        }
        if let Some(c) = &set.comment {
            udata.extend(udata_string(7, c));
        }
        if !udata.is_empty() {
            attrs = attrs.put(13, &udata);
        }
        self.push(Msg::NewSet, NLM_F_CREATE, attrs);
        self.ops.push(Op::AddSet(set.clone()));
    }

    /// `delete set`.
    pub fn delete_set(&mut self, name: &str) {
        self.push(Msg::DelSet, 0, Nla::default().str(1, TABLE).str(2, name));
        self.ops.push(Op::DeleteSet(name.to_owned()));
    }

    /// `flush set`.
    pub fn flush_set(&mut self, name: &str) {
        self.push(Msg::DelSetElem, 0, Nla::default().str(1, TABLE).str(2, name));
        self.ops.push(Op::FlushSet(name.to_owned()));
    }

    /// Adds (`add == true`) or deletes elements of `set`, split into messages whose element list
    /// stays below the 64 KiB netlink attribute limit.
    pub fn elements(&mut self, set: &str, elements: &[&Element], add: bool) {
        const LIST_BUDGET: usize = 60_000;
        let mut list = Nla::default();
        for e in elements {
            let mut elem = Nla::default().nest(1, Nla::default().put(1, &key_bytes(&e.key)));
            if add {
                if let Some(v) = &e.verdict {
                    elem = elem.nest(2, verdict_data(v));
                }
                if let Some((a, p)) = &e.dnat {
                    let port = p.to_be_bytes();
                    elem = elem.nest(2, value(&[octets(a), vec![port[0], port[1], 0, 0]].concat()));
                }
                if let Some(c) = &e.comment {
                    elem = elem.put(6, &udata_string(0, c));
                }
            }
            if list.0.len() + elem.0.len() + 4 > LIST_BUDGET {
                self.element_message(set, std::mem::take(&mut list), add);
            }
            list = list.nest(1, elem);
        }
        if !list.0.is_empty() {
            self.element_message(set, list, add);
        }
        let elements = elements.iter().map(|e| (*e).clone()).collect();
        self.ops.push(Op::Elements(set.to_owned(), elements, add));
    }

    fn element_message(&mut self, set: &str, list: Nla, add: bool) {
        let attrs = Nla::default().str(1, TABLE).str(2, set).nest(3, list);
        let (msg, flags) = if add {
            (Msg::NewSetElem, NLM_F_CREATE)
        } else {
            (Msg::DelSetElem, 0)
        };
        self.push(msg, flags, attrs);
    }
}

/// A dump request (`GETCHAIN`, `GETSET`) for our table of `family`.
pub fn dump_request(family: IpFamily, msg: Msg, seq: u32) -> Vec<u8> {
    let mut b = MessageBuilder::new(
        kind(msg),
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        &nfgenmsg(family.nfproto()),
    )
    .finish();
    let attrs = Nla::default().str(1, TABLE);
    b.extend_from_slice(&attrs.0);
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b
}

/// A `GETSETELEM` request (not a dump) for the elements with `keys` of our set `set`: the kernel
/// answers one `NEWSETELEM` per element with its value, or `ENOENT` when any is missing.
pub fn get_elements_request(family: IpFamily, set: &str, keys: &[Key], seq: u32) -> Vec<u8> {
    let mut list = Nla::default();
    for key in keys {
        list = list.nest(1, Nla::default().nest(1, Nla::default().put(1, &key_bytes(key))));
    }
    let attrs = Nla::default().str(1, TABLE).str(2, set).nest(3, list);
    message(family, Msg::GetSetElem, NLM_F_ACK, seq, attrs)
}

/// The value bytes of a DNAT target (`ip daddr . th dport`) as an endpoint map stores them.
pub fn dnat_value_bytes(addr: &IpAddr, port: u16) -> Vec<u8> {
    let port = port.to_be_bytes();
    [octets(addr), vec![port[0], port[1], 0, 0]].concat()
}

/// A `GETTABLE` request for our table of `family` (answers ENOENT when it does not exist).
pub fn get_table_request(family: IpFamily, seq: u32) -> Vec<u8> {
    message(
        family,
        Msg::GetTable,
        NLM_F_ACK,
        seq,
        Nla::default().str(1, TABLE),
    )
}

/// libnftnl user-data TLV with a NUL-terminated string.
fn udata_string(kind: u8, s: &str) -> Vec<u8> {
    let mut v = vec![kind, (s.len() + 1) as u8];
    v.extend_from_slice(s.as_bytes());
    v.push(0);
    v
}

/// libnftnl user-data TLV.
fn udata(kind: u8, value: &[u8]) -> Vec<u8> {
    let mut v = vec![kind, value.len() as u8];
    v.extend_from_slice(value);
    v
}

/// nft's `typeof` description of one expression: expression type and its attributes.
fn typeof_expr(expr: u32, attrs: &[u32]) -> Vec<u8> {
    let data: Vec<u8> = attrs
        .iter()
        .enumerate()
        .flat_map(|(i, a)| udata(i as u8, &a.to_ne_bytes()))
        .collect();
    [udata(0, &expr.to_ne_bytes()), udata(1, &data)].concat()
}

/// nft's `typeof` of a concatenation.
fn typeof_concat(parts: &[Vec<u8>]) -> Vec<u8> {
    const CONCAT: u32 = 13;
    let data: Vec<u8> = parts
        .iter()
        .enumerate()
        .flat_map(|(i, p)| udata(i as u8, p))
        .collect();
    [udata(0, &CONCAT.to_ne_bytes()), udata(1, &data)].concat()
}

/// The set user data nft writes for `typeof` endpoint maps (key and data byte order, key and
/// data expressions, data interval), so that `nft list` shows them as `typeof`.
fn typeof_udata(key: KeyType, family: IpFamily) -> Option<Vec<u8>> {
    const PAYLOAD: u32 = 7;
    const META: u32 = 9;
    const NUMGEN: u32 = 23;
    // Payload expressions are (protocol description, field): `ip daddr` is (IP, DADDR),
    // `ip6 daddr` (IP6, DADDR), `th dport` (TH, DPORT), in nft's numbering.
    let daddr = match family {
        IpFamily::V4 => typeof_expr(PAYLOAD, &[12, 12]),
        IpFamily::V6 => typeof_expr(PAYLOAD, &[13, 9]),
    };
    let th_dport = typeof_expr(PAYLOAD, &[11, 2]);
    let l4proto = typeof_expr(META, &[16]);
    let numgen = |n: u32| typeof_expr(NUMGEN, &[1, n, 0]);
    let key = match key {
        KeyType::AddrProtoPortSlot(n) => {
            typeof_concat(&[daddr.clone(), l4proto, th_dport.clone(), numgen(n)])
        }
        KeyType::ProtoPortSlot(n) => typeof_concat(&[l4proto, th_dport.clone(), numgen(n)]),
        _ => return None,
    };
    let data = typeof_concat(&[daddr, th_dport]);
    let zero = 0u32.to_ne_bytes();
    Some(
        [
            udata(0, &zero),
            udata(1, &zero),
            udata(3, &key),
            udata(4, &data),
            udata(6, &zero),
        ]
        .concat(),
    )
}

const INTEGER: u32 = 4;
const PROTO: u32 = 12;
const SERVICE: u32 = 13;

/// nft datatypes ipv4_addr (7) / ipv6_addr (8), and their length.
fn addr_type(family: IpFamily) -> (u32, u32) {
    match family {
        IpFamily::V4 => (7, 4),
        IpFamily::V6 => (8, 16),
    }
}

fn key_type(key: KeyType, family: IpFamily) -> (u32, u32) {
    // Concatenations shift 6 bits per field; each field takes a multiple of 4 bytes.
    let (addr, len) = addr_type(family);
    match key {
        KeyType::Addr => (addr, len),
        KeyType::ProtoPort => ((PROTO << 6) | SERVICE, 8),
        KeyType::AddrProtoPort => ((((addr << 6) | PROTO) << 6) | SERVICE, len + 8),
        KeyType::AddrAddr => ((addr << 6) | addr, 2 * len),
        KeyType::AddrProtoPortSlot(_) => (
            (((((addr << 6) | PROTO) << 6) | SERVICE) << 6) | INTEGER,
            len + 12,
        ),
        KeyType::ProtoPortSlot(_) => ((((PROTO << 6) | SERVICE) << 6) | INTEGER, 12),
    }
}

fn octets(a: &IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Key bytes: each concatenated field padded to 4 bytes, network byte order.
pub fn key_bytes(key: &Key) -> Vec<u8> {
    let proto = |p: crate::model::Protocol| [p.number(), 0, 0, 0];
    let port = |n: u16| {
        let b = n.to_be_bytes();
        [b[0], b[1], 0, 0]
    };
    match key {
        Key::Addr(a) => octets(a),
        Key::ProtoPort(p, n) => [proto(*p), port(*n)].concat(),
        Key::AddrProtoPort(a, p, n) => [octets(a), proto(*p).to_vec(), port(*n).to_vec()].concat(),
        Key::AddrAddr(a, b) => [octets(a), octets(b)].concat(),
        // numgen writes its value in host byte order.
        Key::AddrProtoPortSlot(a, p, n, s) => [
            octets(a),
            proto(*p).to_vec(),
            port(*n).to_vec(),
            s.index.to_ne_bytes().to_vec(),
        ]
        .concat(),
        Key::ProtoPortSlot(p, n, s) => [proto(*p), port(*n), s.index.to_ne_bytes()].concat(),
    }
}

fn verdict_data(v: &Verdict) -> Nla {
    let (code, chain): (i32, Option<&str>) = match v {
        Verdict::Drop => (0, None),
        Verdict::Return => (-5, None),
        Verdict::Jump(c) => (-3, Some(c)),
        Verdict::Goto(c) => (-4, Some(c)),
    };
    let mut inner = Nla::default().u32(1, code as u32);
    if let Some(c) = chain {
        inner = inner.str(2, c);
    }
    Nla::default().nest(2, inner)
}

fn value(bytes: &[u8]) -> Nla {
    Nla::default().put(1, bytes)
}

fn payload(dreg: u32, base: u32, offset: u32, len: u32) -> (&'static str, Nla) {
    (
        "payload",
        Nla::default()
            .u32(1, dreg)
            .u32(2, base)
            .u32(3, offset)
            .u32(4, len),
    )
}

fn cmp(eq: bool, data: &[u8]) -> (&'static str, Nla) {
    (
        "cmp",
        Nla::default()
            .u32(1, 1)
            .u32(2, if eq { 0 } else { 1 })
            .nest(3, value(data)),
    )
}

fn bitwise(len: u32, mask: &[u8], xor: &[u8]) -> (&'static str, Nla) {
    (
        "bitwise",
        Nla::default()
            .u32(1, 1)
            .u32(2, 1)
            .u32(3, len)
            .nest(4, value(mask))
            .nest(5, value(xor)),
    )
}

fn meta_load(dreg: u32, key: u32) -> (&'static str, Nla) {
    ("meta", Nla::default().u32(1, dreg).u32(2, key))
}

fn numgen(dreg: u32, modulus: u32) -> (&'static str, Nla) {
    (
        "numgen",
        Nla::default().u32(1, dreg).u32(2, modulus).u32(3, 1 /* random */),
    )
}

/// DNAT to the address in register 1 and the port in register `port_reg` (`dnat ip to … map`).
fn dnat_from_registers(family: IpFamily, port_reg: u32) -> (&'static str, Nla) {
    (
        "nat",
        Nla::default()
            .u32(1, 1)
            .u32(2, u32::from(family.nfproto()))
            .u32(3, 1)
            .u32(5, port_reg),
    )
}

fn lookup(set: &str, dreg: Option<u32>) -> (&'static str, Nla) {
    let mut n = Nla::default().str(1, set).u32(2, 1);
    if let Some(d) = dreg {
        n = n.u32(3, d);
    }
    ("lookup", n)
}

const META_MARK: u32 = 3;
const META_L4PROTO: u32 = 16;

/// Network-header offsets of the source and destination address, and the address length.
struct Layout {
    saddr: u32,
    daddr: u32,
    len: u32,
}

fn layout(family: IpFamily) -> Layout {
    match family {
        IpFamily::V4 => Layout {
            saddr: 12,
            daddr: 16,
            len: 4,
        },
        IpFamily::V6 => Layout {
            saddr: 8,
            daddr: 24,
            len: 16,
        },
    }
}

/// The register holding the 32-bit word `word` of a concatenation, numbered as nft numbers it: a
/// word starting a 128-bit register by that register (`NFT_REG_1`..), any other by its 32-bit
/// register (`NFT_REG32_00` = 8 onwards).
fn reg(word: u32) -> u32 {
    if word.is_multiple_of(4) {
        1 + word / 4
    } else {
        8 + word
    }
}

fn addr_match(offset: u32, net: &IpNet, negate: bool) -> Vec<(&'static str, Nla)> {
    let prefix = u32::from(net.prefix_len());
    let full = octets(&net.network());
    let mask = octets(&net.netmask());
    if prefix % 8 == 0 {
        // Byte-aligned prefixes load only the significant bytes, as nft does.
        let n = (prefix / 8) as usize;
        vec![payload(1, 1, offset, prefix / 8), cmp(!negate, &full[..n])]
    } else {
        let len = full.len() as u32;
        vec![
            payload(1, 1, offset, len),
            bitwise(len, &mask, &vec![0; full.len()]),
            cmp(!negate, &full),
        ]
    }
}

fn ct_bit(key: u32, bit: u32) -> Vec<(&'static str, Nla)> {
    vec![
        ("ct", Nla::default().u32(1, 1).u32(2, key)),
        bitwise(4, &bit.to_ne_bytes(), &[0; 4]),
        cmp(false, &[0; 4]),
    ]
}

/// The kernel expressions for one IR expression in a table of `family`.
pub fn encode_expr(e: &Expr, family: IpFamily) -> Vec<(&'static str, Nla)> {
    let l = layout(family);
    // Words an address takes in a concatenation (1 for IPv4, 4 for IPv6).
    let words = l.len / 4;
    match e {
        Expr::CtStateNew => ct_bit(0, 0x8),
        Expr::CtStatusDnat => ct_bit(2, 0x20),
        Expr::DaddrIs(a) => vec![payload(1, 1, l.daddr, l.len), cmp(true, &octets(a))],
        Expr::SaddrIs(a) => vec![payload(1, 1, l.saddr, l.len), cmp(true, &octets(a))],
        Expr::SaddrIn(n, neg) => addr_match(l.saddr, n, *neg),
        Expr::DaddrIn(n, neg) => addr_match(l.daddr, n, *neg),
        Expr::DaddrInSet(s) => vec![payload(1, 1, l.daddr, l.len), lookup(s, None)],
        Expr::SaddrInSet(s) => vec![payload(1, 1, l.saddr, l.len), lookup(s, None)],
        Expr::SaddrDaddrInSet(s) => {
            vec![
                payload(1, 1, l.saddr, l.len),
                payload(reg(words), 1, l.daddr, l.len),
                lookup(s, None),
            ]
        }
        Expr::DaddrProtoPortInSet(s) => vec![
            payload(1, 1, l.daddr, l.len),
            meta_load(reg(words), META_L4PROTO),
            payload(reg(words + 1), 2, 2, 2),
            lookup(s, None),
        ],
        Expr::ProtoPortInSet(s) => vec![meta_load(1, META_L4PROTO), payload(9, 2, 2, 2), lookup(s, None)],
        Expr::FibSaddrLocal | Expr::FibDaddrLocal => {
            let flags = if matches!(e, Expr::FibSaddrLocal) { 1 } else { 2 };
            vec![
                ("fib", Nla::default().u32(1, 1).u32(2, 3).u32(3, flags)),
                cmp(true, &2u32.to_ne_bytes()),
            ]
        }
        Expr::NumgenZero(m) => vec![numgen(1, *m), cmp(true, &[0; 4])],
        Expr::L4Proto(p) => vec![meta_load(1, META_L4PROTO), cmp(true, &[p.number()])],
        Expr::MarkSet(m) => vec![
            meta_load(1, META_MARK),
            bitwise(4, &m.to_ne_bytes(), &[0; 4]),
            cmp(false, &[0; 4]),
        ],
        _ => encode_statement(e, family),
    }
}

/// The kernel expressions of the statements (DNAT, marks, verdicts, map lookups that decide).
fn encode_statement(e: &Expr, family: IpFamily) -> Vec<(&'static str, Nla)> {
    let l = layout(family);
    let words = l.len / 4;
    match e {
        // The map's data is `daddr . dport`: the port lands in the word after the address.
        Expr::DnatDaddrProtoPortSlot(n, m) => vec![
            payload(1, 1, l.daddr, l.len),
            meta_load(reg(words), META_L4PROTO),
            payload(reg(words + 1), 2, 2, 2),
            numgen(reg(words + 2), *n),
            lookup(m, Some(1)),
            dnat_from_registers(family, reg(words)),
        ],
        Expr::DnatProtoPortSlot(n, m) => vec![
            meta_load(1, META_L4PROTO),
            payload(9, 2, 2, 2),
            numgen(10, *n),
            lookup(m, Some(1)),
            dnat_from_registers(family, reg(words)),
        ],
        Expr::SetMarkOr(m) | Expr::SetMarkXor(m) => {
            let mask = if matches!(e, Expr::SetMarkOr(_)) {
                !*m
            } else {
                u32::MAX
            };
            vec![
                meta_load(1, META_MARK),
                bitwise(4, &mask.to_ne_bytes(), &m.to_ne_bytes()),
                ("meta", Nla::default().u32(2, META_MARK).u32(3, 1)),
            ]
        }
        Expr::Dnat(a, p) => vec![
            ("immediate", Nla::default().u32(1, 1).nest(2, value(&octets(a)))),
            (
                "immediate",
                Nla::default().u32(1, 2).nest(2, value(&p.to_be_bytes())),
            ),
            (
                "nat",
                Nla::default()
                    .u32(1, 1)
                    .u32(2, u32::from(family.nfproto()))
                    .u32(3, 1)
                    .u32(5, 2)
                    .u32(7, 2),
            ),
        ],
        Expr::Masquerade => vec![("masq", Nla::default().u32(1, 0x10))],
        // ICMP port unreachable (3) / ICMPv6 port unreachable (4).
        Expr::Reject => {
            let code = if family == IpFamily::V4 { 3 } else { 4 };
            vec![("reject", Nla::default().u32(1, 0).put(2, &[code]))]
        }
        Expr::RejectTcpReset => vec![("reject", Nla::default().u32(1, 1).put(2, &[0]))],
        // NFT_REJECT_ICMP_UNREACH with ICMP_PROT_UNREACH.
        Expr::RejectProtocolUnreachable => vec![("reject", Nla::default().u32(1, 0).put(2, &[2]))],
        Expr::UpdateSaddr(s) => {
            vec![
                payload(1, 1, l.saddr, l.len),
                ("dynset", Nla::default().str(1, s).u32(3, 1).u32(4, 1)),
            ]
        }
        Expr::VmapDaddrProtoPort(m) => vec![
            payload(1, 1, l.daddr, l.len),
            meta_load(reg(words), META_L4PROTO),
            payload(reg(words + 1), 2, 2, 2),
            lookup(m, Some(0)),
        ],
        Expr::VmapProtoPort(m) => vec![
            meta_load(1, META_L4PROTO),
            payload(9, 2, 2, 2),
            lookup(m, Some(0)),
        ],
        Expr::Verdict(v) => vec![("immediate", Nla::default().u32(1, 0).nest(2, verdict_data(v)))],
        // Matches: encoded by `encode_expr`, which never hands them here.
        _ => Vec::new(),
    }
}

fn string_attr(attrs: &[u8], kind: u16) -> Option<String> {
    let value = crate::sys::genl::find_attr(attrs, kind)?;
    Some(String::from_utf8_lossy(value.split(|b| *b == 0).next().unwrap_or_default()).into_owned())
}

/// The name of a chain of our table in a `GETCHAIN` dump reply payload (`None` for other tables'
/// chains: the kernel does not filter chain dumps by table).
pub fn chain_name(payload: &[u8]) -> Option<String> {
    let attrs = payload.get(4..)?;
    // NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME.
    (string_attr(attrs, 1)? == TABLE)
        .then(|| string_attr(attrs, 3))
        .flatten()
}

/// The name of a set of our table in a `GETSET` dump reply payload (`None` for other tables').
pub fn set_name(payload: &[u8]) -> Option<String> {
    let attrs = payload.get(4..)?;
    // NFTA_SET_TABLE, NFTA_SET_NAME.
    (string_attr(attrs, 1)? == TABLE)
        .then(|| string_attr(attrs, 2))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    #[test]
    fn concat_keys_pad_each_field_to_four_bytes() {
        let k = Key::AddrProtoPort("10.96.0.10".parse().expect("ip"), Protocol::Tcp, 80);
        assert_eq!(key_bytes(&k), [10, 96, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0]);
        assert_eq!(key_type(KeyType::AddrProtoPort, IpFamily::V4), (0x730d, 12));
        assert_eq!(key_type(KeyType::AddrProtoPort, IpFamily::V6), (0x830d, 24));
        assert_eq!(key_type(KeyType::ProtoPort, IpFamily::V6), (0x30d, 8));
    }

    #[test]
    fn dnat_encodes_address_and_port_in_network_order() {
        let exprs = encode_expr(&Expr::Dnat("10.244.1.11".parse().expect("ip"), 80), IpFamily::V4);
        assert_eq!(
            exprs.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            ["immediate", "immediate", "nat"]
        );
        // immediate: DREG=1, DATA{VALUE=0a f4 01 0b}
        assert_eq!(
            exprs[0].1.bytes(),
            [8, 0, 1, 0, 0, 0, 0, 1, 12, 0, 2, 0x80, 8, 0, 1, 0, 10, 244, 1, 11]
        );
        assert_eq!(&exprs[1].1.bytes()[16..18], [0, 80]);
    }

    #[test]
    fn byte_aligned_prefixes_load_only_significant_bytes() {
        let net: IpNet = "10.244.0.0/16".parse().expect("net");
        let e = encode_expr(&Expr::SaddrIn(net, true), IpFamily::V4);
        assert_eq!(e.len(), 2, "payload + cmp, no bitwise");
        let odd: IpNet = "203.0.113.0/25".parse().expect("net");
        assert_eq!(encode_expr(&Expr::SaddrIn(odd, false), IpFamily::V4).len(), 3);
        let odd6: IpNet = "fd00:10:244::/60".parse().expect("net");
        assert_eq!(encode_expr(&Expr::SaddrIn(odd6, false), IpFamily::V6).len(), 3);
    }

    #[test]
    fn dumps_name_only_our_tables_objects() {
        // nfgenmsg, then NFTA_CHAIN_TABLE (1) and NFTA_CHAIN_NAME (3).
        let chain = |table: &str, name: &str| {
            [vec![2, 0, 0, 0], Nla::default().str(1, table).str(3, name).0].concat()
        };
        assert_eq!(chain_name(&chain(TABLE, "services")), Some("services".to_owned()));
        assert_eq!(
            chain_name(&chain("firewalld", "forward")),
            None,
            "another table's chain"
        );
        let set = |table: &str, name: &str| {
            [vec![2, 0, 0, 0], Nla::default().str(1, table).str(2, name).0].concat()
        };
        assert_eq!(
            set_name(&set(TABLE, "cluster-ips")),
            Some("cluster-ips".to_owned())
        );
        assert_eq!(set_name(&set("other", "cluster-ips")), None);
    }

    #[test]
    fn concatenation_registers_follow_nfts_numbering() {
        // IPv4: words 0, 1, 2 -> NFT_REG_1, NFT_REG32_01, NFT_REG32_02.
        assert_eq!([reg(0), reg(1), reg(2)], [1, 9, 10]);
        // IPv6: the address fills NFT_REG_1; then word 4 -> NFT_REG_2, word 5 -> NFT_REG32_05.
        assert_eq!([reg(4), reg(5)], [2, 13]);
    }
}
