//! A minimal netlink request/ack transport on `netlink-sys`, shared by the nf_tables and generic
//! netlink users. Messages are built with [`MessageBuilder`]; the kernel's answers are checked for
//! `NLMSG_ERROR` codes.

use netlink_sys::{Socket, SocketAddr};

use crate::{Error, Result};

/// `NLMSG_ERROR`.
const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`.
const NLMSG_DONE: u16 = 3;
/// `NLM_F_REQUEST`.
pub const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_ACK`.
pub const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_CREATE`.
pub const NLM_F_CREATE: u16 = 0x400;
const NLMSG_HDRLEN: usize = 16;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Builds one netlink message: header, family header, then attributes.
#[derive(Debug)]
pub struct MessageBuilder {
    buf: Vec<u8>,
}

impl MessageBuilder {
    /// Starts a message of `kind` with `flags` and sequence number `seq`, followed by `family_header`.
    pub fn new(kind: u16, flags: u16, seq: u32, family_header: &[u8]) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched in finish()
        buf.extend_from_slice(&kind.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: kernel fills in
        buf.extend_from_slice(family_header);
        buf.resize(align4(buf.len()), 0);
        Self { buf }
    }

    /// Appends an attribute with a raw payload.
    pub fn attr(mut self, kind: u16, payload: &[u8]) -> Self {
        let len = 4 + payload.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    /// Appends a NUL-terminated string attribute.
    pub fn attr_str(self, kind: u16, value: &str) -> Self {
        let mut payload = value.as_bytes().to_vec();
        payload.push(0);
        self.attr(kind, &payload)
    }

    /// Appends a big-endian u32 attribute (nf_tables' byte order).
    pub fn attr_u32_be(self, kind: u16, value: u32) -> Self {
        self.attr(kind, &value.to_be_bytes())
    }

    /// Finishes the message and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

/// One parsed netlink message from the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Message type.
    pub kind: u16,
    /// Sequence number it answers.
    pub seq: u32,
    /// For `NLMSG_ERROR`: the (negative) errno, 0 for an ack.
    pub error: Option<i32>,
    /// Payload after the netlink header.
    pub payload: Vec<u8>,
}

/// Splits a datagram into messages; malformed trailing bytes end the parse without panicking.
pub fn parse_replies(mut data: &[u8]) -> Vec<Reply> {
    let mut out = Vec::new();
    while data.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        if len < NLMSG_HDRLEN || len > data.len() {
            break;
        }
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        let seq = u32::from_ne_bytes([data[8], data[9], data[10], data[11]]);
        let payload = data[NLMSG_HDRLEN..len].to_vec();
        let error = (kind == NLMSG_ERROR && payload.len() >= 4)
            .then(|| i32::from_ne_bytes([payload[0], payload[1], payload[2], payload[3]]));
        out.push(Reply {
            kind,
            seq,
            error,
            payload,
        });
        data = &data[align4(len).min(data.len())..];
    }
    out
}

/// A connected netlink socket of one protocol.
pub struct Transport {
    socket: Socket,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Transport")
    }
}

impl Transport {
    /// Opens a socket of `protocol` (e.g. `NETLINK_NETFILTER`).
    pub fn open(protocol: isize) -> Result<Self> {
        let io = |source| Error::Netlink {
            op: "open socket",
            source,
        };
        let mut socket = Socket::new(protocol).map_err(io)?;
        socket.bind_auto().map_err(io)?;
        socket.connect(&SocketAddr::new(0, 0)).map_err(io)?;
        // Never wait forever on the kernel: a missing answer becomes an error.
        let timeout = nix::sys::time::TimeVal::new(30, 0);
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReceiveTimeout, &timeout).map_err(
            |e| Error::Netlink {
                op: "set receive timeout",
                source: std::io::Error::from(e),
            },
        )?;
        Ok(Self { socket })
    }

    /// Raises the send and receive buffers (root may exceed the sysctl limits) and asks for short
    /// acks, so a large transaction fits one send and its acks fit the receive queue.
    pub fn size_buffers(&self, send: usize, receive: usize) -> Result<()> {
        use nix::sys::socket::{setsockopt, sockopt};
        let io = |e: nix::Error| Error::Netlink {
            op: "set buffer size",
            source: std::io::Error::from(e),
        };
        setsockopt(&self.socket, sockopt::SndBufForce, &send).map_err(io)?;
        setsockopt(&self.socket, sockopt::RcvBufForce, &receive).map_err(io)?;
        self.socket.set_cap_ack(true).map_err(|source| Error::Netlink {
            op: "set cap_ack",
            source,
        })?;
        Ok(())
    }

    /// Sends a dump request and collects every reply until `NLMSG_DONE` or an error.
    pub fn dump(&self, request: &[u8]) -> Result<Vec<Reply>> {
        let mut replies = Vec::new();
        self.dump_each(request, |r| replies.push(r))?;
        Ok(replies)
    }

    /// Sends a dump request and hands every reply (errors included, `NLMSG_DONE` not) to `each`
    /// as it arrives, so a large dump (a conntrack table) is never held in memory whole.
    pub fn dump_each(&self, request: &[u8], mut each: impl FnMut(Reply)) -> Result<()> {
        self.socket
            .send(request, 0)
            .map_err(|source| Error::Netlink { op: "send", source })?;
        for _ in 0..1_000_000 {
            let (data, _) = self.socket.recv_from_full().map_err(|source| Error::Netlink {
                op: "receive",
                source,
            })?;
            let batch = parse_replies(&data);
            let done = batch.is_empty() || batch.iter().any(|r| r.kind == NLMSG_DONE || r.error.is_some());
            batch
                .into_iter()
                .filter(|r| r.kind != NLMSG_DONE)
                .for_each(&mut each);
            if done {
                break;
            }
        }
        Ok(())
    }

    /// Sends `request` and collects replies until every sequence number in `acks` has been
    /// acknowledged (or failed) or a `NLMSG_DONE` arrives. Returns all replies in order.
    pub fn request(&self, request: &[u8], acks: &[u32]) -> Result<Vec<Reply>> {
        self.socket
            .send(request, 0)
            .map_err(|source| Error::Netlink { op: "send", source })?;
        let mut pending: Vec<u32> = acks.to_vec();
        let mut replies = Vec::new();
        // Bounded: a kernel answer never needs more than a few datagrams per request here.
        for _ in 0..10_000 {
            if pending.is_empty() {
                break;
            }
            let (data, _) = self.socket.recv_from_full().map_err(|source| Error::Netlink {
                op: "receive",
                source,
            })?;
            for reply in parse_replies(&data) {
                let done = reply.kind == NLMSG_DONE;
                // A refusal of a message we do not await (e.g. a batch header the kernel does not
                // understand) means the rest will never be answered.
                let refused_unawaited = reply.error.is_some_and(|e| e != 0) && !pending.contains(&reply.seq);
                if reply.error.is_some() || done {
                    pending.retain(|s| *s != reply.seq);
                }
                replies.push(reply);
                if done || refused_unawaited {
                    pending.clear();
                }
            }
        }
        Ok(replies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_pads_attributes_and_sets_length() {
        let msg = MessageBuilder::new(0x0a00, NLM_F_REQUEST | NLM_F_ACK, 7, &[1, 0, 0, 0])
            .attr_str(1, "ab")
            .attr_u32_be(2, 1)
            .finish();
        // 16 header + 4 family + (4+3 -> 8) + (4+4) = 36
        assert_eq!(msg.len(), 36);
        assert_eq!(u32::from_ne_bytes([msg[0], msg[1], msg[2], msg[3]]), 36);
        assert_eq!(&msg[20..28], &[7, 0, 1, 0, b'a', b'b', 0, 0]);
        assert_eq!(&msg[28..36], &[8, 0, 2, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn parse_reads_errors_and_stops_on_garbage() {
        let mut ack = MessageBuilder::new(NLMSG_ERROR, 0, 9, &(-2i32).to_ne_bytes()).finish();
        ack.extend_from_slice(&[0xff, 0xff, 0, 0, 1]); // truncated trailing message
        let replies = parse_replies(&ack);
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].seq, 9);
        assert_eq!(replies[0].error, Some(-2));
        assert!(parse_replies(&[1, 2, 3]).is_empty());
    }
}
