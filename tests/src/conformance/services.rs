//! The Services of the matrix, dual-stack (`RequireDualStack`, fixed ClusterIPs of both families)
//! but for one IPv6-only Service, with one EndpointSlice per family as the EndpointSlice
//! controller makes them. Endpoints are the echo servers (`pods[0]`) of the nodes named by index.
//! Addresses outside the cluster (external IPs, load-balancer IPs) are routed by the fabric to a
//! node, as an external router would ([`Route`]).

use serde_json::{Value, json};

use crate::{
    Family, Result,
    netns::{self, Cluster},
    objects::{Ep, apply_service, apply_slice_family},
};

/// The externalIP of `np`, routed to node-1.
pub const EXTERNAL_IP: &str = "172.18.0.10";
/// Its IPv6 twin.
pub const EXTERNAL_IP6: &str = "fd00:10:251::10";
/// The ingress IP of the `externalTrafficPolicy: Local` LoadBalancer `local`, routed to node-1.
pub const LB_LOCAL: &str = "172.18.0.100";
/// Its IPv6 twin.
pub const LB_LOCAL6: &str = "fd00:10:251::100";
/// The ingress IP of the `externalTrafficPolicy: Cluster` LoadBalancer `lb`, routed to node-3.
pub const LB_CLUSTER: &str = "172.18.0.101";
/// Its IPv6 twin.
pub const LB_CLUSTER6: &str = "fd00:10:251::101";
/// In the Service CIDR, allocated to no Service.
pub const UNALLOCATED: &str = "10.96.0.250";
/// Its IPv6 twin.
pub const UNALLOCATED6: &str = "fd00:10:96::250";
/// `np`'s TCP node port.
pub const NP_TCP: u16 = 30080;
/// `np`'s UDP node port.
pub const NP_UDP: u16 = 30053;
/// `local`'s node port.
pub const LOCAL_TCP: u16 = 30081;
/// `local`'s health-check node port.
pub const HEALTH_CHECK: u16 = 30999;
/// `empty`'s TCP node port.
pub const EMPTY_TCP: u16 = 30082;
/// `empty`'s UDP node port.
pub const EMPTY_UDP: u16 = 30084;
/// `lb`'s node port.
pub const LB_TCP: u16 = 30083;
/// `localterm`'s node port.
pub const LOCALTERM_TCP: u16 = 30085;
/// `stickynp`'s node port.
pub const STICKY_TCP: u16 = 30086;

/// The fabric routes of addresses outside the cluster: (IPv4, IPv6, node index).
pub const ROUTES: [(&str, &str, usize); 3] = [
    (EXTERNAL_IP, EXTERNAL_IP6, 0),
    (LB_LOCAL, LB_LOCAL6, 0),
    (LB_CLUSTER, LB_CLUSTER6, 2),
];

/// What an endpoint's conditions say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Ready (and serving).
    Ready,
    /// Terminating but still serving.
    Terminating,
    /// Terminating and no longer serving.
    Gone,
}

/// One Service of the matrix.
#[derive(Debug)]
pub struct ServiceDef {
    /// Name in `default`.
    pub name: &'static str,
    /// ClusterIP of IPv4 (`None`: IPv6 only).
    pub v4: Option<&'static str>,
    /// ClusterIP of IPv6.
    pub v6: &'static str,
    /// The endpoints: (node index, state).
    pub endpoints: &'static [(usize, State)],
}

const ALL: &[(usize, State)] = &[(0, State::Ready), (1, State::Ready), (2, State::Ready)];

/// Every Service of the matrix.
pub const SERVICES: &[ServiceDef] = &[
    ServiceDef {
        name: "web",
        v4: Some("10.96.0.200"),
        v6: "fd00:10:96::200",
        endpoints: ALL,
    },
    ServiceDef {
        name: "sticky",
        v4: Some("10.96.0.201"),
        v6: "fd00:10:96::201",
        endpoints: ALL,
    },
    ServiceDef {
        name: "np",
        v4: Some("10.96.0.202"),
        v6: "fd00:10:96::202",
        endpoints: &[(1, State::Ready)],
    },
    ServiceDef {
        name: "local",
        v4: Some("10.96.0.203"),
        v6: "fd00:10:96::203",
        endpoints: &[(0, State::Ready), (1, State::Ready)],
    },
    ServiceDef {
        name: "empty",
        v4: Some("10.96.0.204"),
        v6: "fd00:10:96::204",
        endpoints: &[],
    },
    ServiceDef {
        name: "term",
        v4: Some("10.96.0.205"),
        v6: "fd00:10:96::205",
        endpoints: &[(2, State::Terminating)],
    },
    ServiceDef {
        name: "termmix",
        v4: Some("10.96.0.206"),
        v6: "fd00:10:96::206",
        endpoints: &[(2, State::Terminating), (1, State::Ready)],
    },
    ServiceDef {
        name: "notserving",
        v4: Some("10.96.0.207"),
        v6: "fd00:10:96::207",
        endpoints: &[(2, State::Gone)],
    },
    ServiceDef {
        name: "itp",
        v4: Some("10.96.0.208"),
        v6: "fd00:10:96::208",
        endpoints: &[(1, State::Ready)],
    },
    ServiceDef {
        name: "lb",
        v4: Some("10.96.0.209"),
        v6: "fd00:10:96::209",
        endpoints: &[(0, State::Ready), (1, State::Ready)],
    },
    ServiceDef {
        name: "web6only",
        v4: None,
        v6: "fd00:10:96::20a",
        endpoints: ALL,
    },
    ServiceDef {
        name: "localterm",
        v4: Some("10.96.0.211"),
        v6: "fd00:10:96::211",
        endpoints: &[(0, State::Terminating), (1, State::Ready)],
    },
    ServiceDef {
        name: "itpterm",
        v4: Some("10.96.0.212"),
        v6: "fd00:10:96::212",
        endpoints: &[(0, State::Terminating), (1, State::Ready)],
    },
    ServiceDef {
        name: "stickynp",
        v4: Some("10.96.0.213"),
        v6: "fd00:10:96::213",
        endpoints: &[(1, State::Ready), (2, State::Ready)],
    },
];

/// The Service named `name`.
pub fn find(name: &str) -> Option<&'static ServiceDef> {
    SERVICES.iter().find(|s| s.name == name)
}

/// The ClusterIP of Service `name` in `family`.
pub fn cluster_ip(name: &str, family: Family) -> Option<std::net::IpAddr> {
    let s = find(name)?;
    match family {
        Family::V4 => s.v4?.parse().ok(),
        Family::V6 => s.v6.parse().ok(),
    }
}

fn http_port(node_port: Option<u16>) -> Value {
    let mut p = json!({"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"});
    if let Some(n) = node_port {
        p["nodePort"] = json!(n);
    }
    p
}

fn dns_port(node_port: Option<u16>) -> Value {
    let mut p = json!({"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"});
    if let Some(n) = node_port {
        p["nodePort"] = json!(n);
    }
    p
}

/// The spec of `def` without addresses and families, and its status.
fn spec_of(def: &ServiceDef) -> (Value, Option<Value>) {
    let ingress = |v4: &str, v6: &str| Some(json!({"loadBalancer": {"ingress": [{"ip": v4}, {"ip": v6}]}}));
    match def.name {
        "web" => (json!({"ports": [http_port(None), dns_port(None)]}), None),
        "sticky" => (
            json!({"sessionAffinity": "ClientIP", "ports": [http_port(None)]}),
            None,
        ),
        "np" => (
            json!({"type": "NodePort", "externalIPs": [EXTERNAL_IP, EXTERNAL_IP6],
                   "ports": [http_port(Some(NP_TCP)), dns_port(Some(NP_UDP))]}),
            None,
        ),
        "local" => (
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                   "healthCheckNodePort": HEALTH_CHECK,
                   "loadBalancerSourceRanges": [netns::FABRIC_CIDR, netns::FABRIC_CIDR6],
                   "ports": [http_port(Some(LOCAL_TCP))]}),
            ingress(LB_LOCAL, LB_LOCAL6),
        ),
        "lb" => (
            json!({"type": "LoadBalancer", "ports": [http_port(Some(LB_TCP))]}),
            ingress(LB_CLUSTER, LB_CLUSTER6),
        ),
        "empty" => (
            json!({"type": "NodePort", "ports": [http_port(Some(EMPTY_TCP)), dns_port(Some(EMPTY_UDP))]}),
            None,
        ),
        "localterm" => (
            json!({"type": "NodePort", "externalTrafficPolicy": "Local",
                   "ports": [http_port(Some(LOCALTERM_TCP))]}),
            None,
        ),
        "itpterm" => (
            json!({"internalTrafficPolicy": "Local", "ports": [http_port(None)]}),
            None,
        ),
        "stickynp" => (
            json!({"type": "NodePort", "sessionAffinity": "ClientIP",
                   "ports": [http_port(Some(STICKY_TCP))]}),
            None,
        ),
        "itp" => (
            json!({"internalTrafficPolicy": "Local", "ports": [http_port(None)]}),
            None,
        ),
        // term, termmix, notserving, web6only: what differs is in their slices or families.
        _ => (json!({"ports": [http_port(None)]}), None),
    }
}

/// The full spec: addresses and families added.
fn full_spec(def: &ServiceDef) -> (Value, Option<Value>) {
    let (mut spec, status) = spec_of(def);
    if let Some(fields) = spec.as_object_mut() {
        match def.v4 {
            Some(v4) => {
                fields.insert("clusterIP".into(), json!(v4));
                fields.insert("clusterIPs".into(), json!([v4, def.v6]));
                fields.insert("ipFamilyPolicy".into(), json!("RequireDualStack"));
                fields.insert("ipFamilies".into(), json!(["IPv4", "IPv6"]));
            }
            None => {
                fields.insert("clusterIP".into(), json!(def.v6));
                fields.insert("ipFamilyPolicy".into(), json!("SingleStack"));
                fields.insert("ipFamilies".into(), json!(["IPv6"]));
            }
        }
    }
    (spec, status)
}

/// The slice ports of `def` (`(name, targetPort, protocol)`).
fn slice_ports(def: &ServiceDef) -> Vec<(&'static str, u16, &'static str)> {
    let mut ports = vec![("http", 8080, "TCP")];
    if matches!(def.name, "web" | "np" | "empty") {
        ports.push(("dns", 5353, "UDP"));
    }
    ports
}

fn endpoint(cluster: &Cluster, family: Family, (node, state): (usize, State)) -> Ep {
    let n = &cluster.nodes[node];
    let ip = n.pods[0].ip_of(family);
    match state {
        State::Ready => Ep::ready(ip, &n.name),
        State::Terminating => Ep::terminating(ip, &n.name),
        State::Gone => Ep {
            serving: false,
            ..Ep::terminating(ip, &n.name)
        },
    }
}

/// Applies every Service and its slices; `cluster` gives the pods' addresses (the same in every
/// twin).
pub async fn apply_all(admin: &kube::Client, cluster: &Cluster) -> Result<()> {
    for def in SERVICES {
        let (spec, status) = full_spec(def);
        apply_service(admin, def.name, spec, status).await?;
        let families: &[Family] = if def.v4.is_some() {
            &Family::BOTH
        } else {
            &[Family::V6]
        };
        for &family in families {
            let eps: Vec<Ep> = def
                .endpoints
                .iter()
                .map(|&e| endpoint(cluster, family, e))
                .collect();
            apply_slice_family(admin, def.name, family, &slice_ports(def), &eps).await?;
        }
    }
    Ok(())
}
