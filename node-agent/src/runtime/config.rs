//! The proxy loop's configuration: the agent's flags as typed values (clap value enums and value
//! parsers), the policy's proxy settings laid over them, and the backend settings derived from the
//! Node object.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use switchyard_crds::v1alpha1::{Capabilities, ConntrackSettings, IpvsSettings, ProxyMode, ProxySettings};

use crate::{
    backend::{self, Settings},
    model::{IpFamily, IpNet, NodeInfo},
    switch::Phase,
};

/// Which node addresses accept NodePorts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address (iptables default).
    All,
    /// The node's primary addresses (nftables default).
    Primary,
    /// Node addresses inside these CIDRs.
    Cidrs(Vec<IpNet>),
}

impl NodePortAddresses {
    /// kube-proxy's default for `mode` when `--nodeport-addresses` is not given: the primary
    /// addresses for nftables, every local address otherwise.
    pub fn default_for(mode: ProxyMode) -> Self {
        if mode == ProxyMode::Nftables {
            Self::Primary
        } else {
            Self::All
        }
    }

    /// Parses `--nodeport-addresses`: `primary`, `all`, or comma-separated CIDRs.
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        match value {
            "all" => Ok(Self::All),
            "primary" => Ok(Self::Primary),
            list => list
                .split(',')
                .map(|c| c.trim().parse().map_err(|e| format!("{c}: {e}")))
                .collect::<std::result::Result<_, _>>()
                .map(Self::Cidrs),
        }
    }
}

/// `--mode`: the proxy mode to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeFlag {
    /// nftables.
    Nftables,
    /// iptables.
    Iptables,
    /// IPVS.
    Ipvs,
}

impl From<ModeFlag> for ProxyMode {
    fn from(mode: ModeFlag) -> Self {
        match mode {
            ModeFlag::Nftables => ProxyMode::Nftables,
            ModeFlag::Iptables => ProxyMode::Iptables,
            ModeFlag::Ipvs => ProxyMode::Ipvs,
        }
    }
}

/// A switch phase as the state file spells it, for the hidden `--test-pause-at` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "PascalCase")]
pub enum PhaseFlag {
    /// [`Phase::Active`].
    Active,
    /// [`Phase::Preparing`].
    Preparing,
    /// [`Phase::CutOver`].
    CutOver,
    /// [`Phase::Verifying`].
    Verifying,
    /// [`Phase::Cleaning`].
    Cleaning,
    /// [`Phase::RollingBack`].
    RollingBack,
}

impl From<PhaseFlag> for Phase {
    fn from(phase: PhaseFlag) -> Self {
        match phase {
            PhaseFlag::Active => Phase::Active,
            PhaseFlag::Preparing => Phase::Preparing,
            PhaseFlag::CutOver => Phase::CutOver,
            PhaseFlag::Verifying => Phase::Verifying,
            PhaseFlag::Cleaning => Phase::Cleaning,
            PhaseFlag::RollingBack => Phase::RollingBack,
        }
    }
}

/// A CIDR list of at most one CIDR per family (`--cluster-cidr`, `--service-cidr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CidrList(pub Vec<IpNet>);

impl CidrList {
    /// Parses a flag's value (see [`parse_cluster_cidrs`]).
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        parse_cluster_cidrs(value).map(Self)
    }
}

/// Configuration of the proxy loop.
#[derive(Debug, Clone)]
pub struct Config {
    /// Node name.
    pub node_name: String,
    /// Mode to run.
    pub mode: ProxyMode,
    /// iptables variant (`legacy` / `nft`) for the iptables backend.
    pub iptables_variant: String,
    /// Pod CIDRs of the cluster, at most one per family.
    pub cluster_cidrs: Vec<IpNet>,
    /// Masquerade all service traffic.
    pub masquerade_all: bool,
    /// NodePort addresses.
    pub node_port_addresses: NodePortAddresses,
    /// Service proxy name to honour.
    pub proxy_name: Option<String>,
    /// Minimum time between syncs (`--min-sync-period`); unset, the rate limit fits the syncs'
    /// cost (see [`super::runner`]).
    pub min_sync_period: Option<Duration>,
    /// Full resync and retry period.
    pub sync_period: Duration,
    /// Capabilities, reported in status.
    pub capabilities: Capabilities,
    /// Directory of the persisted switch state.
    pub state_dir: std::path::PathBuf,
    /// Remove kube-proxy's leftovers once Switchyard serves the node.
    pub takeover_kube_proxy: bool,
    /// iptables mode: NodePorts on 127.0.0.1 (see [`Settings::localhost_node_ports`]).
    pub localhost_node_ports: bool,
    /// nftables mode: NodePorts on 127.0.0.1 (see [`Settings::nftables_localhost_node_ports`]).
    pub nftables_localhost_node_ports: bool,
    /// The cluster's Service CIDRs (see [`Settings::service_cidrs`]).
    pub service_cidrs: Vec<IpNet>,
    /// The conntrack sysctls to set (only a policy sets them; see [`crate::node_sysctls`]).
    pub conntrack: Option<ConntrackSettings>,
    /// IPVS mode's settings (only a policy sets them; see [`backend::ipvs::IpvsOptions::from_policy`]).
    pub ipvs: Option<IpvsSettings>,
}

/// The node's InternalIP addresses.
fn internal_ips(node: Option<&Node>) -> Vec<std::net::IpAddr> {
    node.and_then(|n| n.status.as_ref())
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// Per family, as kube-proxy: `primary` restricts the families the Node has addresses of; CIDRs
/// restrict the families they are of (to the node addresses inside them, possibly none).
fn node_port_ips(wanted: &NodePortAddresses, addresses: &[std::net::IpAddr]) -> backend::NodePortIps {
    match wanted {
        NodePortAddresses::All => backend::NodePortIps::default(),
        NodePortAddresses::Primary => backend::NodePortIps::of_addresses(addresses),
        NodePortAddresses::Cidrs(cidrs) => {
            let mut ips = backend::NodePortIps::default();
            for family in IpFamily::ALL {
                let of_family: Vec<&IpNet> = cidrs.iter().filter(|c| IpFamily::of_net(c) == family).collect();
                if !of_family.is_empty() {
                    let inside = addresses
                        .iter()
                        .filter(|a| of_family.iter().any(|c| c.contains(*a)))
                        .copied()
                        .collect();
                    ips.restrict(family, inside);
                }
            }
            ips
        }
    }
}

/// Derives the node facts and the backend settings from the Node object.
pub fn node_settings(config: &Config, node: Option<&Node>) -> Settings {
    let addresses = internal_ips(node);
    let zone = node
        .and_then(|n| n.metadata.labels.as_ref())
        .and_then(|l| l.get("topology.kubernetes.io/zone"))
        .cloned();
    Settings {
        node_port_addresses: node_port_ips(&config.node_port_addresses, &addresses),
        node: NodeInfo {
            name: config.node_name.clone(),
            addresses,
            zone,
        },
        cluster_cidrs: config.cluster_cidrs.clone(),
        masquerade_all: config.masquerade_all,
        masquerade_mark: 0x4000,
        ipvs: backend::ipvs::IpvsOptions::from_policy(config.ipvs.as_ref()),
        localhost_node_ports: config.localhost_node_ports,
        nftables_localhost_node_ports: config.nftables_localhost_node_ports,
        service_cidrs: config.service_cidrs.clone(),
    }
}

/// Parses a cluster CIDR list as kube-proxy's `--cluster-cidr` takes it: one CIDR, or one per
/// family separated by a comma.
pub fn parse_cluster_cidrs(value: &str) -> std::result::Result<Vec<IpNet>, String> {
    let cidrs: Vec<IpNet> = value
        .split(',')
        .map(|c| {
            c.trim()
                .parse::<IpNet>()
                .map(|n| n.trunc())
                .map_err(|e| format!("{c}: {e}"))
        })
        .collect::<std::result::Result<_, _>>()?;
    let families: std::collections::BTreeSet<_> = cidrs.iter().map(IpFamily::of_net).collect();
    if families.len() != cidrs.len() {
        return Err(format!("{value}: at most one CIDR per IP family"));
    }
    Ok(cidrs)
}

/// The agent's configuration with the governing policy's proxy settings (from NodeProxy spec)
/// laid over its flags: clusterCIDR, masqueradeAll, nodePortAddresses, minSyncPeriodSeconds,
/// syncPeriodSeconds, serviceProxyName, ipvs and localhostNodePorts (for iptables and nftables mode
/// alike; absent, each mode keeps its flag, whose defaults are kube-proxy's: on in iptables mode,
/// off in nftables mode). The conntrack settings are applied by [`crate::node_sysctls`]. A field the policy leaves out keeps the flag's value; invalid values
/// keep it too (the CRD validates them, so this only guards against skew).
pub fn with_policy_settings(config: &Config, proxy: Option<&ProxySettings>) -> Config {
    let mut c = config.clone();
    let Some(p) = proxy else { return c };
    if let Some(seconds) = p.min_sync_period_seconds {
        c.min_sync_period = Some(Duration::from_secs(u64::from(seconds)));
    }
    if let Some(seconds) = p.sync_period_seconds.filter(|s| *s > 0) {
        c.sync_period = Duration::from_secs(u64::from(seconds));
    }
    if let Some(name) = p.service_proxy_name.as_ref().filter(|n| !n.is_empty()) {
        c.proxy_name = Some(name.clone());
    }
    if p.conntrack.is_some() {
        c.conntrack = p.conntrack.clone();
    }
    if p.ipvs.is_some() {
        c.ipvs = p.ipvs.clone();
    }
    if let Some(Ok(cidrs)) = p.cluster_cidr.as_deref().map(parse_cluster_cidrs) {
        c.cluster_cidrs = cidrs;
    }
    if let Some(all) = p.masquerade_all {
        c.masquerade_all = all;
    }
    if let Some(localhost) = p.localhost_node_ports {
        c.localhost_node_ports = localhost;
        c.nftables_localhost_node_ports = localhost;
    }
    if !p.node_port_addresses.is_empty() {
        let cidrs: Vec<IpNet> = p
            .node_port_addresses
            .iter()
            .filter_map(|a| a.parse().ok())
            .collect();
        c.node_port_addresses = if p.node_port_addresses.iter().any(|a| a == "primary") {
            NodePortAddresses::Primary
        } else {
            NodePortAddresses::Cidrs(cidrs)
        };
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config {
            node_name: "n".into(),
            mode: ProxyMode::Iptables,
            iptables_variant: "legacy".into(),
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            node_port_addresses: NodePortAddresses::All,
            proxy_name: None,
            min_sync_period: Some(Duration::from_secs(1)),
            sync_period: Duration::from_secs(30),
            capabilities: Capabilities::default(),
            state_dir: "/tmp".into(),
            takeover_kube_proxy: false,
            localhost_node_ports: true,
            nftables_localhost_node_ports: false,
            service_cidrs: Vec::new(),
            conntrack: None,
            ipvs: None,
        }
    }

    #[test]
    fn policy_settings_override_flags() {
        let config = config();
        let proxy = ProxySettings {
            cluster_cidr: Some("10.244.0.0/16,fd00:10:244::/56".into()),
            masquerade_all: Some(true),
            node_port_addresses: vec!["10.250.0.0/24".into()],
            ..Default::default()
        };
        let c = with_policy_settings(&config, Some(&proxy));
        assert_eq!(
            c.cluster_cidrs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["10.244.0.0/16", "fd00:10:244::/56"]
        );
        assert!(c.masquerade_all);
        assert_eq!(
            c.node_port_addresses,
            NodePortAddresses::Cidrs(vec!["10.250.0.0/24".parse().expect("net")])
        );
        let primary = ProxySettings {
            node_port_addresses: vec!["primary".into()],
            ..Default::default()
        };
        assert_eq!(
            with_policy_settings(&config, Some(&primary)).node_port_addresses,
            NodePortAddresses::Primary
        );
        let unchanged = with_policy_settings(&config, None);
        assert_eq!(
            (unchanged.cluster_cidrs, unchanged.masquerade_all),
            (vec![], false)
        );
    }

    #[test]
    fn policy_sync_periods_and_proxy_name_override_the_flags_only_when_set() {
        let mut flags = config();
        flags.min_sync_period = None;
        let proxy = ProxySettings {
            min_sync_period_seconds: Some(0),
            sync_period_seconds: Some(2),
            service_proxy_name: Some("swy".into()),
            ..Default::default()
        };
        let c = with_policy_settings(&flags, Some(&proxy));
        assert_eq!(c.min_sync_period, Some(Duration::ZERO), "0 is a set bound");
        assert_eq!(c.sync_period, Duration::from_secs(2));
        assert_eq!(c.proxy_name.as_deref(), Some("swy"));
        let absent = with_policy_settings(&flags, Some(&ProxySettings::default()));
        assert_eq!(absent.min_sync_period, None, "unset: the adaptive limit stays");
        assert_eq!(absent.sync_period, Duration::from_secs(30));
        assert_eq!(absent.proxy_name, None);
    }

    #[test]
    fn localhost_node_ports_follow_the_policy_in_both_modes_and_the_flags_without_it() {
        let flags = config();
        let unset = with_policy_settings(&flags, Some(&ProxySettings::default()));
        assert_eq!(
            (unset.localhost_node_ports, unset.nftables_localhost_node_ports),
            (true, false),
            "absent: kube-proxy's defaults per mode (the flags')"
        );
        for on in [true, false] {
            let proxy = ProxySettings {
                localhost_node_ports: Some(on),
                ..Default::default()
            };
            let c = with_policy_settings(&flags, Some(&proxy));
            assert_eq!(
                (c.localhost_node_ports, c.nftables_localhost_node_ports),
                (on, on)
            );
            let s = node_settings(&c, None);
            assert_eq!(
                (s.localhost_node_ports, s.nftables_localhost_node_ports),
                (on, on)
            );
        }
    }

    /// Every field of `proxy.ipvs` reaches the backend's settings; absent, kube-proxy's defaults.
    #[test]
    fn policy_ipvs_settings_reach_the_backend_settings() {
        use switchyard_crds::v1alpha1::IpvsScheduler;
        let flags = config();
        assert_eq!(
            node_settings(&with_policy_settings(&flags, None), None).ipvs,
            backend::ipvs::IpvsOptions::default()
        );
        let proxy = ProxySettings {
            ipvs: Some(IpvsSettings {
                scheduler: Some(IpvsScheduler::Twos),
                strict_arp: Some(true),
                exclude_cidrs: vec!["10.96.9.1/24".into(), "fd00::/64".into()],
                tcp_timeout_seconds: Some(901),
                tcp_fin_timeout_seconds: Some(0),
                udp_timeout_seconds: Some(33),
            }),
            ..Default::default()
        };
        let s = node_settings(&with_policy_settings(&flags, Some(&proxy)), None);
        assert_eq!(
            s.ipvs,
            backend::ipvs::IpvsOptions {
                scheduler: "twos".into(),
                strict_arp: true,
                exclude_cidrs: vec!["10.96.9.0/24".parse().expect("net")],
                timeouts: crate::sys::ipvs::Timeouts {
                    tcp: 901,
                    tcp_fin: 0,
                    udp: 33,
                },
            }
        );
    }

    #[test]
    fn cluster_cidrs_take_one_per_family() {
        assert_eq!(
            parse_cluster_cidrs("10.244.1.0/16").map(|c| c[0].to_string()),
            Ok("10.244.0.0/16".into())
        );
        assert_eq!(
            parse_cluster_cidrs("10.244.0.0/16, fd00:10:244::/56").map(|c| c.len()),
            Ok(2)
        );
        assert!(
            parse_cluster_cidrs("10.244.0.0/16,10.245.0.0/16")
                .is_err_and(|e| e.contains("at most one CIDR per IP family"))
        );
        assert!(parse_cluster_cidrs("10.244.0.0/33").is_err());
    }

    #[test]
    fn node_port_addresses_parse_as_the_flag_takes_them() {
        assert_eq!(NodePortAddresses::parse("all"), Ok(NodePortAddresses::All));
        assert_eq!(
            NodePortAddresses::parse("primary"),
            Ok(NodePortAddresses::Primary)
        );
        assert_eq!(
            NodePortAddresses::parse("10.0.0.0/8, fd00::/64").map(|a| match a {
                NodePortAddresses::Cidrs(c) => c.len(),
                _ => 0,
            }),
            Ok(2)
        );
        assert!(NodePortAddresses::parse("10.0.0.0/8,bogus").is_err_and(|e| e.contains("bogus")));
        assert_eq!(
            NodePortAddresses::default_for(ProxyMode::Nftables),
            NodePortAddresses::Primary
        );
        assert_eq!(
            NodePortAddresses::default_for(ProxyMode::Ipvs),
            NodePortAddresses::All
        );
    }

    #[test]
    fn node_ports_follow_the_cidrs_family_by_family() {
        let mut c = config();
        c.node_port_addresses = NodePortAddresses::Cidrs(vec!["10.1.0.0/16".parse().expect("net")]);
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n", "labels": {"topology.kubernetes.io/zone": "z1"}},
            "status": {"addresses": [
                {"type": "InternalIP", "address": "10.1.0.5"},
                {"type": "InternalIP", "address": "10.2.0.5"},
                {"type": "InternalIP", "address": "fd00::5"},
                {"type": "Hostname", "address": "n"},
            ]},
        }))
        .expect("node");
        let s = node_settings(&c, Some(&node));
        assert_eq!(s.node.addresses.len(), 3);
        assert_eq!(s.node.zone.as_deref(), Some("z1"));
        assert_eq!(
            s.node_port_addresses.of(IpFamily::V4),
            Some(&["10.1.0.5".parse().expect("ip")][..])
        );
        assert_eq!(
            s.node_port_addresses.of(IpFamily::V6),
            None,
            "no IPv6 CIDR: every address"
        );
    }
}
