//! The shared service model (kube-proxy's `pkg/proxy` root, sans IO): service ports, endpoints,
//! change tracking and endpoint categorisation. No Kubernetes types leak out of here: [`convert`]
//! turns Services and EndpointSlices into model values; backends see only a [`DualSnapshot`]: one
//! [`Snapshot`] per IP family, as kube-proxy runs one proxier per family.

pub mod convert;
pub mod list_stream;
pub mod tracker;
pub mod wire;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::Arc,
};

pub use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// An IP family. Every address in a [`Snapshot`] is of its family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum IpFamily {
    /// IPv4.
    #[default]
    V4,
    /// IPv6.
    V6,
}

impl IpFamily {
    /// Both families, IPv4 first.
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    /// The family of `ip`.
    pub fn of(ip: &IpAddr) -> Self {
        if ip.is_ipv4() { IpFamily::V4 } else { IpFamily::V6 }
    }

    /// The family of `net`.
    pub fn of_net(net: &IpNet) -> Self {
        Self::of(&net.addr())
    }

    /// Whether `ip` is of this family.
    pub fn holds(self, ip: &IpAddr) -> bool {
        Self::of(ip) == self
    }

    /// The family's number on the netfilter wire: `NFPROTO_IPV4` / `NFPROTO_IPV6` (equal to
    /// `AF_INET` / `AF_INET6`).
    pub fn nfproto(self) -> u8 {
        match self {
            IpFamily::V4 => 2,
            IpFamily::V6 => 10,
        }
    }

    /// The Kubernetes spelling (`IPv4`, `IPv6`), as in `ipFamilies` and EndpointSlice `addressType`.
    pub fn k8s_name(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.k8s_name())
    }
}

/// Transport protocol of a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Protocol {
    /// IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// From an IP protocol number.
    pub fn from_number(n: u8) -> Option<Self> {
        [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
            .into_iter()
            .find(|p| p.number() == n)
    }

    /// The Kubernetes spelling (`TCP`, `UDP`, `SCTP`), which is also how ipvsadm prints it.
    pub fn k8s_name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// Lowercase name, as nft and iptables print it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    /// Parses the Kubernetes spelling (`TCP`, `UDP`, `SCTP`); absent means TCP.
    pub fn from_k8s(value: Option<&str>) -> Option<Self> {
        match value.unwrap_or("TCP") {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

/// A Service, by namespace and name. The strings are shared (`Arc<str>`): the agent keeps a
/// Service's name in each of its maps (tracker, snapshot, backend), and a copy is a reference
/// count, not two allocations.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceName {
    /// Namespace.
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of a Service: the unit every backend programs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    /// The Service.
    pub service: ServiceName,
    /// The port's name (may be empty for single-port Services).
    pub port_name: Arc<str>,
    /// Its protocol.
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    /// kube-proxy's `ServicePortName.String()`: `ns/name` plus `:port` when the port is named.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port_name.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port_name)
        }
    }
}

/// Everything a backend needs to know about one service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    /// Identity.
    pub name: ServicePortName,
    /// ClusterIP of this port's family (a dual-stack Service has one port per family).
    pub cluster_ip: IpAddr,
    /// Service port.
    pub port: u16,
    /// NodePort, for NodePort and LoadBalancer Services.
    pub node_port: Option<u16>,
    /// `spec.externalIPs` of this family.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` of this family.
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges` of this family (empty: any source). As in kube-proxy, ranges
    /// of the other family do not restrict this family's load-balancer IPs.
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// ClientIP session affinity timeout in seconds; `None` without affinity.
    pub affinity_timeout_seconds: Option<u32>,
    /// `externalTrafficPolicy: Local`.
    pub external_policy_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub internal_policy_local: bool,
    /// `spec.healthCheckNodePort`, for LoadBalancer Services with `externalTrafficPolicy: Local`.
    pub health_check_node_port: Option<u16>,
}

impl ServicePort {
    /// The family of this port's addresses.
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.cluster_ip)
    }

    /// Whether the LoadBalancer IPs are restricted to source ranges.
    pub fn has_source_ranges(&self) -> bool {
        !self.load_balancer_source_ranges.is_empty()
    }

    /// Whether the port has destinations outside the cluster (NodePort, external or LB IPs).
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }
}

/// One endpoint of a service port, from an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    /// Address (of the slice's family).
    pub ip: IpAddr,
    /// Target port.
    pub port: u16,
    /// `conditions.ready` (absent counts as ready).
    pub ready: bool,
    /// `conditions.serving` (absent: same as ready).
    pub serving: bool,
    /// `conditions.terminating`.
    pub terminating: bool,
    /// Node hosting the endpoint (shared by the copies of the endpoint: the tracker's and each
    /// snapshot's).
    pub node_name: Option<std::sync::Arc<str>>,
    /// Zones from `hints.forZones` (topology-aware routing).
    pub zone_hints: Vec<String>,
}

/// The state of one IP family a backend programs: every service port and its endpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// The family of every address in here.
    pub family: IpFamily,
    /// Service ports by name.
    pub services: BTreeMap<ServicePortName, ServicePort>,
    /// Endpoints by service port, sorted and de-duplicated.
    pub endpoints: BTreeMap<ServicePortName, Vec<Endpoint>>,
}

impl Snapshot {
    /// An empty snapshot of `family`.
    pub fn new(family: IpFamily) -> Self {
        Self {
            family,
            ..Default::default()
        }
    }
}

/// The entries of one Service in a map keyed by service port, by range (the key orders by
/// Service first), so looking at changed Services costs O(changed ports), not O(all ports).
pub fn ports_of<'a, V>(
    map: &'a BTreeMap<ServicePortName, V>,
    service: &'a ServiceName,
) -> impl Iterator<Item = (&'a ServicePortName, &'a V)> + 'a {
    let first = ServicePortName {
        service: service.clone(),
        port_name: "".into(),
        protocol: Protocol::Tcp,
    };
    map.range(first..).take_while(move |(k, _)| &k.service == service)
}

/// Removes every port of Service `name` from a map keyed by service port: O(its ports).
pub fn remove_ports_of<V>(map: &mut BTreeMap<ServicePortName, V>, name: &ServiceName) {
    let keys: Vec<ServicePortName> = ports_of(map, name).map(|(k, _)| k.clone()).collect();
    for key in keys {
        map.remove(&key);
    }
}

/// What a sync programs: one [`Snapshot`] per family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DualSnapshot {
    /// IPv4 services and endpoints.
    pub v4: Snapshot,
    /// IPv6 services and endpoints.
    pub v6: Snapshot,
}

impl Default for DualSnapshot {
    fn default() -> Self {
        Self {
            v4: Snapshot::new(IpFamily::V4),
            v6: Snapshot::new(IpFamily::V6),
        }
    }
}

impl DualSnapshot {
    /// The snapshot of `family`.
    pub fn get(&self, family: IpFamily) -> &Snapshot {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }

    /// The snapshot of `family`, mutably.
    pub fn get_mut(&mut self, family: IpFamily) -> &mut Snapshot {
        match family {
            IpFamily::V4 => &mut self.v4,
            IpFamily::V6 => &mut self.v6,
        }
    }

    /// Both snapshots, IPv4 first.
    pub fn families(&self) -> [&Snapshot; 2] {
        [&self.v4, &self.v6]
    }
}

impl From<Snapshot> for DualSnapshot {
    /// A dual snapshot with `snapshot` in its family and nothing in the other.
    fn from(snapshot: Snapshot) -> Self {
        let mut dual = DualSnapshot::default();
        let family = snapshot.family;
        *dual.get_mut(family) = snapshot;
        dual
    }
}

/// What changed since the last sync.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services whose ports or endpoints changed (added, updated or deleted).
    pub services: BTreeSet<ServiceName>,
}

/// Facts about the node the backend programs, used to categorise endpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// Node name.
    pub name: String,
    /// Node's InternalIP addresses (one per family on dual-stack nodes).
    pub addresses: Vec<IpAddr>,
    /// Zone label (`topology.kubernetes.io/zone`), for topology hints.
    pub zone: Option<String>,
}

/// Endpoints of one service port, split the way kube-proxy splits them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Categorized<'a> {
    /// Endpoints for cluster-wide traffic policy.
    pub cluster: Vec<&'a Endpoint>,
    /// Endpoints on this node, for Local traffic policies.
    pub local: Vec<&'a Endpoint>,
    /// Whether any usable endpoint exists anywhere (cluster or local).
    pub has_any: bool,
}

/// Categorises endpoints as kube-proxy's `CategorizeEndpoints`: use ready endpoints; when none are
/// ready, fall back to serving-and-terminating ones (cluster and local fall back independently,
/// ignoring topology); apply zone hints to cluster endpoints when every ready endpoint has hints
/// and one names this node's zone.
pub fn categorize<'a>(endpoints: &'a [Endpoint], node: &NodeInfo) -> Categorized<'a> {
    let usable = |eps: Vec<&'a Endpoint>| -> Vec<&'a Endpoint> {
        let ready: Vec<&Endpoint> = eps.iter().copied().filter(|e| e.ready).collect();
        if !ready.is_empty() {
            return ready;
        }
        eps.into_iter().filter(|e| e.serving && e.terminating).collect()
    };
    let mut cluster = usable(endpoints.iter().collect());
    if let Some(zone) = &node.zone {
        let all_hinted = !cluster.is_empty() && cluster.iter().all(|e| !e.zone_hints.is_empty());
        if all_hinted && cluster.iter().any(|e| e.zone_hints.contains(zone)) {
            cluster.retain(|e| e.zone_hints.contains(zone));
        }
    }
    let local = usable(
        endpoints
            .iter()
            .filter(|e| e.node_name.as_deref() == Some(node.name.as_str()))
            .collect(),
    );
    let has_any = !cluster.is_empty() || !local.is_empty();
    Categorized {
        cluster,
        local,
        has_any,
    }
}

#[cfg(test)]
mod tests;

/// Test fixtures shared by every backend's tests: builder functions on the model types.
#[cfg(test)]
pub mod fixtures {
    use super::*;

    /// The changes of Services `ns/<name>` for each of `names`.
    pub fn changes(names: &[&str]) -> Changes {
        Changes {
            services: names
                .iter()
                .map(|n| ServiceName {
                    namespace: "ns".into(),
                    name: (*n).into(),
                })
                .collect(),
        }
    }

    /// The service port `namespace/name:port_name` of `protocol`.
    pub fn port_name(namespace: &str, name: &str, port_name: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName {
            service: ServiceName {
                namespace: namespace.into(),
                name: name.into(),
            },
            port_name: port_name.into(),
            protocol,
        }
    }

    /// A plain ClusterIP service port (no NodePort, external IPs, affinity or Local policies).
    pub fn cluster_ip(name: ServicePortName, cluster_ip: impl Into<IpAddr>, port: u16) -> ServicePort {
        ServicePort {
            name,
            cluster_ip: cluster_ip.into(),
            port,
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            affinity_timeout_seconds: None,
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: None,
        }
    }

    /// A ready endpoint on `node`.
    pub fn ready(ip: impl Into<IpAddr>, port: u16, node: &str) -> Endpoint {
        Endpoint {
            ip: ip.into(),
            port,
            ready: true,
            serving: true,
            terminating: false,
            node_name: Some(node.into()),
            zone_hints: vec![],
        }
    }

    /// The IPv6 twin of an IPv4 address: `a.b.c.d` becomes `fd00::a:b:c:d` (each octet in its own
    /// group, spelled with the same digits), so IPv6 test data reads like the IPv4 original.
    pub fn ipv6_twin(ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(a) => {
                let [a, b, c, d] = a.octets();
                format!("fd00::{a}:{b}:{c}:{d}").parse().unwrap_or(ip)
            }
            v6 => v6,
        }
    }

    /// The twin of an IPv4 network: a byte-aligned `/8k` prefix becomes `/(64+16k)`, which holds
    /// exactly the twins of its addresses; other prefixes widen to the byte-aligned one above them
    /// (octets are spelled in hex groups, so bit prefixes inside an octet have no twin).
    pub fn ipv6_twin_net(net: IpNet) -> IpNet {
        let len = 64 + 16 * (net.prefix_len() / 8);
        IpNet::new(ipv6_twin(net.network()), len)
            .map(|n| n.trunc())
            .unwrap_or(net)
    }

    /// The IPv6 twin of an IPv4 snapshot: every address replaced by its [`ipv6_twin`].
    pub fn ipv6_twin_snapshot(v4: &Snapshot) -> Snapshot {
        let mut v6 = Snapshot::new(IpFamily::V6);
        for (name, port) in &v4.services {
            let mut p = port.clone();
            p.cluster_ip = ipv6_twin(p.cluster_ip);
            p.external_ips = p.external_ips.iter().copied().map(ipv6_twin).collect();
            p.load_balancer_ips = p.load_balancer_ips.iter().copied().map(ipv6_twin).collect();
            p.load_balancer_source_ranges = p
                .load_balancer_source_ranges
                .iter()
                .copied()
                .map(ipv6_twin_net)
                .collect();
            v6.services.insert(name.clone(), p);
        }
        for (name, eps) in &v4.endpoints {
            let mut eps: Vec<Endpoint> = eps
                .iter()
                .cloned()
                .map(|e| Endpoint {
                    ip: ipv6_twin(e.ip),
                    ..e
                })
                .collect();
            eps.sort();
            v6.endpoints.insert(name.clone(), eps);
        }
        v6
    }

    /// A dual-stack snapshot: `v4` and its IPv6 twin.
    pub fn with_ipv6_twin(v4: &Snapshot) -> DualSnapshot {
        DualSnapshot {
            v4: v4.clone(),
            v6: ipv6_twin_snapshot(v4),
        }
    }

    /// Adds a service port and its endpoints (sorted, as the tracker keeps them) to a snapshot
    /// (of the port's family).
    pub fn add(snapshot: &mut Snapshot, port: ServicePort, mut endpoints: Vec<Endpoint>) {
        snapshot.family = port.family();
        endpoints.sort();
        if !endpoints.is_empty() {
            snapshot.endpoints.insert(port.name.clone(), endpoints);
        }
        snapshot.services.insert(port.name.clone(), port);
    }
}
