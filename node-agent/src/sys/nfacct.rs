//! Extended accounting objects (`nfnetlink_acct`, the `-m nfacct` match): named packet counters
//! that live in the network namespace, independent of the rules that count into them, so an
//! `iptables-restore` that rewrites a chain keeps the count. kube-proxy's iptables mode counts its
//! conntrack-invalid drops and its localhost NodePort packets this way; the agent uses the same
//! names and reads them for the same metrics and for the migration preflight.

use std::os::fd::AsFd;

use super::{
    error::{EBUSY, KernelError, KernelResult},
    genl::find_attr,
    netlink::{MessageBuilder, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, Transport},
};

/// kube-proxy's counter of the conntrack-invalid drop rule (`kubeproxy_iptables_ct_state_invalid_dropped_packets_total`).
pub const CT_STATE_INVALID_DROPPED: &str = "ct_state_invalid_dropped_pkts";
/// kube-proxy's counter of packets to NodePorts on `127.0.0.1` (`kubeproxy_iptables_localhost_nodeports_accepted_packets_total`).
pub const LOCALHOST_NODEPORTS_ACCEPTED: &str = "localhost_nps_accepted_pkts";

const NETLINK_NETFILTER: isize = 12;
const NFNL_SUBSYS_ACCT: u16 = 7;
const NFNL_MSG_ACCT_NEW: u16 = 0;
const NFNL_MSG_ACCT_GET: u16 = 1;
const NFACCT_NAME: u16 = 1;
const NFACCT_PKTS: u16 = 2;
/// `nfgenmsg`: AF_UNSPEC, NFNETLINK_V0, resource id 0.
const NFGEN: [u8; 4] = [0, 0, 0, 0];

/// The names an `iptables-restore` input counts into (`--nfacct-name NAME`), which must exist
/// before the restore (the match refuses an unknown name).
pub fn names_in(input: &str) -> Vec<&str> {
    let mut names: Vec<&str> = input
        .lines()
        .filter(|l| l.contains("--nfacct-name"))
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "--nfacct-name")?;
            words.next()
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// `input` without the `-m nfacct --nfacct-name NAME` matches of `names` (counters this kernel
/// cannot create): the rules stay, uncounted.
pub fn without(input: &str, names: &[&str]) -> String {
    let mut out = input.to_owned();
    for name in names {
        for spelling in [
            format!(" -m nfacct --nfacct-name  {name}"),
            format!(" -m nfacct --nfacct-name {name}"),
        ] {
            out = out.replace(&spelling, "");
        }
    }
    out
}

/// Logs, once per agent, that counter `name` cannot be created (the rules then go uncounted).
pub fn warn_once(name: &str, error: &KernelError) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(counter = name, error = %error, "cannot create nfacct counter; its rule counts nothing (no preflight facts from it)");
    }
}

/// Creates the counter `name` unless it exists (an existing one keeps its count).
pub fn ensure(name: &str) -> KernelResult<()> {
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let request = MessageBuilder::new(
        (NFNL_SUBSYS_ACCT << 8) | NFNL_MSG_ACCT_NEW,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE,
        1,
        &NFGEN,
    )
    .attr_str(NFACCT_NAME, name)
    .finish();
    let replies = transport.request(&request, &[1])?;
    match replies.iter().find_map(|r| r.error.filter(|e| *e != 0)) {
        // The kernel answers EBUSY for a name that exists (without NLM_F_REPLACE, which would zero it).
        Some(errno) if errno.abs() == EBUSY => Ok(()),
        Some(errno) => Err(KernelError::from_errno(format!("nfacct object {name}"), errno)),
        None => Ok(()),
    }
}

/// The packets counted by `name`; [`KernelError::NotFound`] when no such counter exists.
pub fn packets(name: &str) -> KernelResult<u64> {
    let what = || format!("nfacct object {name}");
    let transport = Transport::open(NETLINK_NETFILTER)?;
    let request = MessageBuilder::new(
        (NFNL_SUBSYS_ACCT << 8) | NFNL_MSG_ACCT_GET,
        NLM_F_REQUEST | NLM_F_ACK,
        1,
        &NFGEN,
    )
    .attr_str(NFACCT_NAME, name)
    .finish();
    let replies = transport.request(&request, &[1])?;
    if let Some(errno) = replies.iter().find_map(|r| r.error.filter(|e| *e != 0)) {
        return Err(KernelError::from_errno(what(), errno));
    }
    replies
        .iter()
        .filter(|r| r.kind == (NFNL_SUBSYS_ACCT << 8) | NFNL_MSG_ACCT_NEW)
        .find_map(|r| find_attr(r.payload.get(NFGEN.len()..).unwrap_or_default(), NFACCT_PKTS))
        .and_then(|v| v.get(0..8))
        .map(|b| u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
        .ok_or_else(|| KernelError::Malformed { what: what() })
}

/// Runs `f` in the named network namespace `netns` (on a thread that enters it), or here.
pub fn in_netns<T: Send>(netns: Option<&str>, f: impl FnOnce() -> KernelResult<T> + Send) -> KernelResult<T> {
    let Some(ns) = netns else {
        return f();
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            let what = || format!("network namespace {ns}");
            let file = std::fs::File::open(format!("/run/netns/{ns}")).map_err(|e| {
                KernelError::from_errno(what(), e.raw_os_error().unwrap_or(super::error::EIO))
            })?;
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| KernelError::from_errno(what(), e as i32))?;
            f()
        })
        .join()
        .unwrap_or_else(|_| {
            Err(KernelError::Malformed {
                what: format!("nfacct thread in {ns}"),
            })
        })
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn names_in_finds_each_counted_name_once() {
        let input = "*filter\n-A SWY-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP\n-A X -m nfacct --nfacct-name a\n-A Y -m nfacct --nfacct-name a\n-A Z -j ACCEPT\nCOMMIT\n";
        assert_eq!(names_in(input), ["a", CT_STATE_INVALID_DROPPED]);
        assert!(names_in("-A Z --nfacct-name").is_empty());
    }

    #[test]
    fn without_drops_only_the_count_of_the_names_given() {
        let input = "-A F -m conntrack --ctstate INVALID -m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP\n-A G -m nfacct --nfacct-name other\n";
        assert_eq!(
            without(input, &[CT_STATE_INVALID_DROPPED]),
            "-A F -m conntrack --ctstate INVALID -j DROP\n-A G -m nfacct --nfacct-name other\n"
        );
        assert_eq!(without(input, &[]), input);
    }

    /// On the kernel, in a fresh network namespace of a thread (root only; skipped otherwise).
    #[test]
    fn counters_are_created_once_and_read_back() {
        std::thread::spawn(|| {
            // Only root may create a network namespace: nothing to check otherwise.
            if nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                return;
            }
            assert!(packets("swy_test").unwrap_err().is_not_found());
            ensure("swy_test").unwrap();
            ensure("swy_test").unwrap();
            assert_eq!(packets("swy_test").unwrap(), 0);
        })
        .join()
        .unwrap();
    }
}
