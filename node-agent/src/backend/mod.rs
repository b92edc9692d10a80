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

#[cfg(test)]
pub(crate) mod conformance;
pub mod external;
pub mod iptables;
pub mod ipvs;
pub mod names;
pub mod nftables;
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
    /// Where NodePorts are served, per family.
    pub node_port_addresses: NodePortIps,
    /// The fwmark bit used to request masquerade.
    pub masquerade_mark: u32,
    /// IPVS mode: scheduler, strictARP, excluded CIDRs, connection timeouts.
    pub ipvs: ipvs::IpvsOptions,
    /// iptables mode: serve IPv4 NodePorts on `127.0.0.1` too, as kube-proxy's
    /// `--iptables-localhost-nodeports` (default on): `route_localnet=1` plus a guard rule dropping
    /// martian localnet traffic from outside. Off, such connections are refused at once.
    pub localhost_node_ports: bool,
    /// nftables mode: serve IPv4 NodePorts on `127.0.0.1` too (`--nftables-localhost-nodeports`,
    /// default off as kube-proxy's nftables mode, which does not serve them): a DNAT of
    /// `127.0.0.0/8` destinations in the output path (node-local clients only), masqueraded, with
    /// `route_localnet=1` and a guard rule dropping new connections to `127.0.0.0/8` from
    /// elsewhere. Off, nothing matches loopback: such connections are refused at once.
    pub nftables_localhost_node_ports: bool,
    /// The cluster's Service CIDRs (at most a few per family). nftables mode drops traffic to an
    /// address in them that is no ClusterIP it handles, as kube-proxy's `cluster-ips-check`.
    pub service_cidrs: Vec<IpNet>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            node: NodeInfo::default(),
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            node_port_addresses: NodePortIps::default(),
            masquerade_mark: 0x4000,
            ipvs: ipvs::IpvsOptions::default(),
            localhost_node_ports: true,
            nftables_localhost_node_ports: false,
            service_cidrs: Vec::new(),
        }
    }
}

impl Settings {
    /// The cluster CIDR of `family`, if configured.
    pub fn cluster_cidr(&self, family: IpFamily) -> Option<IpNet> {
        self.cluster_cidrs
            .iter()
            .copied()
            .find(|n| IpFamily::of_net(n) == family)
    }

    /// The NodePort addresses of `family`: `None` for every local address.
    pub fn node_port_addresses(&self, family: IpFamily) -> Option<Vec<std::net::IpAddr>> {
        self.node_port_addresses
            .of(family)
            .map(<[std::net::IpAddr]>::to_vec)
    }
}

/// The addresses NodePorts are served on, per family; a family without an entry serves them on
/// every local address (as kube-proxy's `nodePortAddresses`, whose families without a CIDR match
/// everything), a family with an empty entry on none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePortIps {
    by_family: std::collections::BTreeMap<IpFamily, Vec<std::net::IpAddr>>,
}

impl NodePortIps {
    /// NodePorts on exactly `addresses` in their families, and on every address of a family none
    /// of them belongs to.
    pub fn of_addresses(addresses: &[std::net::IpAddr]) -> Self {
        let mut ips = Self::default();
        for a in addresses {
            ips.by_family.entry(IpFamily::of(a)).or_default().push(*a);
        }
        ips
    }

    /// Restricts `family`'s NodePorts to `addresses` (none when empty).
    pub fn restrict(&mut self, family: IpFamily, addresses: Vec<std::net::IpAddr>) {
        self.by_family.insert(family, addresses);
    }

    /// The addresses of `family`, or `None` for every local address.
    pub fn of(&self, family: IpFamily) -> Option<&[std::net::IpAddr]> {
        self.by_family.get(&family).map(Vec::as_slice)
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

/// How a backend treats the sync results of one family. IPv4 must always work. IPv6 failures are
/// tolerated only where IPv6 is unavailable — its tools are missing ([`BackendError::ToolMissing`])
/// or the network namespace has no IPv6 — so a node without IPv6 serves IPv4, as kube-proxy runs
/// single-stack there (logged once; retried with every sync). Anywhere else they are errors.
#[derive(Debug, Default)]
pub struct FamilyResults {
    warned: bool,
}

impl FamilyResults {
    /// Passes on `result` of a sync of `family`: `Ok(Some(stats))`, `Ok(None)` for a tolerated
    /// IPv6 failure (left out of the sync's stats), or the error.
    pub fn check(
        &mut self,
        family: IpFamily,
        result: Result<SyncStats, BackendError>,
    ) -> Result<Option<SyncStats>, BackendError> {
        match result {
            Ok(stats) => {
                self.warned = false;
                Ok(Some(stats))
            }
            Err(e)
                if family == IpFamily::V6
                    && (matches!(e, BackendError::ToolMissing { .. })
                        || !crate::sys::host::ipv6_enabled()) =>
            {
                if !self.warned {
                    tracing::warn!(error = %e, "IPv6 is unavailable on this node; serving IPv4 only, retrying with every sync");
                    self.warned = true;
                }
                Ok(None)
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
    /// A userspace tool is not installed (or cannot be started).
    #[error("{backend}: cannot run {command}: {detail}")]
    ToolMissing {
        /// Backend name.
        backend: &'static str,
        /// The command.
        command: String,
        /// Why it could not start.
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
    /// A kernel adapter refused or failed (typed: not found, exists, busy, refused with errno).
    #[error("{backend}: {source}")]
    Sys {
        /// Backend name.
        backend: &'static str,
        /// What the adapter said.
        #[source]
        source: crate::sys::KernelError,
    },
    /// Several independent steps failed (a cleanup goes on after a failure and reports every one).
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Many(Vec<BackendError>),
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

impl BackendError {
    /// The outcome of independent steps: `Ok` without failures, the failure itself for one,
    /// [`BackendError::Many`] for several.
    pub fn collect(errors: Vec<BackendError>) -> Result<(), BackendError> {
        let mut errors: Vec<BackendError> = errors.into_iter().flat_map(BackendError::into_errors).collect();
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(BackendError::Many(errors)),
        }
    }

    /// Every failure this error stands for.
    pub fn errors(&self) -> Vec<&BackendError> {
        match self {
            BackendError::Many(all) => all.iter().flat_map(BackendError::errors).collect(),
            one => vec![one],
        }
    }

    /// Every failure this error stands for, owned.
    pub fn into_errors(self) -> Vec<BackendError> {
        match self {
            BackendError::Many(all) => all.into_iter().flat_map(BackendError::into_errors).collect(),
            one => vec![one],
        }
    }
}

/// What of a backend the kernel holds, read back from the kernel (not from the backend's memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// None of its objects exist.
    Absent,
    /// Its objects exist, but its entry points are bypassed (no new connection enters them).
    Bypassed,
    /// Its objects exist and its entry points are open: it serves the node.
    Serving,
}

/// A service-proxy data plane.
///
/// # Guarantees
/// Every implementation gives these, and the conformance suite (`backend::conformance::suite`)
/// checks each of them against the backend's fake adapters and against the kernel:
/// - After `sync` returns `Ok`, the objects it owns equal the render of the snapshot; a partial
///   sync leaves exactly what a full sync of the same snapshot leaves (*full = partial*).
/// - After a failed `sync` the next one is full, whatever the caller asks: the caller has drained
///   its changes already (*failure → full resync*).
/// - A bypass (`set_bypass(true)`) holds through later partial and full syncs until lifted, and
///   [`Backend::presence`] reports it (*bypass survives sync*).
/// - [`Backend::verify`] finds no drift right after a successful sync (*verify empty after sync*).
/// - `cleanup` removes every object the backend owns and is idempotent (*cleanup twice leaves
///   nothing*), succeeds when nothing was programmed (*cleanup before sync*), and goes on after a
///   failing part (an IP family, a table), returning every failure ([`BackendError::Many`] for
///   several; *cleanup collects every error*).
///
/// # Assumptions
/// - The backend is the only writer of the objects it owns (see the module docs for which those
///   are); other components' objects are never touched and may change at any time.
/// - `sync` gets the whole current snapshot every time; `changes` names every service changed
///   since the last *successful* sync (a superset is fine), and is ignored on full syncs.
/// - Calls are serialised (`&mut self`) and made from threads in the network namespace the
///   backend programs.
/// - `cleanup` may be called at any time, also when `sync` never ran or a previous agent
///   programmed the kernel (it reads the kernel, not its memory).
pub trait Backend: Send {
    /// The mode this backend implements.
    fn mode(&self) -> switchyard_crds::v1alpha1::ProxyMode;
    /// Programs `snapshot` (both families); `full` rewrites everything, otherwise only `changes`
    /// and shared objects.
    fn sync(
        &mut self,
        snapshot: &DualSnapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError>;
    /// Removes every kernel object this backend owns. Idempotent.
    fn cleanup(&mut self) -> Result<(), BackendError>;
    /// The rendered desired state as text (nft syntax, iptables-save syntax), for `--render`.
    fn render_text(&self, snapshot: &DualSnapshot) -> String;
    /// Turns the backend's entry points off (`true`: its objects stay programmed but no packet
    /// enters them) or on, in one atomic step. Survives later syncs. This is the switch's
    /// cut-over primitive: un-bypass the new backend, then bypass the old one.
    fn set_bypass(&mut self, bypassed: bool) -> Result<(), BackendError> {
        let _ = bypassed;
        Err(BackendError::Unsupported {
            backend: "backend",
            what: "bypass",
        })
    }
    /// Reads the kernel (IPv4, which every backend programs) to say whether this backend's objects
    /// exist and serve. The driver asks this when the persisted switch state is missing, unreadable
    /// or disagrees with the kernel, so that it keeps serving what the kernel serves.
    fn presence(&self) -> Result<Presence, BackendError>;
    /// Reads the kernel back and describes every difference from what the last sync programmed
    /// (empty: no drift).
    fn verify(&self) -> Result<Vec<String>, BackendError> {
        Ok(Vec::new())
    }
    /// A cheap read of the kernel, run after an idle sync period instead of a full resync: whether
    /// what the last sync programmed is still in place as far as such a check can tell (kube-proxy's
    /// canary check: our tables and chains, and the base-chain jumps as the bypass flag wants
    /// them; e.g. gone after a firewall reload). `Some(false)` makes the next sync full. The
    /// default has no cheap check and answers `None`: that backend resyncs in full after every
    /// idle period.
    fn intact(&self) -> Result<Option<bool>, BackendError> {
        Ok(None)
    }
    /// Whether the driver may replace this backend, while it serves, by one built afresh with new
    /// settings (node addresses, the policy's settings), which then syncs in full. A backend that
    /// remembers more than a full sync restores says no and keeps the settings it was built with:
    /// IPVS keeps real servers at weight 0 until their connections end, which a fresh backend
    /// would forget. The default answers by mode; a backend may override it.
    fn rebuild_with_new_settings(&self) -> bool {
        self.mode() != switchyard_crds::v1alpha1::ProxyMode::Ipvs
    }
    /// For a backend that may not be rebuilt ([`Self::rebuild_with_new_settings`] false): takes
    /// new settings in place, keeping what it remembers; its next sync is full and programs them.
    /// Returns whether it took them (the default takes nothing: the backend keeps the settings it
    /// was built with).
    fn take_settings(&mut self, settings: &Settings) -> bool {
        let _ = settings;
        false
    }
    /// What must appear in the kernel before this backend may take traffic (`None`: ready). A
    /// switch waits in Preparing for it, at most the health gate's timeout. Only mode `external`
    /// waits (for the other proxy's rules).
    fn waiting_for(&self) -> Option<String> {
        None
    }
}

/// Builds the backend for `mode` (the operator only asks for modes the node reports as supported;
/// IPVS mode uses the iptables `variant` for its few rules).
pub fn new_backend(
    mode: switchyard_crds::v1alpha1::ProxyMode,
    settings: Settings,
    iptables_variant: &str,
) -> Box<dyn Backend> {
    use switchyard_crds::v1alpha1::ProxyMode;
    let variant = if iptables_variant == "nft" {
        crate::sys::iptables::Variant::Nft
    } else {
        crate::sys::iptables::Variant::Legacy
    };
    match mode {
        ProxyMode::Nftables => Box::new(nftables::NftablesBackend::new(settings)),
        ProxyMode::Iptables => Box::new(iptables::IptablesBackend::new(variant, settings)),
        ProxyMode::Ipvs => Box::new(ipvs::IpvsBackend::new(variant, settings)),
        ProxyMode::External => Box::new(external::ExternalBackend::kube_proxy()),
    }
}

/// Removes everything Switchyard owns in every backend and variant; collects every failure.
pub fn cleanup_all() -> Vec<BackendError> {
    let mut errors = Vec::new();
    let mut backends: Vec<Box<dyn Backend>> =
        vec![Box::new(nftables::NftablesBackend::new(Settings::default()))];
    // IPVS first: its jump rules reference `SWY-IPVS-*` chains, which must be gone before the
    // iptables backend deletes `SWY-*` chains.
    for variant in [
        crate::sys::iptables::Variant::Legacy,
        crate::sys::iptables::Variant::Nft,
    ] {
        backends.push(Box::new(ipvs::IpvsBackend::new(variant, Settings::default())));
    }
    for variant in [
        crate::sys::iptables::Variant::Legacy,
        crate::sys::iptables::Variant::Nft,
    ] {
        backends.push(Box::new(iptables::IptablesBackend::new(
            variant,
            Settings::default(),
        )));
    }
    for mut b in backends {
        if let Err(e) = b.cleanup() {
            errors.extend(e.into_errors());
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> Result<SyncStats, BackendError> {
        Err(BackendError::Command {
            backend: "test",
            command: "ip6tables-restore".into(),
            detail: "not found".into(),
        })
    }

    #[test]
    fn ipv6_failures_are_tolerated_only_where_ipv6_is_unavailable() {
        let missing = || {
            Err(BackendError::ToolMissing {
                backend: "test",
                command: "ip6tables-restore".into(),
                detail: "not found".into(),
            })
        };
        let mut v4 = FamilyResults::default();
        assert!(
            v4.check(IpFamily::V4, missing()).is_err(),
            "IPv4 must always work"
        );
        let mut v6 = FamilyResults::default();
        assert_eq!(
            v6.check(IpFamily::V6, missing()).ok(),
            Some(None),
            "no ip6tables: the node serves IPv4"
        );
        let stats = SyncStats {
            full: true,
            services: 3,
            ..Default::default()
        };
        assert_eq!(v6.check(IpFamily::V6, Ok(stats.clone())).ok(), Some(Some(stats)));
        // This test runs where IPv6 exists: a kernel refusal is an error, not a missing family.
        assert!(crate::sys::host::ipv6_enabled());
        assert!(v6.check(IpFamily::V6, failure()).is_err());
    }
}
