//! Migration preflight: the facts an agent measures on its node that decide whether a switch to
//! another mode would change behaviour there (`NodeProxy.status.preflightFacts`), the policy's
//! explicit acceptance of findings (`ProxyPolicy.spec.rollout.preflight`), and the names of the
//! findings the planner judges from them (kube-proxy's documented differences between iptables
//! and nftables mode, kernel 5.13, IPVS deprecation).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

use super::ProxyMode;

/// Finding names, as listed in `spec.rollout.preflight.accept` and shown by `kubectl switchyard plan`.
pub mod preflight_findings {
    /// Clients reached NodePorts through `127.0.0.1` in iptables mode
    /// (`kubeproxy_iptables_localhost_nodeports_accepted_packets_total` > 0); nftables mode does not
    /// serve them unless `proxy.localhostNodePorts` is true. Blocking.
    pub const LOCALHOST_NODE_PORTS: &str = "LocalhostNodePorts";
    /// iptables mode dropped conntrack-invalid packets
    /// (`kubeproxy_iptables_ct_state_invalid_dropped_packets_total` > 0); nftables mode installs no
    /// such drop, so those packets would reach pods (and reset connections) unless
    /// `nf_conntrack_tcp_be_liberal` is 1 (`proxy.conntrack.tcpBeLiberal: true`). Blocking.
    pub const CONNTRACK_INVALID_DROPS: &str = "ConntrackInvalidDrops";
    /// NodePorts answer on every local address now; nftables mode serves them on the node's primary
    /// addresses only unless `proxy.nodePortAddresses` says otherwise. Warning.
    pub const NODE_PORT_ADDRESSES: &str = "NodePortAddresses";
    /// nftables mode adds no firewall accept rules for NodePorts: a host firewall must accept the
    /// NodePort range itself. Warning.
    pub const NODE_PORT_FIREWALL: &str = "NodePortFirewall";
    /// nftables mode needs kernel 5.13 or newer. Blocking.
    pub const KERNEL_TOO_OLD: &str = "KernelTooOld";
    /// IPVS mode is deprecated upstream since Kubernetes v1.35 (off by default from v1.40,
    /// removed in v1.43). Warning.
    pub const IPVS_DEPRECATED: &str = "IPVSDeprecated";
    /// Every finding name, in the order findings are listed.
    pub const ALL: [&str; 6] = [
        LOCALHOST_NODE_PORTS,
        CONNTRACK_INVALID_DROPS,
        KERNEL_TOO_OLD,
        NODE_PORT_ADDRESSES,
        NODE_PORT_FIREWALL,
        IPVS_DEPRECATED,
    ];
}

/// The migration preflight of a policy: every node is judged against the policy's mode and
/// settings before its switch; a blocking finding holds the node (ProxyPolicy condition
/// `PreflightPassed=False` with what to change) until it is fixed or accepted here.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Preflight {
    /// Findings accepted for every node of the pool: a node with only accepted (or warning)
    /// findings switches. Names: LocalhostNodePorts, ConntrackInvalidDrops, KernelTooOld,
    /// NodePortAddresses, NodePortFirewall, IPVSDeprecated (`kubectl switchyard plan NAME` lists
    /// each node's findings).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 6))]
    #[schemars(extend("items" = {"type": "string", "enum": ["LocalhostNodePorts", "ConntrackInvalidDrops", "KernelTooOld", "NodePortAddresses", "NodePortFirewall", "IPVSDeprecated"]}))]
    pub accept: Vec<String>,
}

/// What the agent measured on its node for the migration preflight, refreshed with every status
/// report (about every 10 s).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreflightFacts {
    /// Mode the node ran when these were measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<ProxyMode>,
    /// When they were measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_at: Option<Time>,
    /// Kernel release (`uname -r`).
    #[serde(default)]
    pub kernel_version: String,
    /// Packets to NodePorts on `127.0.0.1` counted by iptables mode's rule (nfacct
    /// `localhost_nps_accepted_pkts`, kube-proxy's
    /// `kubeproxy_iptables_localhost_nodeports_accepted_packets_total`); absent when not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub localhost_node_ports_accepted_packets: Option<i64>,
    /// Packets dropped by iptables mode's conntrack-invalid rule (nfacct
    /// `ct_state_invalid_dropped_pkts`, kube-proxy's
    /// `kubeproxy_iptables_ct_state_invalid_dropped_packets_total`); absent when not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ct_state_invalid_dropped_packets: Option<i64>,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` as read now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_be_liberal: Option<bool>,
    /// NodePort addresses in effect: `all`, `primary`, or the CIDRs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_port_addresses: Vec<String>,
    /// Whether NodePorts are served on `127.0.0.1` now.
    #[serde(default)]
    pub localhost_node_ports: bool,
    /// The node's primary addresses (its Node's InternalIPs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub primary_addresses: Vec<String>,
    /// Every other address on the node's interfaces (not loopback, not IPv6 link-local).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_addresses: Vec<String>,
}
