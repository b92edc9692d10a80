//! Types used by both kinds: the proxy mode, proxy settings and health-gate targets.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// A Linux service-proxy data plane: one of Switchyard's own, or `external` (another proxy).
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ProxyMode {
    /// iptables: `SWY-*` chains in the nat and filter tables, loaded with `iptables-restore --noflush`.
    Iptables,
    /// IPVS: kernel virtual servers plus the `swy-ipvs0` dummy link and `SWY-*` ipsets.
    /// Deprecated upstream since Kubernetes v1.35; use it to migrate off, not to migrate onto.
    Ipvs,
    /// nftables: the `switchyard` table (ip and ip6 families). Needs kernel 5.13 or newer.
    Nftables,
    /// Another service proxy serves the node (kube-proxy, or an eBPF data plane); Switchyard
    /// programs nothing there. The operator labels the Node `switchyard.dev/service-proxy=external`
    /// so the other proxy's DaemonSet may select it; the switch to it is make-before-break, gated
    /// by the same data-plane probes (which then go through the other proxy).
    External,
}

impl ProxyMode {
    /// Switchyard's own data planes, in a stable order (`External` is none of them).
    pub const ALL: [ProxyMode; 3] = [ProxyMode::Iptables, ProxyMode::Ipvs, ProxyMode::Nftables];

    /// Every mode the API accepts: Switchyard's data planes, then `External`.
    pub const EVERY: [ProxyMode; 4] = [
        ProxyMode::Iptables,
        ProxyMode::Ipvs,
        ProxyMode::Nftables,
        ProxyMode::External,
    ];

    /// Whether another service proxy serves the node in this mode.
    pub fn is_external(self) -> bool {
        self == ProxyMode::External
    }

    /// The lowercase name used in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
            ProxyMode::External => "external",
        }
    }
}

impl std::fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// IPVS scheduling algorithm (see ipvsadm(8)): every scheduler of Linux. A node offers the ones its
/// kernel has (NodeProxy `status.capabilities.ipvsSchedulers`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum IpvsScheduler {
    /// Round robin.
    #[default]
    Rr,
    /// Weighted round robin.
    Wrr,
    /// Least connection.
    Lc,
    /// Weighted least connection.
    Wlc,
    /// Locality-based least connection.
    Lblc,
    /// Locality-based least connection with replication.
    Lblcr,
    /// Source hashing: a client address always reaches the same real server.
    Sh,
    /// Destination hashing.
    Dh,
    /// Shortest expected delay.
    Sed,
    /// Never queue.
    Nq,
    /// Weighted failover: the available real server of highest weight.
    Fo,
    /// Weighted overflow: the real server of highest weight until its active connections exceed
    /// its weight.
    Ovf,
    /// Maglev hashing.
    Mh,
    /// Weighted random twos choice (kernel 6.2 and later).
    Twos,
}

/// Proxy settings: the KubeProxyConfiguration fields a Switchyard user needs. Every field is
/// optional; the agent uses kube-proxy's default where a field is absent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.minSyncPeriodSeconds) || !has(self.syncPeriodSeconds) || self.minSyncPeriodSeconds <= self.syncPeriodSeconds").message("proxy.minSyncPeriodSeconds must not exceed proxy.syncPeriodSeconds"))]
pub struct ProxySettings {
    /// Pod CIDR of the cluster (e.g. 10.244.0.0/16), or one per family on dual-stack clusters,
    /// comma-separated (e.g. 10.244.0.0/16,fd00:10:244::/56). Traffic to a Service from outside
    /// it is masqueraded. Optional: without it, only traffic that needs it for correctness is
    /// masqueraded.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "clusterCIDR")]
    #[schemars(length(max = 87))]
    #[x_kube(validation = Rule::new("self.split(',').all(c, isCIDR(c)) && (self.split(',').size() == 1 || (self.split(',').size() == 2 && cidr(self.split(',')[0]).ip().family() != cidr(self.split(',')[1]).ip().family()))").message("proxy.clusterCIDR must be a CIDR, or an IPv4 and an IPv6 CIDR separated by a comma, such as 10.244.0.0/16,fd00:10:244::/56"))]
    pub cluster_cidr: Option<String>,

    /// Node addresses on which NodePorts are served: CIDRs, or the word `primary` for the node's
    /// primary addresses. Empty means all local addresses in iptables and IPVS mode, and `primary` in
    /// nftables mode (kube-proxy's defaults).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(max = 43)))]
    #[x_kube(validation = Rule::new("self.all(a, a == 'primary' || isCIDR(a))").message("proxy.nodePortAddresses entries must be CIDRs or 'primary'"))]
    #[x_kube(validation = Rule::new("!self.exists(a, a == 'primary') || self.size() == 1").message("proxy.nodePortAddresses: 'primary' cannot be combined with CIDRs; list either 'primary' alone or only CIDRs"))]
    pub node_port_addresses: Vec<String>,

    /// Masquerade (SNAT) all traffic to Service addresses, not only traffic that needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masquerade_all: Option<bool>,

    /// Minimum seconds between two syncs of the rules; changes arriving faster are batched (a
    /// bound on the rate, as kube-proxy's `--min-sync-period`). Absent: the agent's
    /// `--min-sync-period`, or, unset there too, a limit fitted to the syncs' cost (a burst
    /// coalesces over 5 ms or three times the last sync's cost, never more than 1 s). A change
    /// applies without a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub min_sync_period_seconds: Option<u32>,

    /// Seconds of quiet after which the agent checks its rules in the kernel and resyncs in full
    /// only if they changed (e.g. after a firewall reload); a full resync also runs at least
    /// hourly. Absent: the agent's `--sync-period` (default 30). A change applies without a
    /// restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400))]
    pub sync_period_seconds: Option<u32>,

    /// Serve NodePorts on 127.0.0.1 to clients on the node itself (IPv4 only: `::1` is never
    /// served). iptables mode does it as kube-proxy's `--iptables-localhost-nodeports`; nftables
    /// mode, where kube-proxy does not serve them, in the kernel the same way (a DNAT of node-local
    /// connections, masqueraded, on top of `nodePortAddresses`). Both set
    /// `net.ipv4.conf.all.route_localnet=1`, guarded by a rule that drops new connections to
    /// 127.0.0.0/8 from other hosts, and put the node's value back when off. Off, 127.0.0.1:<NodePort>
    /// is refused at once. Not in IPVS mode (nor kube-proxy's). A change applies without a restart.
    /// Absent: the agent's flags, kube-proxy's defaults: on in iptables mode, off in nftables mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub localhost_node_ports: Option<bool>,

    /// Handle only Services labelled `service.kubernetes.io/service-proxy-name` with this value.
    /// Absent: the agent's `--service-proxy-name`, or, unset there too, only Services without
    /// that label, as kube-proxy does. A change re-filters the Services without a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')").message("proxy.serviceProxyName must be a label value: alphanumerics, '-', '_' or '.', starting and ending alphanumeric"))]
    pub service_proxy_name: Option<String>,

    /// Connection-tracking settings written to the node's sysctls, following kube-proxy's rules.
    /// The agent remembers each value it replaced (in its state file) and puts it back when the
    /// policy stops asking or on `--cleanup`. A value the kernel refuses (`nf_conntrack_max` and
    /// the hash size are host-global: writable only from the node's initial network namespace)
    /// is left alone and reported in the NodeProxy's `ConntrackSysctls` condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<ConntrackSettings>,

    /// Settings used only in IPVS mode; a node running another mode ignores them (they apply when
    /// it runs IPVS: `spec.mode` or `spec.fallback` ipvs, or a later switch). A change applies
    /// without a restart, to the Services already programmed too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipvs: Option<IpvsSettings>,
}

/// Connection-tracking sysctls, as in KubeProxyConfiguration's `conntrack`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackSettings {
    /// Conntrack entries per CPU core (nf_conntrack_max = maxPerCore × cores, at least `min`). 0 leaves
    /// the kernel's value alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_per_core: Option<i32>,
    /// Lower bound for nf_conntrack_max.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub min: Option<i32>,
    /// nf_conntrack_tcp_timeout_established, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub tcp_established_timeout_seconds: Option<i32>,
    /// nf_conntrack_tcp_timeout_close_wait, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub tcp_close_wait_timeout_seconds: Option<i32>,
    /// nf_conntrack_tcp_be_liberal: accept out-of-window TCP packets instead of marking them invalid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_be_liberal: Option<bool>,
    /// nf_conntrack_udp_timeout, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub udp_timeout_seconds: Option<i32>,
    /// nf_conntrack_udp_timeout_stream, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub udp_stream_timeout_seconds: Option<i32>,
}

/// Settings of IPVS mode, as in KubeProxyConfiguration's `ipvs`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpvsSettings {
    /// Scheduling algorithm of every virtual service. Default rr.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<IpvsScheduler>,
    /// Set arp_ignore=1 and arp_announce=2 so the node does not answer ARP for service addresses on
    /// the dummy link (needed with MetalLB L2). Default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict_arp: Option<bool>,
    /// CIDRs whose IPVS services Switchyard must never touch or clean up.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 43)))]
    #[x_kube(validation = Rule::new("self.all(c, isCIDR(c))").message("proxy.ipvs.excludeCIDRs entries must be CIDRs"))]
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Vec<String>,
    /// IPVS TCP session timeout in seconds (0 leaves the kernel's value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub tcp_timeout_seconds: Option<i32>,
    /// IPVS TCP FIN_WAIT timeout in seconds (0 leaves the kernel's value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub tcp_fin_timeout_seconds: Option<i32>,
    /// IPVS UDP timeout in seconds (0 leaves the kernel's value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub udp_timeout_seconds: Option<i32>,
}

/// Services the health gate connects to from each switched node. `default/kubernetes` is always
/// probed in addition.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.name) != has(self.selector)").message("a probe target sets exactly one of name and selector"))]
pub struct ProbeTarget {
    /// Namespace of the Service(s).
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("probe namespace must be a namespace name: lowercase letters, digits and '-', starting and ending with a letter or digit"))]
    pub namespace: String,
    /// Name of one Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("probe name must be a Service name: lowercase letters, digits and '-', starting with a letter and ending with a letter or digit"))]
    pub name: Option<String>,
    /// Label selector choosing Services in the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
}

/// How a switched node proves its data plane healthy before the rollout goes on.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.minHealthySeconds < self.timeoutSeconds").message("healthGate.minHealthySeconds must be less than healthGate.timeoutSeconds"))]
pub struct HealthGate {
    /// Services to connect to from the node (through the new data plane). `default/kubernetes` is
    /// always added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub probes: Vec<ProbeTarget>,
    /// Seconds the probes must keep succeeding after the cut-over before the node counts as healthy.
    #[serde(default = "default_min_healthy_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub min_healthy_seconds: u32,
    /// Seconds a node may take from the start of its switch to healthy; past it the switch fails and
    /// the node rolls back.
    #[serde(default = "default_gate_timeout_seconds")]
    #[schemars(range(min = 1, max = 86400))]
    pub timeout_seconds: u32,
    /// Consecutive failed probe rounds that fail the switch at once.
    #[serde(default = "default_failure_threshold")]
    #[schemars(range(min = 1, max = 100))]
    pub failure_threshold: u32,
}

impl Default for HealthGate {
    fn default() -> Self {
        Self {
            probes: Vec::new(),
            min_healthy_seconds: default_min_healthy_seconds(),
            timeout_seconds: default_gate_timeout_seconds(),
            failure_threshold: default_failure_threshold(),
        }
    }
}

fn default_min_healthy_seconds() -> u32 {
    10
}
fn default_gate_timeout_seconds() -> u32 {
    300
}
fn default_failure_threshold() -> u32 {
    3
}
