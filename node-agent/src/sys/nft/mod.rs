//! nf_tables: the object model ([`ir`]), its netlink codec ([`codec`]), the adapter trait the
//! nftables backend programs through ([`NfTables`]) with the kernel's implementation
//! ([`KernelNft`]) and an in-memory one ([`fake::FakeNft`]), the capability probe's throwaway
//! table, and removing kube-proxy's tables on takeover.

pub mod codec;
pub mod fake;
pub mod ir;

use codec::{Batch, Msg};

use super::{
    error::{KernelError, KernelResult},
    netlink::{MessageBuilder, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, Transport},
};
use crate::{Result, model::IpFamily};

/// Which objects of our table a listing names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objects {
    /// Chains.
    Chains,
    /// Sets and maps.
    Sets,
}

/// nf_tables as the nftables backend uses it: atomic transactions on our table of one family
/// (`ip switchyard`, `ip6 switchyard`) and reads of it.
///
/// # Guarantees (of every implementation)
/// - [`NfTables::apply`] commits the whole batch or nothing; a refusal names the failing message.
/// - Reads see every transaction applied before them.
pub trait NfTables: std::fmt::Debug + Send {
    /// Commits `batch` atomically (an empty batch is a no-op).
    fn apply(&mut self, batch: Batch) -> KernelResult<()>;
    /// The names of `objects` in our table of `family`; empty when the table is absent.
    fn list(&self, family: IpFamily, objects: Objects) -> KernelResult<Vec<String>>;
    /// Whether our table of `family` exists.
    fn table_exists(&self, family: IpFamily) -> KernelResult<bool>;
    /// Whether any rule of our table of `family` carries `comment`.
    fn rule_comment_exists(&self, family: IpFamily, comment: &str) -> KernelResult<bool>;
}

/// The kernel's nf_tables, over netlink: one [`Session`] per family, in the network namespace of
/// the thread that first applies a batch.
#[derive(Debug, Default)]
pub struct KernelNft {
    sessions: [Session; 2],
}

impl NfTables for KernelNft {
    fn apply(&mut self, batch: Batch) -> KernelResult<()> {
        let family = batch.family();
        self.sessions[family as usize].apply(batch)?
    }

    fn list(&self, family: IpFamily, objects: Objects) -> KernelResult<Vec<String>> {
        let msg = match objects {
            Objects::Chains => Msg::GetChain,
            Objects::Sets => Msg::GetSet,
        };
        Ok(list(family, msg)?)
    }

    fn table_exists(&self, family: IpFamily) -> KernelResult<bool> {
        Ok(table_exists(family)?)
    }

    fn rule_comment_exists(&self, family: IpFamily, comment: &str) -> KernelResult<bool> {
        Ok(rules_contain(family, comment.as_bytes())?)
    }
}

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFT_TABLE_F_DORMANT: u32 = 1;
/// `NFPROTO_INET`.
pub const NFPROTO_INET: u8 = 1;
const NETLINK_NETFILTER: isize = 12;

/// The 4-byte `nfgenmsg` header.
fn nfgenmsg(family: u8, res_id: u16) -> [u8; 4] {
    let id = res_id.to_be_bytes();
    [family, 0, id[0], id[1]]
}

fn nft_kind(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

/// Wraps `messages` (already carrying sequence numbers `1..`) in a batch begin/end pair.
fn batch(messages: Vec<Vec<u8>>, last_seq: u32) -> Vec<u8> {
    let mut out = MessageBuilder::new(
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        0,
        &nfgenmsg(0, NFNL_SUBSYS_NFTABLES),
    )
    .finish();
    for m in messages {
        out.extend_from_slice(&m);
    }
    out.extend(
        MessageBuilder::new(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            last_seq + 1,
            &nfgenmsg(0, NFNL_SUBSYS_NFTABLES),
        )
        .finish(),
    );
    out
}

/// Creates a dormant table `name` and deletes it again, each in its own transaction. Returns
/// `Ok(None)` when the kernel accepted both, `Ok(Some(reason))` when it refused.
pub fn try_throwaway_table(name: &str) -> Result<Option<String>> {
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let create = MessageBuilder::new(
        nft_kind(NFT_MSG_NEWTABLE),
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE,
        1,
        &nfgenmsg(NFPROTO_INET, 0),
    )
    .attr_str(NFTA_TABLE_NAME, name)
    .attr_u32_be(NFTA_TABLE_FLAGS, NFT_TABLE_F_DORMANT)
    .finish();
    if let Some(reason) = first_error(&transport, batch(vec![create], 1), 1, "create table")? {
        return Ok(Some(reason));
    }
    let delete = MessageBuilder::new(
        nft_kind(NFT_MSG_DELTABLE),
        NLM_F_REQUEST | NLM_F_ACK,
        1,
        &nfgenmsg(NFPROTO_INET, 0),
    )
    .attr_str(NFTA_TABLE_NAME, name)
    .finish();
    first_error(&transport, batch(vec![delete], 1), 1, "delete table")
}

fn first_error(transport: &Transport, request: Vec<u8>, seq: u32, what: &str) -> Result<Option<String>> {
    let replies = transport.request(&request, &[seq])?;
    Ok(replies
        .iter()
        .find_map(|r| r.error.filter(|e| *e != 0))
        .map(|errno| format!("{what}: {}", std::io::Error::from_raw_os_error(-errno))))
}

/// Sends a whole nf_tables transaction (one batch) and returns the kernel's first refusal, if any.
/// The socket buffers are sized for the batch so that large transactions stay atomic.
pub fn apply(batch: Batch) -> Result<KernelResult<()>> {
    Session::default().apply(batch)
}

/// An nf_tables socket kept open across transactions: closing one makes the kernel first finish
/// destroying what the last transaction deleted (`nft_rcv_nl_event` flushes the destroy work, which
/// waits for an RCU grace period: 5–15 ms measured), a wait every element-deleting sync would pay.
/// The socket belongs to the network namespace of the thread that first applies a batch.
#[derive(Debug, Default)]
pub struct Session {
    transport: Option<Transport>,
}

impl Session {
    /// Like [`apply`], on this session's socket.
    pub fn apply(&mut self, batch: Batch) -> Result<KernelResult<()>> {
        if batch.is_empty() {
            return Ok(Ok(()));
        }
        let transport = match self.transport.take() {
            Some(t) => t,
            None => Transport::open(NETLINK_NETFILTER)?,
        };
        let outcome = send_batch(&transport, batch);
        // After a refusal or an error the kernel may still have replies queued: start afresh.
        if matches!(outcome, Ok(Ok(()))) {
            self.transport = Some(transport);
        }
        outcome
    }
}

fn send_batch(transport: &Transport, batch: Batch) -> Result<KernelResult<()>> {
    let (bytes, acks) = batch.finish();
    transport.size_buffers(bytes.len() + 4096, 4 << 20)?;
    let replies = transport.request(&bytes, &acks)?;
    Ok(match replies.iter().find(|r| r.error.is_some_and(|e| e != 0)) {
        Some(r) => Err(KernelError::from_errno(
            format!(
                "nf_tables message {} of {}",
                r.seq,
                acks.last().copied().unwrap_or_default()
            ),
            r.error.unwrap_or_default(),
        )),
        None => Ok(()),
    })
}

/// Names of objects in our table of `family` from a dump (`GETCHAIN` or `GETSET`); empty if the
/// table is absent.
pub fn list(family: IpFamily, msg: Msg) -> Result<Vec<String>> {
    use codec as encode;
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let replies = transport.dump(&encode::dump_request(family, msg, 1))?;
    let parse = if msg == encode::Msg::GetSet {
        encode::set_name
    } else {
        encode::chain_name
    };
    Ok(replies
        .iter()
        .filter(|r| r.error.is_none())
        .filter_map(|r| parse(&r.payload))
        .collect())
}

/// Whether any rule of our table of `family` carries `needle` in its attributes (for example a
/// comment in its user data).
pub fn rules_contain(family: IpFamily, needle: &[u8]) -> Result<bool> {
    use codec as encode;
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let replies = transport.dump(&encode::dump_request(family, encode::Msg::GetRule, 1))?;
    Ok(replies
        .iter()
        .filter(|r| r.error.is_none())
        .any(|r| r.payload.windows(needle.len()).any(|w| w == needle)))
}

/// The elements with `keys` of our set or map `set`, as the kernel answers a `GETSETELEM` for
/// them (one payload per element, its key and value attributes inside); `None` when any of them
/// is missing (or the set is). One request, no listing of the table: it costs the same at any
/// table size (the API benchmark polls with it).
pub fn get_elements(family: IpFamily, set: &str, keys: &[ir::Key]) -> Result<Option<Vec<Vec<u8>>>> {
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let replies = transport.request(&codec::get_elements_request(family, set, keys, 1), &[1])?;
    if replies.iter().any(|r| r.error.is_some_and(|e| e != 0)) {
        return Ok(None);
    }
    Ok(Some(
        replies
            .into_iter()
            .filter(|r| r.error.is_none())
            .map(|r| r.payload)
            .collect(),
    ))
}

/// Whether our table of `family` exists.
pub fn table_exists(family: IpFamily) -> Result<bool> {
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let replies = transport.request(&codec::get_table_request(family, 1), &[1])?;
    Ok(!replies.iter().any(|r| r.error.is_some_and(|e| e != 0)))
}

/// Whether another component's table `name` exists in `family` (read only: used to see
/// kube-proxy serve a node handed to it).
pub fn other_table_exists(family: u8, name: &str) -> Result<bool> {
    let transport = Transport::open(NETLINK_NETFILTER)?;
    other_table_exists_on(&transport, family, name)
}

fn other_table_exists_on(transport: &Transport, family: u8, name: &str) -> Result<bool> {
    let get = MessageBuilder::new(
        nft_kind(1 /* NFT_MSG_GETTABLE */),
        NLM_F_REQUEST | NLM_F_ACK,
        1,
        &nfgenmsg(family, 0),
    )
    .attr_str(NFTA_TABLE_NAME, name)
    .finish();
    Ok(!transport
        .request(&get, &[1])?
        .iter()
        .any(|r| r.error.is_some_and(|e| e != 0)))
}

/// The rules of another component's chain `chain` in table `table` and the elements of the
/// anonymous sets and maps they read (a rule dump of that one chain, then an element dump of each
/// `__map`/`__set` it names), as raw attribute bytes; `None` when a dump fails (the chain or
/// table is gone). Read only: the API benchmark sees kube-proxy's nftables service chain (an
/// inline `dnat to`, or a `numgen … map` of targets) serve an endpoint without any `nft` command,
/// which would read the whole table first.
pub fn other_chain_bytes(family: u8, table: &str, chain: &str) -> Result<Option<ChainBytes>> {
    const NFT_MSG_GETRULE: u16 = 7;
    const NFT_MSG_GETSETELEM: u16 = 13;
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let dump = |msg: u16, object: &str| {
        // NFTA_RULE_TABLE / NFTA_SET_ELEM_LIST_TABLE (1), NFTA_RULE_CHAIN / ..._LIST_SET (2).
        let request = MessageBuilder::new(
            nft_kind(msg),
            NLM_F_REQUEST | codec::NLM_F_DUMP,
            1,
            &nfgenmsg(family, 0),
        )
        .attr_str(1, table)
        .attr_str(2, object)
        .finish();
        let replies = transport.dump(&request)?;
        Ok::<_, crate::Error>(
            (!replies.iter().any(|r| r.error.is_some_and(|e| e != 0)))
                .then(|| replies.into_iter().map(|r| r.payload).collect::<Vec<_>>()),
        )
    };
    let Some(rules) = dump(NFT_MSG_GETRULE, chain)? else {
        return Ok(None);
    };
    let mut elements = Vec::new();
    for set in rules.iter().flat_map(|r| anonymous_set_names(r)) {
        match dump(NFT_MSG_GETSETELEM, &set)? {
            Some(found) => elements.extend(found),
            None => return Ok(None),
        }
    }
    Ok(Some(ChainBytes { rules, elements }))
}

/// The ruleset generation of the current network namespace (`NFT_MSG_GETGEN`): it changes with
/// every committed nftables transaction (any table, iptables-nft's included). Read only: the API
/// benchmark polls it to time a commit to its poll period, then lists the table once per change.
pub fn generation() -> KernelResult<u32> {
    const NFT_MSG_GETGEN: u16 = 16;
    const NFT_MSG_NEWGEN: u16 = 15;
    const NFTA_GEN_ID: u16 = 1;
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let request = MessageBuilder::new(
        nft_kind(NFT_MSG_GETGEN),
        NLM_F_REQUEST | NLM_F_ACK,
        1,
        &nfgenmsg(0, 0),
    )
    .finish();
    let replies = transport.request(&request, &[1])?;
    replies
        .iter()
        .filter(|r| r.kind == nft_kind(NFT_MSG_NEWGEN))
        .find_map(|r| attr(r.payload.get(4..)?, NFTA_GEN_ID))
        .and_then(|v| Some(u32::from_be_bytes(v.try_into().ok()?)))
        .ok_or_else(|| KernelError::Malformed {
            what: "the ruleset generation (NFT_MSG_GETGEN)".into(),
        })
}

/// The payload of the first netlink attribute of `kind` in `attrs`.
fn attr(mut attrs: &[u8], kind: u16) -> Option<&[u8]> {
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let this = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if this == kind {
            return Some(&attrs[4..len]);
        }
        attrs = &attrs[(len + 3) & !3..];
    }
    None
}

/// What [`other_chain_bytes`] read: one payload per rule and per anonymous-set element.
#[derive(Debug, Clone, Default)]
pub struct ChainBytes {
    /// The chain's rules.
    pub rules: Vec<Vec<u8>>,
    /// The elements of the anonymous sets and maps they read.
    pub elements: Vec<Vec<u8>>,
}

/// The anonymous set names (`__map<N>`, `__set<N>`, NUL-terminated attributes) in a rule's bytes.
fn anonymous_set_names(rule: &[u8]) -> Vec<String> {
    let mut names = Vec::new();
    for start in 0..rule.len() {
        let rest = &rule[start..];
        if !(rest.starts_with(b"__map") || rest.starts_with(b"__set")) {
            continue;
        }
        let digits = rest[5..].iter().take_while(|b| b.is_ascii_digit()).count();
        if digits > 0 && rest.get(5 + digits) == Some(&0) {
            names.push(String::from_utf8_lossy(&rest[..5 + digits]).into_owned());
        }
    }
    names
}

/// Deletes another component's table `name` in `family` (used only to take over from
/// kube-proxy). Returns whether it existed.
pub fn delete_table_if_present(family: u8, name: &str) -> Result<bool> {
    let transport = Transport::open(NETLINK_NETFILTER)?;
    if !other_table_exists_on(&transport, family, name)? {
        return Ok(false);
    }
    let delete = MessageBuilder::new(
        nft_kind(NFT_MSG_DELTABLE),
        NLM_F_REQUEST | NLM_F_ACK,
        1,
        &nfgenmsg(family, 0),
    )
    .attr_str(NFTA_TABLE_NAME, name)
    .finish();
    match first_error(&transport, batch(vec![delete], 1), 1, "delete table")? {
        None => Ok(true),
        Some(reason) => Err(crate::Error::Config(reason)),
    }
}

#[cfg(test)]
mod tests {
    use super::attr;

    #[test]
    fn attr_finds_its_kind_past_padding_and_stops_at_malformed_lengths() {
        // kind 2 with 3 bytes (padded to 8), then kind 1 with a u32.
        let attrs = [7, 0, 2, 0, b'a', b'b', 0, 0, 8, 0, 1, 0, 0, 0, 1, 44];
        assert_eq!(attr(&attrs, 1), Some(&[0, 0, 1, 44][..]));
        assert_eq!(attr(&attrs, 2), Some(&b"ab\0"[..]));
        assert_eq!(attr(&attrs, 3), None);
        // A length past the end, or below the header's own, ends the walk.
        assert_eq!(attr(&[9, 0, 1, 0, 0, 0, 0, 0], 1), None);
        assert_eq!(attr(&[2, 0, 1, 0, 0, 0, 0, 0], 1), None);
    }
}
