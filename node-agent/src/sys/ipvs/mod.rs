//! IPVS over generic netlink, on our own netlink transport ([`super::netlink`]).
//!
//! Messages are encoded by hand with [`MessageBuilder`] from the kernel's `ip_vs_ctl.c` policies
//! (kubeproxy.md §3.5, crates.md §2): a genl header `{cmd, version 1, 0}`, then
//! `IPVS_CMD_ATTR_SERVICE` and/or `IPVS_CMD_ATTR_DEST` nested attributes (flagged `NLA_F_NESTED`).
//! Byte orders: AF, PROTOCOL and the u32 fields in host order; PORT big-endian; ADDR 16 bytes (an
//! IPv4 address in the first four, as ipvsadm sends it); NETMASK `0xffffffff` for IPv4 and the
//! prefix length 128 for IPv6; FLAGS `{flags, mask}`.
//!
//! Parsing never panics: unknown attributes are skipped, truncated attributes end the walk, and
//! services the module cannot represent (firewall-mark services, unknown address families) are
//! returned as [`Foreign`](ServiceKey::Foreign) keys so callers can leave them alone.
//!
//! The connection timeouts (`ipvsadm --set tcp tcpfin udp`) are read with `GET_CONFIG` (answered
//! with a `SET_CONFIG` message carrying `IPVS_CMD_ATTR_TIMEOUT_*`, u32 seconds) and written with
//! `SET_CONFIG`, which carries only the timeouts to change: the kernel keeps the others (and a 0
//! too), as kube-proxy's `--ipvs-tcp-timeout` & co. mean it ([`Timeouts`]).
//!
//! Writes are batched: many requests with `NLM_F_ACK` go out in one datagram and the kernel's
//! per-message acks are matched by sequence number ([`Ipvs::apply`]).
//!
//! The IPVS backend reaches the table through the [`IpvsTable`] adapter: [`KernelIpvs`] (this
//! client, opened on first use in the calling thread's network namespace) or the in-memory
//! [`fake::FakeIpvs`], with faults injected by [`fake::Faulty`]. Its errors are typed
//! ([`KernelError`]); IPVS's own errnos are mapped as ipvsadm reads them (`ESRCH`: no such
//! service, `ENOENT`: no such destination or scheduler, `EEXIST`: exists already).

pub mod fake;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use std::sync::atomic::{AtomicU32, Ordering};

use super::error::{KernelError, KernelResult};
use super::netlink::{MessageBuilder, NLM_F_ACK, NLM_F_REQUEST, Reply, Transport};

/// `NETLINK_GENERIC`.
const NETLINK_GENERIC: isize = 16;
/// `NLM_F_DUMP` (`NLM_F_ROOT | NLM_F_MATCH`).
pub const NLM_F_DUMP: u16 = 0x300;
/// `NLA_F_NESTED`.
pub const NLA_F_NESTED: u16 = 0x8000;
/// `IPVS_GENL_VERSION`.
pub const GENL_VERSION: u8 = 1;

/// `IPVS_CMD_*` (ip_vs.h).
pub mod cmd {
    /// Add a virtual service.
    pub const NEW_SERVICE: u8 = 1;
    /// Modify a virtual service.
    pub const SET_SERVICE: u8 = 2;
    /// Delete a virtual service.
    pub const DEL_SERVICE: u8 = 3;
    /// Get (dump) virtual services.
    pub const GET_SERVICE: u8 = 4;
    /// Add a real server.
    pub const NEW_DEST: u8 = 5;
    /// Modify a real server.
    pub const SET_DEST: u8 = 6;
    /// Delete a real server.
    pub const DEL_DEST: u8 = 7;
    /// Get (dump) real servers of one service.
    pub const GET_DEST: u8 = 8;
    /// Set the connection timeouts.
    pub const SET_CONFIG: u8 = 12;
    /// Get the connection timeouts (answered with a `SET_CONFIG` message).
    pub const GET_CONFIG: u8 = 13;
    /// Delete every virtual service (never used by the backend: it would flush the host's).
    pub const FLUSH: u8 = 17;
}

/// `IPVS_CMD_ATTR_*`.
pub mod cmd_attr {
    /// Nested service attributes.
    pub const SERVICE: u16 = 1;
    /// Nested destination attributes.
    pub const DEST: u16 = 2;
    /// TCP (established) connection timeout in seconds, u32.
    pub const TIMEOUT_TCP: u16 = 4;
    /// TCP FIN_WAIT timeout in seconds, u32.
    pub const TIMEOUT_TCP_FIN: u16 = 5;
    /// UDP timeout in seconds, u32.
    pub const TIMEOUT_UDP: u16 = 6;
}

/// `IPVS_SVC_ATTR_*`.
pub mod svc_attr {
    /// Address family, u16.
    pub const AF: u16 = 1;
    /// IP protocol, u16.
    pub const PROTOCOL: u16 = 2;
    /// Virtual address, up to 16 bytes.
    pub const ADDR: u16 = 3;
    /// Virtual port, big-endian u16.
    pub const PORT: u16 = 4;
    /// Firewall mark, u32.
    pub const FWMARK: u16 = 5;
    /// Scheduler name, NUL-terminated.
    pub const SCHED_NAME: u16 = 6;
    /// `struct ip_vs_flags { u32 flags; u32 mask; }`.
    pub const FLAGS: u16 = 7;
    /// Persistence timeout in seconds, u32.
    pub const TIMEOUT: u16 = 8;
    /// Persistence netmask, u32.
    pub const NETMASK: u16 = 9;
    /// Nested statistics.
    pub const STATS: u16 = 10;
    /// Persistence engine name.
    pub const PE_NAME: u16 = 11;
    /// Nested 64-bit statistics.
    pub const STATS64: u16 = 12;
}

/// `IPVS_DEST_ATTR_*`.
pub mod dest_attr {
    /// Real server address, up to 16 bytes.
    pub const ADDR: u16 = 1;
    /// Real server port, big-endian u16.
    pub const PORT: u16 = 2;
    /// Forwarding method (`IP_VS_CONN_F_*` & fwd mask), u32.
    pub const FWD_METHOD: u16 = 3;
    /// Weight, u32.
    pub const WEIGHT: u16 = 4;
    /// Upper connection threshold, u32.
    pub const U_THRESH: u16 = 5;
    /// Lower connection threshold, u32.
    pub const L_THRESH: u16 = 6;
    /// Active connections, u32 (read only).
    pub const ACTIVE_CONNS: u16 = 7;
    /// Inactive connections, u32 (read only).
    pub const INACT_CONNS: u16 = 8;
    /// Persistent connection templates, u32 (read only).
    pub const PERSIST_CONNS: u16 = 9;
    /// Address family of the real server, u16 (kernel >= 3.18).
    pub const ADDR_FAMILY: u16 = 11;
}

/// `IP_VS_SVC_F_PERSISTENT`.
pub const FLAG_PERSISTENT: u32 = 0x1;
/// `IP_VS_SVC_F_HASHED`: set by the kernel on every listed service; never requested.
pub const FLAG_HASHED: u32 = 0x2;
/// `IP_VS_SVC_F_SCHED2` (`mh-port` for mh, `sh-port` for sh).
pub const FLAG_SCHED2: u32 = 0x10;
/// `IP_VS_CONN_F_MASQ`: NAT forwarding.
pub const FWD_MASQ: u32 = 0;
/// `AF_INET`.
pub const AF_INET: u16 = 2;
/// `AF_INET6`.
pub const AF_INET6: u16 = 10;

/// Errors of the IPVS module.
#[derive(Debug, thiserror::Error)]
pub enum IpvsError {
    /// The kernel has no IPVS generic-netlink family (module not loaded or not built).
    #[error("IPVS is not available: {0}")]
    Unavailable(String),
    /// A socket operation failed.
    #[error(transparent)]
    Transport(#[from] crate::Error),
    /// The kernel refused a request.
    #[error("IPVS {op}: {}", std::io::Error::from_raw_os_error(-errno))]
    Kernel {
        /// What was asked (`NEW_SERVICE tcp 10.96.0.1:80`, ...).
        op: String,
        /// The negative errno.
        errno: i32,
    },
}

/// Transport protocol of a virtual service: the model's.
pub use crate::model::Protocol;

/// Identity of a virtual service we can manage: protocol, address and port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VirtualAddr {
    /// Protocol.
    pub protocol: Protocol,
    /// Virtual address (IPv4 or IPv6).
    pub addr: IpAddr,
    /// Virtual port.
    pub port: u16,
}

impl std::fmt::Display for VirtualAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.addr {
            IpAddr::V4(a) => write!(f, "{} {a}:{}", self.protocol.k8s_name(), self.port),
            IpAddr::V6(a) => write!(f, "{} [{a}]:{}", self.protocol.k8s_name(), self.port),
        }
    }
}

/// A listed service's identity: one we can manage, or something else (fwmark service, unknown
/// protocol or family) that is never touched.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServiceKey {
    /// protocol/address/port service.
    Addr(VirtualAddr),
    /// Anything else, described for logs.
    Foreign(String),
}

/// A virtual service with its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    /// Identity.
    pub addr: VirtualAddr,
    /// Scheduler (`rr`, `sh`, ...).
    pub scheduler: String,
    /// `IP_VS_SVC_F_*` flags (without [`FLAG_HASHED`] when compared).
    pub flags: u32,
    /// Persistence timeout in seconds (meaningful with [`FLAG_PERSISTENT`]).
    pub timeout: u32,
}

/// A real server of a virtual service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// Address.
    pub addr: IpAddr,
    /// Port.
    pub port: u16,
    /// Forwarding method ([`FWD_MASQ`], ...).
    pub fwd_method: u32,
    /// Weight (0 = quiesced: no new connections).
    pub weight: u32,
    /// Active connections (read back only).
    pub active_conns: u32,
    /// Inactive connections (read back only).
    pub inactive_conns: u32,
    /// Persistence templates (read back only).
    pub persist_conns: u32,
}

impl Destination {
    /// A masquerading real server with `weight`.
    pub fn masq(addr: IpAddr, port: u16, weight: u32) -> Self {
        Self {
            addr,
            port,
            fwd_method: FWD_MASQ,
            weight,
            active_conns: 0,
            inactive_conns: 0,
            persist_conns: 0,
        }
    }
}

/// The IPVS connection timeouts of a network namespace in seconds (`ipvsadm -L --timeout`). In
/// a write a 0 leaves that timeout as it is (the kernel's `ip_vs_set_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timeouts {
    /// Established TCP connections (kernel default 900).
    pub tcp: u32,
    /// TCP connections in FIN_WAIT (kernel default 120).
    pub tcp_fin: u32,
    /// UDP (kernel default 300).
    pub udp: u32,
}

impl Timeouts {
    /// The kernel's values at module load (`tcp_timeouts[]`, `udp_timeouts[]`).
    pub const KERNEL_DEFAULT: Timeouts = Timeouts {
        tcp: 900,
        tcp_fin: 120,
        udp: 300,
    };

    /// Whether every timeout is 0 (a write that changes nothing).
    pub fn is_unset(&self) -> bool {
        *self == Timeouts::default()
    }

    /// `current` with the non-zero timeouts of `self` laid over it.
    pub fn over(&self, current: Timeouts) -> Timeouts {
        let pick = |want: u32, have: u32| if want == 0 { have } else { want };
        Timeouts {
            tcp: pick(self.tcp, current.tcp),
            tcp_fin: pick(self.tcp_fin, current.tcp_fin),
            udp: pick(self.udp, current.udp),
        }
    }
}

/// One write request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `NEW_SERVICE`.
    AddService(Service),
    /// `SET_SERVICE` (scheduler, flags, timeout).
    UpdateService(Service),
    /// `DEL_SERVICE`.
    DeleteService(VirtualAddr),
    /// `NEW_DEST`.
    AddDest(VirtualAddr, Destination),
    /// `SET_DEST` (weight, forwarding method).
    UpdateDest(VirtualAddr, Destination),
    /// `DEL_DEST`.
    DeleteDest(VirtualAddr, IpAddr, u16),
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::AddService(s) => write!(f, "NEW_SERVICE {} {}", s.addr, s.scheduler),
            Op::UpdateService(s) => write!(f, "SET_SERVICE {} {}", s.addr, s.scheduler),
            Op::DeleteService(a) => write!(f, "DEL_SERVICE {a}"),
            Op::AddDest(a, d) => write!(f, "NEW_DEST {a} -> {}", sock(d.addr, d.port)),
            Op::UpdateDest(a, d) => write!(f, "SET_DEST {a} -> {} weight {}", sock(d.addr, d.port), d.weight),
            Op::DeleteDest(a, ip, port) => write!(f, "DEL_DEST {a} -> {}", sock(*ip, *port)),
        }
    }
}

fn sock(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding (pure)

/// Appends one attribute (header, payload, padding) to `out`.
pub fn put_attr(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize((out.len() + 3) & !3, 0);
}

fn family(addr: IpAddr) -> u16 {
    match addr {
        IpAddr::V4(_) => AF_INET,
        IpAddr::V6(_) => AF_INET6,
    }
}

/// The 16-byte `union nf_inet_addr` of `addr`.
fn addr16(addr: IpAddr) -> [u8; 16] {
    let mut out = [0u8; 16];
    match addr {
        IpAddr::V4(a) => out[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => out = a.octets(),
    }
    out
}

/// The service-identity attributes (AF, PROTOCOL, ADDR, PORT) of `addr`.
pub fn service_id_attrs(addr: &VirtualAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(48);
    put_attr(&mut out, svc_attr::AF, &family(addr.addr).to_ne_bytes());
    put_attr(
        &mut out,
        svc_attr::PROTOCOL,
        &u16::from(addr.protocol.number()).to_ne_bytes(),
    );
    put_attr(&mut out, svc_attr::ADDR, &addr16(addr.addr));
    put_attr(&mut out, svc_attr::PORT, &addr.port.to_be_bytes());
    out
}

/// The full service attributes: identity, scheduler, flags `{flags, ~0}`, timeout and netmask.
pub fn service_attrs(svc: &Service) -> Vec<u8> {
    let mut out = service_id_attrs(&svc.addr);
    let mut sched = svc.scheduler.as_bytes().to_vec();
    sched.push(0);
    put_attr(&mut out, svc_attr::SCHED_NAME, &sched);
    let mut flags = Vec::with_capacity(8);
    flags.extend_from_slice(&(svc.flags & !FLAG_HASHED).to_ne_bytes());
    flags.extend_from_slice(&u32::MAX.to_ne_bytes());
    put_attr(&mut out, svc_attr::FLAGS, &flags);
    put_attr(&mut out, svc_attr::TIMEOUT, &svc.timeout.to_ne_bytes());
    let netmask: u32 = match svc.addr.addr {
        IpAddr::V4(_) => u32::MAX,
        IpAddr::V6(_) => 128,
    };
    put_attr(&mut out, svc_attr::NETMASK, &netmask.to_ne_bytes());
    out
}

/// The identity attributes (ADDR, PORT) of a real server; with `full`, also forwarding method,
/// weight, thresholds (0) and ADDR_FAMILY.
pub fn dest_attrs(addr: IpAddr, port: u16, full: Option<&Destination>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    put_attr(&mut out, dest_attr::ADDR, &addr16(addr));
    put_attr(&mut out, dest_attr::PORT, &port.to_be_bytes());
    if let Some(d) = full {
        put_attr(&mut out, dest_attr::FWD_METHOD, &d.fwd_method.to_ne_bytes());
        put_attr(&mut out, dest_attr::WEIGHT, &d.weight.to_ne_bytes());
        put_attr(&mut out, dest_attr::U_THRESH, &0u32.to_ne_bytes());
        put_attr(&mut out, dest_attr::L_THRESH, &0u32.to_ne_bytes());
        put_attr(&mut out, dest_attr::ADDR_FAMILY, &family(addr).to_ne_bytes());
    }
    out
}

/// Encodes `op` as one netlink message for family `family_id` with sequence number `seq`
/// (`NLM_F_REQUEST | NLM_F_ACK`).
pub fn encode_op(family_id: u16, seq: u32, op: &Op) -> Vec<u8> {
    let (command, svc, dest) = match op {
        Op::AddService(s) => (cmd::NEW_SERVICE, service_attrs(s), None),
        Op::UpdateService(s) => (cmd::SET_SERVICE, service_attrs(s), None),
        Op::DeleteService(a) => (cmd::DEL_SERVICE, service_id_attrs(a), None),
        Op::AddDest(a, d) => (
            cmd::NEW_DEST,
            service_id_attrs(a),
            Some(dest_attrs(d.addr, d.port, Some(d))),
        ),
        Op::UpdateDest(a, d) => (
            cmd::SET_DEST,
            service_id_attrs(a),
            Some(dest_attrs(d.addr, d.port, Some(d))),
        ),
        Op::DeleteDest(a, ip, port) => (
            cmd::DEL_DEST,
            service_id_attrs(a),
            Some(dest_attrs(*ip, *port, None)),
        ),
    };
    let mut msg = MessageBuilder::new(
        family_id,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        &[command, GENL_VERSION, 0, 0],
    )
    .attr(cmd_attr::SERVICE | NLA_F_NESTED, &svc);
    if let Some(dest) = dest {
        msg = msg.attr(cmd_attr::DEST | NLA_F_NESTED, &dest);
    }
    msg.finish()
}

/// `GET_SERVICE` dump request.
pub fn encode_get_services(family_id: u16, seq: u32) -> Vec<u8> {
    MessageBuilder::new(
        family_id,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        &[cmd::GET_SERVICE, GENL_VERSION, 0, 0],
    )
    .finish()
}

/// `GET_DEST` dump request for the real servers of `addr`.
pub fn encode_get_dests(family_id: u16, seq: u32, addr: &VirtualAddr) -> Vec<u8> {
    MessageBuilder::new(
        family_id,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        &[cmd::GET_DEST, GENL_VERSION, 0, 0],
    )
    .attr(cmd_attr::SERVICE | NLA_F_NESTED, &service_id_attrs(addr))
    .finish()
}

/// `SET_CONFIG` with the non-zero timeouts of `t` (the kernel keeps the others).
pub fn encode_set_config(family_id: u16, seq: u32, t: &Timeouts) -> Vec<u8> {
    let mut msg = MessageBuilder::new(
        family_id,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        &[cmd::SET_CONFIG, GENL_VERSION, 0, 0],
    );
    for (kind, seconds) in [
        (cmd_attr::TIMEOUT_TCP, t.tcp),
        (cmd_attr::TIMEOUT_TCP_FIN, t.tcp_fin),
        (cmd_attr::TIMEOUT_UDP, t.udp),
    ] {
        if seconds != 0 {
            msg = msg.attr(kind, &seconds.to_ne_bytes());
        }
    }
    msg.finish()
}

/// `GET_CONFIG` request (not a dump: one answer, then the ack).
pub fn encode_get_config(family_id: u16, seq: u32) -> Vec<u8> {
    MessageBuilder::new(
        family_id,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        &[cmd::GET_CONFIG, GENL_VERSION, 0, 0],
    )
    .finish()
}

// ---------------------------------------------------------------------------------------------
// Decoding (pure, never panics)

/// Iterates over the attributes in `data` as `(kind without flags, payload)`; stops at the first
/// malformed or truncated attribute.
pub fn attrs(data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = data;
    std::iter::from_fn(move || {
        if rest.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
        if len < 4 || len > rest.len() {
            rest = &[];
            return None;
        }
        let payload = &rest[4..len];
        rest = &rest[((len + 3) & !3).min(rest.len())..];
        Some((kind, payload))
    })
}

fn u16_ne(b: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes([*b.first()?, *b.get(1)?]))
}

fn u16_be(b: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes([*b.first()?, *b.get(1)?]))
}

fn u32_ne(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(0..4)?.try_into().ok()?))
}

fn ip_of(af: u16, raw: &[u8]) -> Option<IpAddr> {
    match af {
        AF_INET => {
            let b: [u8; 4] = raw.get(0..4)?.try_into().ok()?;
            Some(IpAddr::V4(Ipv4Addr::from(b)))
        }
        AF_INET6 => {
            let b: [u8; 16] = raw.get(0..16)?.try_into().ok()?;
            Some(IpAddr::V6(Ipv6Addr::from(b)))
        }
        _ => None,
    }
}

/// Decodes the nested service attributes of a `GET_SERVICE` reply. `None` when mandatory
/// attributes are missing; [`ServiceKey::Foreign`] for services we never manage.
pub fn parse_service(nested: &[u8]) -> Option<(ServiceKey, Option<Service>)> {
    let (mut af, mut proto, mut addr, mut port, mut fwmark) = (None, None, None, None, None);
    let (mut sched, mut flags, mut timeout) = (String::new(), 0u32, 0u32);
    for (kind, payload) in attrs(nested) {
        match kind {
            svc_attr::AF => af = u16_ne(payload),
            svc_attr::PROTOCOL => proto = u16_ne(payload),
            svc_attr::ADDR => addr = Some(payload),
            svc_attr::PORT => port = u16_be(payload),
            svc_attr::FWMARK => fwmark = u32_ne(payload),
            svc_attr::SCHED_NAME => {
                let end = payload.iter().position(|b| *b == 0).unwrap_or(payload.len());
                sched = String::from_utf8_lossy(&payload[..end]).into_owned();
            }
            svc_attr::FLAGS => flags = u32_ne(payload).unwrap_or(0),
            svc_attr::TIMEOUT => timeout = u32_ne(payload).unwrap_or(0),
            _ => {}
        }
    }
    let af = af?;
    if let Some(mark) = fwmark.filter(|m| *m != 0) {
        return Some((ServiceKey::Foreign(format!("FWM {mark:#x} af {af}")), None));
    }
    let (proto, port) = (proto?, port?);
    let Some(ip) = addr.and_then(|raw| ip_of(af, raw)) else {
        return Some((
            ServiceKey::Foreign(format!("af {af} proto {proto} port {port}")),
            None,
        ));
    };
    let Some(protocol) = u8::try_from(proto).ok().and_then(Protocol::from_number) else {
        return Some((ServiceKey::Foreign(format!("proto {proto} {ip}:{port}")), None));
    };
    let vaddr = VirtualAddr {
        protocol,
        addr: ip,
        port,
    };
    let svc = Service {
        addr: vaddr,
        scheduler: sched,
        flags: flags & !FLAG_HASHED,
        timeout,
    };
    Some((ServiceKey::Addr(vaddr), Some(svc)))
}

/// Decodes the nested destination attributes of a `GET_DEST` reply; `svc_family` is used when
/// the kernel sends no ADDR_FAMILY (before 3.18).
pub fn parse_dest(nested: &[u8], svc_family: u16) -> Option<Destination> {
    let (mut addr, mut port, mut af) = (None, None, None);
    let mut d = Destination::masq(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0, 0);
    for (kind, payload) in attrs(nested) {
        match kind {
            dest_attr::ADDR => addr = Some(payload),
            dest_attr::PORT => port = u16_be(payload),
            dest_attr::FWD_METHOD => d.fwd_method = u32_ne(payload).unwrap_or(0),
            dest_attr::WEIGHT => d.weight = u32_ne(payload).unwrap_or(0),
            dest_attr::ACTIVE_CONNS => d.active_conns = u32_ne(payload).unwrap_or(0),
            dest_attr::INACT_CONNS => d.inactive_conns = u32_ne(payload).unwrap_or(0),
            dest_attr::PERSIST_CONNS => d.persist_conns = u32_ne(payload).unwrap_or(0),
            dest_attr::ADDR_FAMILY => af = u16_ne(payload),
            _ => {}
        }
    }
    d.addr = ip_of(af.unwrap_or(svc_family), addr?)?;
    d.port = port?;
    Some(d)
}

/// The genl payload's attributes (after the 4-byte genl header) of `reply`.
fn genl_attrs(reply: &Reply) -> &[u8] {
    reply.payload.get(4..).unwrap_or_default()
}

/// Decodes the replies of a `GET_SERVICE` dump.
pub fn parse_service_replies(replies: &[Reply], family_id: u16) -> Vec<(ServiceKey, Option<Service>)> {
    replies
        .iter()
        .filter(|r| r.kind == family_id)
        .filter_map(|r| attrs(genl_attrs(r)).find(|(k, _)| *k == cmd_attr::SERVICE))
        .filter_map(|(_, nested)| parse_service(nested))
        .collect()
}

/// Decodes the answer to `GET_CONFIG`; `None` when no message of the family carries the three
/// timeouts.
pub fn parse_config_replies(replies: &[Reply], family_id: u16) -> Option<Timeouts> {
    replies.iter().filter(|r| r.kind == family_id).find_map(|r| {
        let (mut tcp, mut tcp_fin, mut udp) = (None, None, None);
        for (kind, payload) in attrs(genl_attrs(r)) {
            match kind {
                cmd_attr::TIMEOUT_TCP => tcp = u32_ne(payload),
                cmd_attr::TIMEOUT_TCP_FIN => tcp_fin = u32_ne(payload),
                cmd_attr::TIMEOUT_UDP => udp = u32_ne(payload),
                _ => {}
            }
        }
        Some(Timeouts {
            tcp: tcp?,
            tcp_fin: tcp_fin?,
            udp: udp?,
        })
    })
}

/// Decodes the replies of a `GET_DEST` dump.
pub fn parse_dest_replies(replies: &[Reply], family_id: u16, svc_family: u16) -> Vec<Destination> {
    replies
        .iter()
        .filter(|r| r.kind == family_id)
        .filter_map(|r| attrs(genl_attrs(r)).find(|(k, _)| *k == cmd_attr::DEST))
        .filter_map(|(_, nested)| parse_dest(nested, svc_family))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The client

/// Requests per datagram in [`Ipvs::apply`].
const BATCH: usize = 256;

/// A generic-netlink socket talking to the kernel's IPVS family.
#[derive(Debug)]
pub struct Ipvs {
    transport: Transport,
    family: u16,
    seq: AtomicU32,
}

impl Ipvs {
    /// Resolves the `IPVS` family and opens a socket, in the caller's network namespace.
    pub fn open() -> Result<Self, IpvsError> {
        let family = super::genl::resolve_family("IPVS").map_err(|e| match e {
            KernelError::Transport(e) => IpvsError::Transport(e),
            other => IpvsError::Unavailable(other.to_string()),
        })?;
        let transport = Transport::open(NETLINK_GENERIC)?;
        transport.size_buffers(8 << 20, 8 << 20)?;
        Ok(Self {
            transport,
            family,
            seq: AtomicU32::new(1),
        })
    }

    /// The generic-netlink family id of IPVS.
    pub fn family(&self) -> u16 {
        self.family
    }

    fn next_seq(&self) -> u32 {
        // Never 0 (the kernel's notifications carry 0).
        let seq = self.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if seq == 0 { self.next_seq() } else { seq }
    }

    fn dump(&self, request: &[u8], what: &str) -> Result<Vec<Reply>, IpvsError> {
        let replies = self.transport.dump(request)?;
        if let Some(errno) = replies.iter().find_map(|r| r.error.filter(|e| *e != 0)) {
            return Err(IpvsError::Kernel {
                op: what.to_owned(),
                errno,
            });
        }
        Ok(replies)
    }

    /// Every virtual service in the kernel (ours and everybody else's).
    pub fn services(&self) -> Result<Vec<(ServiceKey, Option<Service>)>, IpvsError> {
        let seq = self.next_seq();
        let replies = self.dump(&encode_get_services(self.family, seq), "GET_SERVICE")?;
        Ok(parse_service_replies(&replies, self.family))
    }

    /// The real servers of `addr`.
    pub fn destinations(&self, addr: &VirtualAddr) -> Result<Vec<Destination>, IpvsError> {
        let seq = self.next_seq();
        let replies = self.dump(
            &encode_get_dests(self.family, seq, addr),
            &format!("GET_DEST {addr}"),
        )?;
        Ok(parse_dest_replies(&replies, self.family, family(addr.addr)))
    }

    /// Sends `ops` in batches and waits for every ack. Returns the ops the kernel refused with
    /// their errno (the others were applied); `Err` only when the socket fails.
    pub fn apply(&self, ops: &[Op]) -> Result<Vec<(Op, i32)>, IpvsError> {
        let mut refused = Vec::new();
        for chunk in ops.chunks(BATCH) {
            let mut buf = Vec::with_capacity(chunk.len() * 128);
            let mut seqs = Vec::with_capacity(chunk.len());
            for op in chunk {
                let seq = self.next_seq();
                seqs.push(seq);
                buf.extend_from_slice(&encode_op(self.family, seq, op));
            }
            let replies = self.transport.request(&buf, &seqs)?;
            for reply in replies {
                if let Some(errno) = reply.error.filter(|e| *e != 0)
                    && let Some(i) = seqs.iter().position(|s| *s == reply.seq)
                {
                    refused.push((chunk[i].clone(), errno));
                }
            }
        }
        Ok(refused)
    }

    /// The connection timeouts (`GET_CONFIG`).
    pub fn timeouts(&self) -> Result<Timeouts, IpvsError> {
        let seq = self.next_seq();
        let replies = self
            .transport
            .request(&encode_get_config(self.family, seq), &[seq])?;
        let refused = |errno| IpvsError::Kernel {
            op: "GET_CONFIG".into(),
            errno,
        };
        if let Some(errno) = replies.iter().find_map(|r| r.error.filter(|e| *e != 0)) {
            return Err(refused(errno));
        }
        // An answer without the timeouts: the kernel's EINVAL for a malformed reply.
        parse_config_replies(&replies, self.family).ok_or_else(|| refused(-22))
    }

    /// Sets the non-zero timeouts of `t` (`SET_CONFIG`); nothing is sent when all are 0.
    pub fn set_timeouts(&self, t: &Timeouts) -> Result<(), IpvsError> {
        if t.is_unset() {
            return Ok(());
        }
        let seq = self.next_seq();
        let replies = self
            .transport
            .request(&encode_set_config(self.family, seq, t), &[seq])?;
        match replies.iter().find_map(|r| r.error.filter(|e| *e != 0)) {
            Some(errno) => Err(IpvsError::Kernel {
                op: format!("SET_CONFIG tcp {} tcpfin {} udp {}", t.tcp, t.tcp_fin, t.udp),
                errno,
            }),
            None => Ok(()),
        }
    }

    /// Applies one op; a refusal is an error.
    pub fn apply_one(&self, op: Op) -> Result<(), IpvsError> {
        match self.apply(std::slice::from_ref(&op))?.into_iter().next() {
            Some((op, errno)) => Err(IpvsError::Kernel {
                op: op.to_string(),
                errno,
            }),
            None => Ok(()),
        }
    }
}

/// `ESRCH`: what IPVS answers for a service that does not exist.
const ESRCH: i32 = 3;

/// The typed error of IPVS request `op` refused with `errno` (either sign): IPVS says `ESRCH`
/// for a missing service, which is "not found" as much as `ENOENT` (a missing destination or
/// scheduler) is.
pub fn refusal(op: impl Into<String>, errno: i32) -> KernelError {
    match errno.abs() {
        ESRCH => KernelError::NotFound { what: op.into() },
        errno => KernelError::from_errno(op, errno),
    }
}

impl From<IpvsError> for KernelError {
    fn from(e: IpvsError) -> Self {
        match e {
            IpvsError::Unavailable(why) => KernelError::Unsupported {
                what: format!("IPVS ({why})"),
            },
            IpvsError::Transport(e) => KernelError::Transport(e),
            IpvsError::Kernel { op, errno } => refusal(op, errno),
        }
    }
}

/// The IPVS table as the IPVS backend uses it: dumps of the virtual services and of one
/// service's real servers, and batches of writes. Reads take `&self` (verification reads only).
pub trait IpvsTable: std::fmt::Debug + Send {
    /// Every virtual service in the table (ours and everybody else's). No IPVS in this kernel:
    /// [`KernelError::Unsupported`].
    fn services(&self) -> KernelResult<Vec<(ServiceKey, Option<Service>)>>;
    /// The real servers of `service` (none when it does not exist, as the kernel's dump).
    fn destinations(&self, service: &VirtualAddr) -> KernelResult<Vec<Destination>>;
    /// Applies `ops` in order; returns the ops refused with their errors (the others were
    /// applied). `Err` when nothing could be sent.
    fn apply(&mut self, ops: &[Op]) -> KernelResult<Vec<(Op, KernelError)>>;
    /// The connection timeouts of the table's network namespace (`GET_CONFIG`).
    fn timeouts(&self) -> KernelResult<Timeouts>;
    /// Sets the non-zero timeouts of `t`, keeping the others (`SET_CONFIG`).
    fn set_timeouts(&mut self, t: &Timeouts) -> KernelResult<()>;
}

impl IpvsTable for Ipvs {
    fn services(&self) -> KernelResult<Vec<(ServiceKey, Option<Service>)>> {
        Ok(Ipvs::services(self)?)
    }

    fn destinations(&self, service: &VirtualAddr) -> KernelResult<Vec<Destination>> {
        Ok(Ipvs::destinations(self, service)?)
    }

    fn apply(&mut self, ops: &[Op]) -> KernelResult<Vec<(Op, KernelError)>> {
        Ok(Ipvs::apply(self, ops)?
            .into_iter()
            .map(|(op, errno)| {
                let what = op.to_string();
                (op, refusal(what, errno))
            })
            .collect())
    }

    fn timeouts(&self) -> KernelResult<Timeouts> {
        Ok(Ipvs::timeouts(self)?)
    }

    fn set_timeouts(&mut self, t: &Timeouts) -> KernelResult<()> {
        Ok(Ipvs::set_timeouts(self, t)?)
    }
}

/// The kernel's IPVS table: an [`Ipvs`] socket opened on first use (in the network namespace of
/// the thread that first uses it) and kept; opening is retried while it fails (no IPVS yet).
#[derive(Debug, Default)]
pub struct KernelIpvs {
    socket: std::sync::Mutex<Option<Ipvs>>,
}

impl KernelIpvs {
    /// Not opened yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<R>(&self, f: impl FnOnce(&Ipvs) -> Result<R, IpvsError>) -> KernelResult<R> {
        let mut socket = self
            .socket
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if socket.is_none() {
            *socket = Some(Ipvs::open()?);
        }
        match socket.as_ref() {
            Some(ipvs) => Ok(f(ipvs)?),
            None => Err(KernelError::Unsupported {
                what: "IPVS socket".into(),
            }),
        }
    }
}

impl IpvsTable for KernelIpvs {
    fn services(&self) -> KernelResult<Vec<(ServiceKey, Option<Service>)>> {
        self.with(Ipvs::services)
    }

    fn destinations(&self, service: &VirtualAddr) -> KernelResult<Vec<Destination>> {
        self.with(|ipvs| ipvs.destinations(service))
    }

    fn apply(&mut self, ops: &[Op]) -> KernelResult<Vec<(Op, KernelError)>> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let refused = self.with(|ipvs| ipvs.apply(ops))?;
        Ok(refused
            .into_iter()
            .map(|(op, errno)| {
                let what = op.to_string();
                (op, refusal(what, errno))
            })
            .collect())
    }

    fn timeouts(&self) -> KernelResult<Timeouts> {
        self.with(Ipvs::timeouts)
    }

    fn set_timeouts(&mut self, t: &Timeouts) -> KernelResult<()> {
        if t.is_unset() {
            return Ok(());
        }
        self.with(|ipvs| ipvs.set_timeouts(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAMILY: u16 = 0x1c;

    fn v4(a: [u8; 4]) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(a))
    }

    fn dns() -> VirtualAddr {
        VirtualAddr {
            protocol: Protocol::Tcp,
            addr: v4([10, 96, 0, 10]),
            port: 53,
        }
    }

    /// The reference byte layout of NEW_SERVICE tcp 10.96.0.10:53 rr (crates.md §2), written out
    /// attribute by attribute (little-endian host).
    #[test]
    fn ipvs_new_service_bytes() {
        let svc = Service {
            addr: dns(),
            scheduler: "rr".into(),
            flags: 0,
            timeout: 0,
        };
        let msg = encode_op(FAMILY, 7, &Op::AddService(svc));
        let mut expect: Vec<u8> = Vec::new();
        // nlmsghdr: len, type, flags REQUEST|ACK, seq 7, pid 0
        let body_len = 4 + 4 + 8 + 8 + 20 + 8 + 8 + 12 + 8 + 8;
        expect.extend_from_slice(&((16 + body_len) as u32).to_le_bytes());
        expect.extend_from_slice(&[0x1c, 0, 0x05, 0, 7, 0, 0, 0, 0, 0, 0, 0]);
        expect.extend_from_slice(&[1, 1, 0, 0]); // genl: NEW_SERVICE, version 1
        expect.extend_from_slice(&[(body_len - 4) as u8, 0, 0x01, 0x80]); // SERVICE | NESTED
        expect.extend_from_slice(&[6, 0, 1, 0, 2, 0, 0, 0]); // AF_INET
        expect.extend_from_slice(&[6, 0, 2, 0, 6, 0, 0, 0]); // PROTOCOL tcp
        expect.extend_from_slice(&[20, 0, 3, 0, 10, 96, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // ADDR 16 B
        expect.extend_from_slice(&[6, 0, 4, 0, 0, 53, 0, 0]); // PORT be16
        expect.extend_from_slice(&[7, 0, 6, 0, b'r', b'r', 0, 0]); // SCHED_NAME "rr\0"
        expect.extend_from_slice(&[12, 0, 7, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]); // FLAGS {0, ~0}
        expect.extend_from_slice(&[8, 0, 8, 0, 0, 0, 0, 0]); // TIMEOUT 0
        expect.extend_from_slice(&[8, 0, 9, 0, 0xff, 0xff, 0xff, 0xff]); // NETMASK
        if cfg!(target_endian = "little") {
            assert_eq!(msg, expect);
        }
        assert_eq!(msg.len(), 16 + body_len);
    }

    #[test]
    fn ipvs_new_dest_bytes() {
        let d = Destination::masq(v4([10, 244, 1, 5]), 5353, 1);
        let msg = encode_op(FAMILY, 1, &Op::AddDest(dns(), d));
        let genl = &msg[16..];
        assert_eq!(&genl[..4], &[cmd::NEW_DEST, 1, 0, 0]);
        let top: Vec<(u16, &[u8])> = attrs(&genl[4..]).collect();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0].0, cmd_attr::SERVICE);
        assert_eq!(top[1].0, cmd_attr::DEST);
        // the raw type carries NLA_F_NESTED
        let raw_type = u16::from_ne_bytes([genl[6], genl[7]]);
        assert_eq!(raw_type, 0x8001);
        let dest: Vec<(u16, Vec<u8>)> = attrs(top[1].1).map(|(k, p)| (k, p.to_vec())).collect();
        let mut addr = vec![10, 244, 1, 5];
        addr.resize(16, 0);
        assert_eq!(
            dest,
            vec![
                (dest_attr::ADDR, addr),
                (dest_attr::PORT, vec![0x14, 0xe9]),
                (dest_attr::FWD_METHOD, 0u32.to_ne_bytes().to_vec()),
                (dest_attr::WEIGHT, 1u32.to_ne_bytes().to_vec()),
                (dest_attr::U_THRESH, 0u32.to_ne_bytes().to_vec()),
                (dest_attr::L_THRESH, 0u32.to_ne_bytes().to_vec()),
                (dest_attr::ADDR_FAMILY, 2u16.to_ne_bytes().to_vec()),
            ]
        );
    }

    #[test]
    fn ipvs_ipv6_sctp_persistent_encoding() {
        let addr = VirtualAddr {
            protocol: Protocol::Sctp,
            addr: "fd00::10".parse().unwrap(),
            port: 9,
        };
        let svc = Service {
            addr,
            scheduler: "sh".into(),
            flags: FLAG_PERSISTENT | FLAG_HASHED,
            timeout: 10800,
        };
        let body = service_attrs(&svc);
        let got: Vec<(u16, Vec<u8>)> = attrs(&body).map(|(k, p)| (k, p.to_vec())).collect();
        assert_eq!(got[0], (svc_attr::AF, 10u16.to_ne_bytes().to_vec()));
        assert_eq!(got[1], (svc_attr::PROTOCOL, 132u16.to_ne_bytes().to_vec()));
        assert_eq!(
            got[2].1,
            "fd00::10".parse::<Ipv6Addr>().unwrap().octets().to_vec()
        );
        assert_eq!(got[3].1, vec![0, 9]);
        assert_eq!(got[4].1, b"sh\0".to_vec());
        // HASHED is never requested.
        assert_eq!(got[5].1[..4], 1u32.to_ne_bytes());
        assert_eq!(got[6].1, 10800u32.to_ne_bytes().to_vec());
        // IPv6 netmask: a prefix length, not 16 bytes of 0xff.
        assert_eq!(got[7].1, 128u32.to_ne_bytes().to_vec());
        // And it parses back (what the kernel echoes has HASHED set).
        let (key, parsed) = parse_service(&body).unwrap();
        assert_eq!(key, ServiceKey::Addr(addr));
        assert_eq!(
            parsed,
            Some(Service {
                flags: FLAG_PERSISTENT,
                ..svc
            })
        );
    }

    #[test]
    fn ipvs_dump_requests() {
        let msg = encode_get_services(FAMILY, 3);
        assert_eq!(msg.len(), 20);
        assert_eq!(u16::from_ne_bytes([msg[6], msg[7]]), 0x301);
        assert_eq!(&msg[16..], &[cmd::GET_SERVICE, 1, 0, 0]);
        let msg = encode_get_dests(FAMILY, 4, &dns());
        assert_eq!(u16::from_ne_bytes([msg[6], msg[7]]), 0x301);
        assert_eq!(msg[16], cmd::GET_DEST);
        let nested = attrs(&msg[20..]).next().unwrap();
        assert_eq!(nested.0, cmd_attr::SERVICE);
        assert_eq!(nested.1, service_id_attrs(&dns()).as_slice());
        let del = encode_op(FAMILY, 5, &Op::DeleteDest(dns(), v4([10, 0, 0, 2]), 8080));
        let top: Vec<_> = attrs(&del[20..]).collect();
        assert_eq!(attrs(top[1].1).count(), 2, "DEL_DEST carries only ADDR and PORT");
    }

    /// A kernel-style reply: what `GET_SERVICE` returns (ADDR 16 bytes, HASHED flag, stats, an
    /// attribute we do not know), plus a fwmark service and garbage.
    #[test]
    fn ipvs_parse_replies_robustly() {
        let mut svc = service_attrs(&Service {
            addr: dns(),
            scheduler: "wlc".into(),
            flags: FLAG_HASHED,
            timeout: 0,
        });
        put_attr(
            &mut svc,
            svc_attr::STATS | NLA_F_NESTED,
            &[8, 0, 1, 0, 9, 0, 0, 0],
        );
        put_attr(&mut svc, 99, &[1, 2, 3]);
        let ok = MessageBuilder::new(FAMILY, 2, 1, &[cmd::NEW_SERVICE, 1, 0, 0])
            .attr(cmd_attr::SERVICE, &svc)
            .finish();
        let mut fw = Vec::new();
        put_attr(&mut fw, svc_attr::AF, &2u16.to_ne_bytes());
        put_attr(&mut fw, svc_attr::FWMARK, &7u32.to_ne_bytes());
        let fw = MessageBuilder::new(FAMILY, 2, 1, &[cmd::NEW_SERVICE, 1, 0, 0])
            .attr(cmd_attr::SERVICE, &fw)
            .finish();
        let mut data = ok;
        data.extend_from_slice(&fw);
        let replies = crate::sys::netlink::parse_replies(&data);
        let parsed = parse_service_replies(&replies, FAMILY);
        assert_eq!(parsed.len(), 2);
        assert_eq!(
            parsed[0].1.as_ref().map(|s| (s.scheduler.as_str(), s.flags)),
            Some(("wlc", 0))
        );
        assert!(matches!(parsed[1].0, ServiceKey::Foreign(_)));
        // Every truncation of the nested service parses to something or nothing, never panics.
        for cut in 0..svc.len() {
            let _ = parse_service(&svc[..cut]);
            let _ = parse_dest(&svc[..cut], AF_INET);
        }
        // Unknown protocol.
        let mut odd = service_id_attrs(&dns());
        odd[12..14].copy_from_slice(&47u16.to_ne_bytes());
        assert!(matches!(
            parse_service(&odd),
            Some((ServiceKey::Foreign(_), None))
        ));
    }

    /// SET_CONFIG carries only the timeouts to change; GET_CONFIG's answer (a SET_CONFIG message
    /// with all three) parses back, and an answer without them is none.
    #[test]
    fn ipvs_config_requests_and_answer() {
        let t = Timeouts {
            tcp: 901,
            tcp_fin: 0,
            udp: 33,
        };
        let msg = encode_set_config(FAMILY, 9, &t);
        assert_eq!(u16::from_ne_bytes([msg[6], msg[7]]), 0x5, "REQUEST|ACK");
        assert_eq!(&msg[16..20], &[cmd::SET_CONFIG, 1, 0, 0]);
        let sent: Vec<(u16, Vec<u8>)> = attrs(&msg[20..]).map(|(k, p)| (k, p.to_vec())).collect();
        assert_eq!(
            sent,
            vec![
                (cmd_attr::TIMEOUT_TCP, 901u32.to_ne_bytes().to_vec()),
                (cmd_attr::TIMEOUT_UDP, 33u32.to_ne_bytes().to_vec()),
            ]
        );
        let get = encode_get_config(FAMILY, 10);
        assert_eq!((get.len(), get[16]), (20, cmd::GET_CONFIG));
        let all = Timeouts { tcp_fin: 120, ..t };
        let mut answer = MessageBuilder::new(FAMILY, 0, 10, &[cmd::SET_CONFIG, 1, 0, 0])
            .attr(cmd_attr::TIMEOUT_TCP, &901u32.to_ne_bytes())
            .attr(cmd_attr::TIMEOUT_TCP_FIN, &120u32.to_ne_bytes())
            .attr(cmd_attr::TIMEOUT_UDP, &33u32.to_ne_bytes())
            .finish();
        answer.extend(MessageBuilder::new(2, 0, 10, &0i32.to_ne_bytes()).finish());
        let replies = crate::sys::netlink::parse_replies(&answer);
        assert_eq!(parse_config_replies(&replies, FAMILY), Some(all));
        assert_eq!(parse_config_replies(&replies[1..], FAMILY), None);
        assert_eq!(
            t.over(Timeouts::KERNEL_DEFAULT),
            Timeouts {
                tcp: 901,
                tcp_fin: 120,
                udp: 33
            }
        );
        assert!(Timeouts::default().is_unset() && !t.is_unset());
    }

    #[test]
    fn ipvs_parse_dest_reply() {
        let mut d = dest_attrs(
            v4([10, 0, 0, 6]),
            8080,
            Some(&Destination::masq(v4([10, 0, 0, 6]), 8080, 0)),
        );
        put_attr(&mut d, dest_attr::ACTIVE_CONNS, &3u32.to_ne_bytes());
        put_attr(&mut d, dest_attr::INACT_CONNS, &4u32.to_ne_bytes());
        put_attr(&mut d, 13, &[0]); // TUN_TYPE: unknown to us
        let got = parse_dest(&d, AF_INET).unwrap();
        assert_eq!(
            (
                got.addr,
                got.port,
                got.weight,
                got.active_conns,
                got.inactive_conns
            ),
            (v4([10, 0, 0, 6]), 8080, 0, 3, 4)
        );
        // Without ADDR_FAMILY (old kernels) the service's family decides.
        let mut old = Vec::new();
        put_attr(&mut old, dest_attr::ADDR, &addr16(v4([1, 2, 3, 4])));
        put_attr(&mut old, dest_attr::PORT, &80u16.to_be_bytes());
        assert_eq!(parse_dest(&old, AF_INET).map(|d| d.addr), Some(v4([1, 2, 3, 4])));
        assert_eq!(parse_dest(&old[..8], AF_INET), None);
    }
}
