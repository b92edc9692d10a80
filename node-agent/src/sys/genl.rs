//! Generic netlink: family resolution (the IPVS probe). The IPVS backend's commands build on it.

use super::{
    error::{KernelError, KernelResult},
    netlink::{MessageBuilder, NLM_F_ACK, NLM_F_REQUEST, Transport},
};

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NETLINK_GENERIC: isize = 16;

/// Resolves a generic-netlink family by name; [`KernelError::NotFound`] when the kernel does not
/// know it (module not loaded or not built).
pub fn resolve_family(name: &str) -> KernelResult<u16> {
    let what = || format!("generic netlink family {name}");
    let transport = Transport::open(NETLINK_GENERIC)?;
    let request = MessageBuilder::new(
        GENL_ID_CTRL,
        NLM_F_REQUEST | NLM_F_ACK,
        1,
        &[CTRL_CMD_GETFAMILY, 1, 0, 0],
    )
    .attr_str(CTRL_ATTR_FAMILY_NAME, name)
    .finish();
    let replies = transport.request(&request, &[1])?;
    if let Some(errno) = replies.iter().find_map(|r| r.error.filter(|e| *e != 0)) {
        return Err(KernelError::from_errno(what(), errno));
    }
    let id = replies
        .iter()
        .filter(|r| r.kind == GENL_ID_CTRL)
        .find_map(|r| find_attr(r.payload.get(4..).unwrap_or_default(), CTRL_ATTR_FAMILY_ID))
        .and_then(|v| v.get(0..2).map(|b| u16::from_ne_bytes([b[0], b[1]])));
    id.ok_or_else(|| KernelError::Malformed { what: what() })
}

/// Finds the payload of the first top-level attribute of `kind`; malformed input yields `None`.
pub fn find_attr(mut attrs: &[u8], kind: u16) -> Option<&[u8]> {
    while attrs.len() >= 4 {
        let len = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
        let k = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if k == kind {
            return Some(&attrs[4..len]);
        }
        attrs = &attrs[((len + 3) & !3).min(attrs.len())..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_resolve_to_their_id_or_not_found() {
        // The controller family always exists, with its fixed id; no root needed.
        assert_eq!(resolve_family("nlctrl").expect("nlctrl"), GENL_ID_CTRL);
        let missing = resolve_family("SWY_NO_SUCH").expect_err("no such family");
        assert!(missing.is_not_found(), "{missing:?}");
        assert_eq!(
            missing.to_string(),
            "generic netlink family SWY_NO_SUCH: no such object"
        );
    }

    #[test]
    fn find_attr_walks_padded_attributes_and_rejects_garbage() {
        let attrs = [6, 0, 2, 0, b'x', 0, 0, 0, 6, 0, 1, 0, 0x2a, 0, 0, 0];
        assert_eq!(find_attr(&attrs, 1), Some(&[0x2a, 0][..]));
        assert_eq!(find_attr(&attrs, 9), None);
        assert_eq!(find_attr(&[200, 0, 1, 0], 1), None);
    }
}
