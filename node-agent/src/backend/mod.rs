//! The backend trait: one per data plane (nftables, iptables, later IPVS). Each backend renders a
//! [`Snapshot`] into its desired kernel state with a pure function, then syncs it, verifies it and
//! can clean up everything it owns.
//!
//! # Guarantees every backend gives
//! - It owns only its own kernel objects (nft table `switchyard`; iptables chains `SWY-*`; ipsets
//!   `SWY-*`; IPVS services on its own addresses and the dummy link `swy-ipvs0`) and never modifies
//!   anything else.
//! - After `sync` returns `Ok`, the kernel state for the objects it owns equals the render of the
//!   snapshot. A partial sync (`full == false`) touches only the services in `changes` and the shared
//!   dispatch objects; on any error the next sync must be full.
//! - `cleanup` removes everything it owns, is idempotent, and succeeds when nothing was ever
//!   programmed.
//! - Syncing never flushes a path that stays: rules of unchanged services keep serving during a sync
//!   (transactions are atomic), so established and new connections are not interrupted.

pub mod names;
pub mod nftables;
pub mod iptables;
pub mod ipvs;
#[cfg(test)]
mod sctp_vm_tests;
#[cfg(test)]
mod vm_support;

use crate::model::{Changes, DualSnapshot, IpFamily, IpNet, NodeInfo};

/// Proxy-wide settings a backend renders with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The node (name, addresses, zone).
    pub node: NodeInfo,
    /// Pod CIDRs of the cluster, at most one per family; traffic from outside them to ClusterIPs
    /// is masqueraded.
    pub cluster_cidrs: Vec<IpNet>,
    /// Masquerade all service traffic.
    pub masquerade_all: bool,
    /// NodePort addresses: `None` = every local address; otherwise these addresses (both
    /// families; each family's rules use its own).
    pub node_port_addresses: Option<Vec<std::net::IpAddr>>,
    /// The fwmark bit used to request masquerade.
    pub masquerade_mark: u32,
    /// IPVS mode: scheduler, strictARP, excluded CIDRs.
    pub ipvs: ipvs::IpvsOptions,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            node: NodeInfo::default(),
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            node_port_addresses: None,
            masquerade_mark: 0x4000,
            ipvs: ipvs::IpvsOptions::default(),
        }
    }
}

impl Settings {
    /// The cluster CIDR of `family`, if configured.
    pub fn cluster_cidr(&self, family: IpFamily) -> Option<IpNet> {
        self.cluster_cidrs.iter().copied().find(|n| IpFamily::of_net(n) == family)
    }

    /// The NodePort addresses of `family`: `None` for every local address, which is also what a
    /// family gets when the configured list has none of its addresses (as kube-proxy's
    /// `nodePortAddresses` falls back per family), so a Node listing only an IPv4 InternalIP still
    /// serves NodePorts over IPv6.
    pub fn node_port_addresses(&self, family: IpFamily) -> Option<Vec<std::net::IpAddr>> {
        let of_family: Vec<std::net::IpAddr> =
            self.node_port_addresses.as_ref()?.iter().copied().filter(|a| family.holds(a)).collect();
        (!of_family.is_empty()).then_some(of_family)
    }
}

/// What a sync did, for metrics and NodeProxy status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Whether it was a full sync.
    pub full: bool,
    /// Service ports programmed.
    pub services: usize,
    /// Endpoints programmed.
    pub endpoints: usize,
    /// Kernel objects written in this sync (rules, elements, chains).
    pub objects_written: usize,
    /// Rules (or equivalent) in the whole desired state.
    pub rules_total: usize,
}

impl SyncStats {
    /// The stats of two syncs of one backend (e.g. its two families) as one: full only if both were.
    pub fn plus(&self, other: &SyncStats) -> SyncStats {
        SyncStats {
            full: self.full && other.full,
            services: self.services + other.services,
            endpoints: self.endpoints + other.endpoints,
            objects_written: self.objects_written + other.objects_written,
            rules_total: self.rules_total + other.rules_total,
        }
    }
}

/// A reject a client sees at once, used ahead of kube-proxy's ICMP port unreachable for the one
/// protocol of each family where that is slow:
/// - IPv6 TCP gets a reset: an ICMPv6 port unreachable that answers a SYN while the connecting
///   socket is locked is dropped (`TcpExtLockDroppedIcmps`), so the refusal would wait for the SYN
///   retransmission a second later.
/// - IPv4 SCTP gets ICMP protocol unreachable, which SCTP handles as an ABORT of the starting
///   association (RFC 4960 appendix C); port unreachable is only a soft error to SCTP, and the
///   client would retry INIT for minutes. (ICMPv6 offers no such code to reject with.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastReject {
    /// TCP reset.
    TcpReset,
    /// ICMP protocol unreachable.
    ProtocolUnreachable,
}

/// The protocol of `family` that gets a [`FastReject`], and which.
pub fn fast_reject(family: IpFamily) -> (crate::model::Protocol, FastReject) {
    match family {
        IpFamily::V4 => (crate::model::Protocol::Sctp, FastReject::ProtocolUnreachable),
        IpFamily::V6 => (crate::model::Protocol::Tcp, FastReject::TcpReset),
    }
}

/// How a backend treats the sync results of one family. IPv4 must always work. IPv6 is optional
/// until it has worked once: on a node without IPv6 (no `ip6tables`, IPv6 disabled) its failures
/// are logged once and the node serves IPv4, as kube-proxy runs single-stack there; once IPv6 has
/// synced, its failures are errors like IPv4's.
#[derive(Debug, Default)]
pub struct FamilyResults {
    synced_once: bool,
    warned: bool,
}

impl FamilyResults {
    /// Passes on `result` of a sync of `family`, or turns a tolerated IPv6 failure into empty stats.
    pub fn check(&mut self, family: IpFamily, result: Result<SyncStats, BackendError>) -> Result<SyncStats, BackendError> {
        match result {
            Ok(stats) => {
                self.synced_once = true;
                self.warned = false;
                Ok(stats)
            }
            Err(e) if family == IpFamily::V6 && !self.synced_once => {
                if !self.warned {
                    tracing::warn!(error = %e, "IPv6 rules could not be programmed on this node; serving IPv4 only, retrying with every sync");
                    self.warned = true;
                }
                Ok(SyncStats::default())
            }
            Err(e) => Err(e),
        }
    }
}

/// Errors of backends.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The kernel refused a transaction.
    #[error("{backend}: kernel refused the transaction: {detail}")]
    Kernel {
        /// Backend name.
        backend: &'static str,
        /// What the kernel said.
        detail: String,
    },
    /// A userspace tool failed.
    #[error("{backend}: {command} failed: {detail}")]
    Command {
        /// Backend name.
        backend: &'static str,
        /// The command.
        command: String,
        /// Its stderr.
        detail: String,
    },
    /// Netlink transport.
    #[error(transparent)]
    Agent(#[from] crate::Error),
    /// The backend cannot do this.
    #[error("{backend}: {what} is not supported")]
    Unsupported {
        /// Backend name.
        backend: &'static str,
        /// What was asked.
        what: &'static str,
    },
}

/// A service-proxy data plane.
pub trait Backend: Send {
    /// The mode this backend implements.
    fn mode(&self) -> switchyard_crds::v1alpha1::ProxyMode;
    /// Programs `snapshot` (both families); `full` rewrites everything, otherwise only `changes`
    /// and shared objects.
    fn sync(&mut self, snapshot: &DualSnapshot, changes: &Changes, full: bool) -> Result<SyncStats, BackendError>;
    /// Removes every kernel object this backend owns. Idempotent.
    fn cleanup(&mut self) -> Result<(), BackendError>;
    /// The rendered desired state as text (nft syntax, iptables-save syntax), for `--render`.
    fn render_text(&self, snapshot: &DualSnapshot) -> String;
    /// Turns the backend's entry points off (`true`: its objects stay programmed but no packet
    /// enters them) or on, in one atomic step. Survives later syncs. This is the switch's
    /// cut-over primitive: un-bypass the new backend, then bypass the old one.
    fn set_bypass(&mut self, bypassed: bool) -> Result<(), BackendError> {
        let _ = bypassed;
        Err(BackendError::Unsupported { backend: "backend", what: "bypass" })
    }
    /// Reads the kernel back and describes every difference from what the last sync programmed
    /// (empty: no drift).
    fn verify(&self) -> Result<Vec<String>, BackendError> {
        Ok(Vec::new())
    }
}

/// Builds the backend for `mode` (the operator only asks for modes the node reports as supported;
/// IPVS mode uses the iptables `variant` for its few rules).
pub fn new_backend(mode: switchyard_crds::v1alpha1::ProxyMode, settings: Settings, iptables_variant: &str) -> Box<dyn Backend> {
    use switchyard_crds::v1alpha1::ProxyMode;
    let variant = if iptables_variant == "nft" { crate::sys::iptables::Variant::Nft } else { crate::sys::iptables::Variant::Legacy };
    match mode {
        ProxyMode::Nftables => Box::new(nftables::NftablesBackend::new(settings)),
        ProxyMode::Iptables => Box::new(iptables::IptablesBackend::new(variant, settings)),
        ProxyMode::Ipvs => Box::new(ipvs::IpvsBackend::new(variant, settings)),
    }
}

/// Removes everything Switchyard owns in every backend and variant; collects every failure.
pub fn cleanup_all() -> Vec<BackendError> {
    let mut errors = Vec::new();
    let mut backends: Vec<Box<dyn Backend>> = vec![Box::new(nftables::NftablesBackend::new(Settings::default()))];
    // IPVS first: its jump rules reference `SWY-IPVS-*` chains, which must be gone before the
    // iptables backend deletes `SWY-*` chains.
    for variant in [crate::sys::iptables::Variant::Legacy, crate::sys::iptables::Variant::Nft] {
        backends.push(Box::new(ipvs::IpvsBackend::new(variant, Settings::default())));
    }
    for variant in [crate::sys::iptables::Variant::Legacy, crate::sys::iptables::Variant::Nft] {
        backends.push(Box::new(iptables::IptablesBackend::new(variant, Settings::default())));
    }
    for mut b in backends {
        if let Err(e) = b.cleanup() {
            errors.push(e);
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> Result<SyncStats, BackendError> {
        Err(BackendError::Command { backend: "test", command: "ip6tables-restore".into(), detail: "not found".into() })
    }

    #[test]
    fn ipv6_failures_are_tolerated_only_until_ipv6_has_worked() {
        let mut v4 = FamilyResults::default();
        assert!(v4.check(IpFamily::V4, failure()).is_err(), "IPv4 must always work");
        let mut v6 = FamilyResults::default();
        assert_eq!(v6.check(IpFamily::V6, failure()).ok(), Some(SyncStats::default()), "a node without IPv6 serves IPv4");
        assert!(v6.check(IpFamily::V6, failure()).is_ok());
        let stats = SyncStats { full: true, services: 3, ..Default::default() };
        assert_eq!(v6.check(IpFamily::V6, Ok(stats.clone())).ok(), Some(stats));
        assert!(v6.check(IpFamily::V6, failure()).is_err(), "once IPv6 worked, its failures are errors");
    }
}
