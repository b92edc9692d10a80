//! The shared service model (kube-proxy's `pkg/proxy` root, sans IO): service ports, endpoints,
//! change tracking and endpoint categorisation. No Kubernetes types leak out of here: [`convert`]
//! turns Services and EndpointSlices into model values; backends see only [`Snapshot`].

pub mod convert;
pub mod tracker;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::Ipv4Addr,
};

pub use ipnet::Ipv4Net;

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

/// A Service, by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
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
    pub port_name: String,
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
    /// ClusterIP (IPv4).
    pub cluster_ip: Ipv4Addr,
    /// Service port.
    pub port: u16,
    /// NodePort, for NodePort and LoadBalancer Services.
    pub node_port: Option<u16>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<Ipv4Addr>,
    /// `status.loadBalancer.ingress[].ip`.
    pub load_balancer_ips: Vec<Ipv4Addr>,
    /// `spec.loadBalancerSourceRanges` (empty: any source).
    pub load_balancer_source_ranges: Vec<Ipv4Net>,
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
    /// Whether the port has destinations outside the cluster (NodePort, external or LB IPs).
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }
}

/// One endpoint of a service port, from an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    /// Address (IPv4).
    pub ip: Ipv4Addr,
    /// Target port.
    pub port: u16,
    /// `conditions.ready` (absent counts as ready).
    pub ready: bool,
    /// `conditions.serving` (absent: same as ready).
    pub serving: bool,
    /// `conditions.terminating`.
    pub terminating: bool,
    /// Node hosting the endpoint.
    pub node_name: Option<String>,
    /// Zones from `hints.forZones` (topology-aware routing).
    pub zone_hints: Vec<String>,
}

/// The state a backend programs: every service port and its endpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Service ports by name.
    pub services: BTreeMap<ServicePortName, ServicePort>,
    /// Endpoints by service port, sorted and de-duplicated.
    pub endpoints: BTreeMap<ServicePortName, Vec<Endpoint>>,
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
    /// Node's primary IPv4 addresses (InternalIP).
    pub addresses: Vec<Ipv4Addr>,
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
    let local = usable(endpoints.iter().filter(|e| e.node_name.as_deref() == Some(node.name.as_str())).collect());
    let has_any = !cluster.is_empty() || !local.is_empty();
    Categorized { cluster, local, has_any }
}

#[cfg(test)]
mod tests;

/// Test fixtures shared by every backend's tests: builder functions on the model types.
#[cfg(test)]
pub mod fixtures {
    use super::*;

    /// The service port `namespace/name:port_name` of `protocol`.
    pub fn port_name(namespace: &str, name: &str, port_name: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName {
            service: ServiceName { namespace: namespace.into(), name: name.into() },
            port_name: port_name.into(),
            protocol,
        }
    }

    /// A plain ClusterIP service port (no NodePort, external IPs, affinity or Local policies).
    pub fn cluster_ip(name: ServicePortName, cluster_ip: Ipv4Addr, port: u16) -> ServicePort {
        ServicePort {
            name,
            cluster_ip,
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
    pub fn ready(ip: Ipv4Addr, port: u16, node: &str) -> Endpoint {
        Endpoint { ip, port, ready: true, serving: true, terminating: false, node_name: Some(node.into()), zone_hints: vec![] }
    }

    /// Adds a service port and its endpoints (sorted, as the tracker keeps them) to a snapshot.
    pub fn add(snapshot: &mut Snapshot, port: ServicePort, mut endpoints: Vec<Endpoint>) {
        endpoints.sort();
        if !endpoints.is_empty() {
            snapshot.endpoints.insert(port.name.clone(), endpoints);
        }
        snapshot.services.insert(port.name.clone(), port);
    }
}
