//! Conntrack over ctnetlink: the [`Conntrack`] adapter, which dumps the entries of one family and
//! deletes those a predicate marks stale (by echoing each entry's original tuple back in a delete
//! request), its kernel implementation ([`KernelConntrack`]) and an in-memory one
//! ([`FakeConntrack`]). Which flows are stale is decided above this layer (`crate::conntrack`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{
    error::{ENOENT, KernelError, KernelResult},
    genl::find_attr,
    netlink::{MessageBuilder, NLM_F_ACK, NLM_F_REQUEST, Transport},
};
use crate::model::IpFamily;

/// One conntrack entry, as far as the cleanup looks at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// IP protocol number.
    pub protocol: u8,
    /// Original destination (the service address the client sent to).
    pub orig_dst: IpAddr,
    /// Original destination port.
    pub orig_dport: u16,
    /// Reply source (the endpoint, after DNAT; the original destination without DNAT).
    pub reply_src: IpAddr,
    /// Reply source port (the endpoint's port).
    pub reply_sport: u16,
}

/// The conntrack table of the network namespace.
pub trait Conntrack: std::fmt::Debug + Send {
    /// Deletes every entry of `family` for which `stale` holds; returns how many were deleted.
    /// Entries that vanish meanwhile are not errors.
    fn delete_where(&mut self, family: IpFamily, stale: &dyn Fn(&Flow) -> bool) -> KernelResult<usize>;
}

/// The kernel's conntrack table, over ctnetlink.
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelConntrack;

impl Conntrack for KernelConntrack {
    fn delete_where(&mut self, family: IpFamily, stale: &dyn Fn(&Flow) -> bool) -> KernelResult<usize> {
        delete_stale(family, stale)
    }
}

/// A conntrack table in memory.
#[derive(Debug, Clone, Default)]
pub struct FakeConntrack {
    entries: Vec<(IpFamily, Flow)>,
}

impl FakeConntrack {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an entry.
    pub fn add(&mut self, family: IpFamily, flow: Flow) {
        self.entries.push((family, flow));
    }

    /// The entries of `family`.
    pub fn entries(&self, family: IpFamily) -> Vec<Flow> {
        self.entries
            .iter()
            .filter(|(f, _)| *f == family)
            .map(|(_, flow)| *flow)
            .collect()
    }
}

impl Conntrack for FakeConntrack {
    fn delete_where(&mut self, family: IpFamily, stale: &dyn Fn(&Flow) -> bool) -> KernelResult<usize> {
        let before = self.entries.len();
        self.entries.retain(|(f, flow)| *f != family || !stale(flow));
        Ok(before - self.entries.len())
    }
}

const NETLINK_NETFILTER: isize = 12;
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NLM_F_DUMP: u16 = 0x300;
const NLA_F_NESTED: u16 = 0x8000;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
/// Deletes per request: keeps each send and its acks well inside the socket buffers.
const DELETES_PER_REQUEST: usize = 256;

fn kind(msg: u16) -> u16 {
    (NFNL_SUBSYS_CTNETLINK << 8) | msg
}

fn address(tuple: &[u8], v4: u16, v6: u16) -> Option<IpAddr> {
    let ip = find_attr(tuple, CTA_TUPLE_IP)?;
    if let Some(b) = find_attr(ip, v4) {
        return Some(Ipv4Addr::from(<[u8; 4]>::try_from(b).ok()?).into());
    }
    let b = find_attr(ip, v6)?;
    Some(Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?).into())
}

/// The flow of one dumped entry (payload after the netlink header), and its raw original tuple.
pub fn parse_entry(payload: &[u8]) -> Option<(Flow, &[u8])> {
    let attrs = payload.get(4..)?;
    let orig = find_attr(attrs, CTA_TUPLE_ORIG)?;
    let reply = find_attr(attrs, CTA_TUPLE_REPLY)?;
    let port = |tuple: &[u8], kind: u16| -> u16 {
        find_attr(tuple, CTA_TUPLE_PROTO)
            .and_then(|p| find_attr(p, kind))
            .and_then(|b| Some(u16::from_be_bytes(b.try_into().ok()?)))
            .unwrap_or(0)
    };
    let protocol = *find_attr(find_attr(orig, CTA_TUPLE_PROTO)?, CTA_PROTO_NUM)?.first()?;
    let flow = Flow {
        protocol,
        orig_dst: address(orig, CTA_IP_V4_DST, CTA_IP_V6_DST)?,
        orig_dport: port(orig, CTA_PROTO_DST_PORT),
        reply_src: address(reply, CTA_IP_V4_SRC, CTA_IP_V6_SRC)?,
        reply_sport: port(reply, CTA_PROTO_SRC_PORT),
    };
    Some((flow, orig))
}

/// Deletes every conntrack entry of `family` that `stale` marks; returns how many were deleted.
/// Entries that vanish meanwhile (ENOENT) are not errors.
pub fn delete_stale(family: IpFamily, stale: &dyn Fn(&Flow) -> bool) -> KernelResult<usize> {
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let header = [family.nfproto(), 0, 0, 0];
    let dump = MessageBuilder::new(kind(IPCTNL_MSG_CT_GET), NLM_F_REQUEST | NLM_F_DUMP, 1, &header).finish();
    // Only the deletes are kept: the dump itself is looked at one entry at a time.
    let mut deletes: Vec<Vec<u8>> = Vec::new();
    let mut dump_error = None;
    transport.dump_each(&dump, |reply| {
        if let Some(errno) = reply.error.filter(|e| *e != 0) {
            dump_error.get_or_insert(errno);
            return;
        }
        let Some((flow, orig)) = parse_entry(&reply.payload) else {
            return;
        };
        if !stale(&flow) {
            return;
        }
        let seq = deletes.len() as u32 + 1;
        let mut msg = MessageBuilder::new(
            kind(IPCTNL_MSG_CT_DELETE),
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
            &header,
        )
        .attr(CTA_TUPLE_ORIG | NLA_F_NESTED, orig);
        if let Some(zone) = reply.payload.get(4..).and_then(|a| find_attr(a, CTA_ZONE)) {
            msg = msg.attr(CTA_ZONE, zone);
        }
        deletes.push(msg.finish());
    })?;
    if let Some(errno) = dump_error {
        return Err(KernelError::from_errno("dump conntrack", errno));
    }
    // Each failing delete is answered with its whole request: room for a chunk of them.
    transport.size_buffers(64 << 10, 4 << 20)?;
    let mut deleted = 0;
    for chunk in deletes.chunks(DELETES_PER_REQUEST) {
        let seqs: Vec<u32> = chunk
            .iter()
            .map(|m| u32::from_ne_bytes([m[8], m[9], m[10], m[11]]))
            .collect();
        let answers = transport.request(&chunk.concat(), &seqs)?;
        deleted += answers.iter().filter(|r| r.error == Some(0)).count();
        // ENOENT: the entry expired or was deleted between the dump and the delete.
        if let Some(errno) = answers
            .iter()
            .filter_map(|r| r.error)
            .find(|e| *e != 0 && *e != -ENOENT)
        {
            return Err(KernelError::from_errno("delete conntrack entry", errno));
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nest(kind: u16, inner: &[u8]) -> Vec<u8> {
        attr(kind | NLA_F_NESTED, inner)
    }

    fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = ((4 + payload.len()) as u16).to_ne_bytes().to_vec();
        v.extend_from_slice(&kind.to_ne_bytes());
        v.extend_from_slice(payload);
        v.resize((v.len() + 3) & !3, 0);
        v
    }

    fn tuple(src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Vec<u8> {
        let ip = match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                [attr(CTA_IP_V4_SRC, &s.octets()), attr(CTA_IP_V4_DST, &d.octets())].concat()
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                [attr(CTA_IP_V6_SRC, &s.octets()), attr(CTA_IP_V6_DST, &d.octets())].concat()
            }
            _ => panic!("one family per tuple"),
        };
        let proto = [
            attr(CTA_PROTO_NUM, &[17]),
            attr(CTA_PROTO_SRC_PORT, &sport.to_be_bytes()),
            attr(CTA_PROTO_DST_PORT, &dport.to_be_bytes()),
        ]
        .concat();
        [nest(CTA_TUPLE_IP, &ip), nest(CTA_TUPLE_PROTO, &proto)].concat()
    }

    #[test]
    fn parses_the_original_destination_and_the_reply_source_in_both_families() {
        // A DNATed UDP flow: client -> service:53, answered by endpoint:5353.
        let cases: [[&str; 3]; 2] = [
            ["10.244.1.12", "10.96.0.10", "10.244.2.11"],
            ["fd00:10:244:1::12", "fd00:10:96::10", "fd00:10:244:2::11"],
        ];
        for [client, service, endpoint] in cases {
            let (client, service, endpoint): (IpAddr, IpAddr, IpAddr) = (
                client.parse().expect("ip"),
                service.parse().expect("ip"),
                endpoint.parse().expect("ip"),
            );
            let orig = tuple(client, 40000, service, 53);
            let reply = tuple(endpoint, 5353, client, 40000);
            let payload = [
                vec![2, 0, 0, 0],
                nest(CTA_TUPLE_ORIG, &orig),
                nest(CTA_TUPLE_REPLY, &reply),
            ]
            .concat();
            let (flow, raw) = parse_entry(&payload).expect("entry");
            assert_eq!(
                flow,
                Flow {
                    protocol: 17,
                    orig_dst: service,
                    orig_dport: 53,
                    reply_src: endpoint,
                    reply_sport: 5353
                }
            );
            assert_eq!(raw, orig.as_slice());
            assert_eq!(
                parse_entry(&payload[..8]),
                None,
                "truncated input is skipped, not a panic"
            );
        }
    }

    #[test]
    fn the_fake_deletes_only_stale_entries_of_the_family() {
        let flow = |port| Flow {
            protocol: 17,
            orig_dst: "10.96.0.10".parse().expect("ip"),
            orig_dport: port,
            reply_src: "10.244.1.1".parse().expect("ip"),
            reply_sport: port,
        };
        let mut ct = FakeConntrack::new();
        ct.add(IpFamily::V4, flow(53));
        ct.add(IpFamily::V4, flow(54));
        ct.add(IpFamily::V6, flow(53));
        let deleted = ct.delete_where(IpFamily::V4, &|f| f.orig_dport == 53);
        assert_eq!(deleted.ok(), Some(1));
        assert_eq!(ct.entries(IpFamily::V4), vec![flow(54)]);
        assert_eq!(ct.entries(IpFamily::V6), vec![flow(53)]);
    }
}
