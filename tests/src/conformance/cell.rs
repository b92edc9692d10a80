//! The cells of the matrix: who connects where, over which protocol and family, and how many
//! attempts it takes. A cell is named without its family (`np: fabric → node-1:30080/tcp`); the
//! matrix holds it once per family where its target exists in that family.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::{
    Family,
    netns::{self, Cluster, Node},
    stats::{FALSE_FAILURE, SPREAD_2, SPREAD_3, samples_to_see},
};

use super::services;

/// Who connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Client {
    /// The client pod (`pods[1]`) of node `i` (0-based).
    Pod(usize),
    /// The endpoint pod (`pods[0]`, running the echo server) of node `i`: hairpin.
    Endpoint(usize),
    /// Node `i` itself (its own namespace).
    Host(usize),
    /// The fabric: outside the cluster.
    Fabric,
}

/// Where to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The ClusterIP of a Service of the matrix.
    ClusterIp(&'static str),
    /// Node `i`'s address on the fabric.
    NodeIp(usize),
    /// Node `i`'s address on its pod bridge (`cbr0`): a local address that is not the node's
    /// primary one.
    Cbr0(usize),
    /// The node's loopback (`127.0.0.1`, `::1`).
    Loopback,
    /// A fixed address pair (IPv4, IPv6): external IPs, load-balancer IPs, unallocated ones.
    Fixed(&'static str, &'static str, &'static str),
}

/// How a cell is checked, which fixes its number of attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Answers spread over the Service's endpoints: `SPREAD_3`/`SPREAD_2` attempts and
    /// `stats::check_uniform` (false failure <= 1e-6; catches 2:1:1 with >= 0.999, 2:1 with >= 0.99).
    Spread,
    /// Every endpoint that may answer is seen: enough attempts that each of the Service's `k`
    /// endpoints, chosen uniformly, is missed with probability <= 1e-6 / k (all seen with
    /// probability >= 1 - 1e-6 by the union bound); at least 3.
    Cover,
    /// ClientIP affinity: 31 attempts from one client. With affinity they all land on one
    /// endpoint (deterministic); without, 31 uniform choices among 2 do with probability
    /// 2 * 2^-31 < 1e-9 (among 3: 3 * 3^-31).
    Sticky,
    /// One HTTP GET of a health-check node port: its status code.
    Http,
}

/// One cell, without its family.
#[derive(Debug, Clone)]
pub struct Cell {
    /// `service: client → target/proto`.
    pub name: String,
    /// The Service whose endpoints may answer (`None`: an address of no Service).
    pub service: Option<&'static str>,
    /// Who connects.
    pub client: Client,
    /// Where to.
    pub target: Target,
    /// Destination port.
    pub port: u16,
    /// UDP (else TCP).
    pub udp: bool,
    /// How it is checked.
    pub check: Check,
}

/// Attempts of a cell of `check` whose Service has `endpoints` endpoints.
pub fn attempts(check: Check, endpoints: usize) -> u32 {
    match check {
        Check::Spread if endpoints == 2 => SPREAD_2 as u32,
        Check::Spread => SPREAD_3 as u32,
        Check::Sticky => 31,
        Check::Http => 1,
        Check::Cover if endpoints <= 1 => 3,
        Check::Cover => {
            let k = endpoints as f64;
            samples_to_see(1.0 / k, FALSE_FAILURE / k).max(3)
        }
    }
}

impl Cell {
    /// The cell's destination in `family`, if its target has an address there.
    pub fn destination(&self, cluster: &Cluster, family: Family) -> Option<SocketAddr> {
        let ip = match self.target {
            Target::ClusterIp(svc) => services::cluster_ip(svc, family)?,
            Target::NodeIp(i) => cluster.nodes[i].ip_of(family),
            Target::Cbr0(i) => bridge_ip(&cluster.nodes[i], family),
            Target::Loopback => match family {
                Family::V4 => IpAddr::V4(Ipv4Addr::LOCALHOST),
                Family::V6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
            },
            Target::Fixed(_, v4, v6) => match family {
                Family::V4 => v4.parse().ok()?,
                Family::V6 => v6.parse().ok()?,
            },
        };
        Some(SocketAddr::new(ip, self.port))
    }

    /// The namespace the client runs in.
    pub fn client_netns(&self, cluster: &Cluster) -> String {
        match self.client {
            Client::Pod(i) => cluster.nodes[i].pods[1].netns.clone(),
            Client::Endpoint(i) => cluster.nodes[i].pods[0].netns.clone(),
            Client::Host(i) => cluster.nodes[i].netns.clone(),
            Client::Fabric => cluster.fabric.clone(),
        }
    }

    /// The pods that may answer: the Service's endpoints, by name.
    pub fn endpoints(&self) -> Vec<String> {
        self.service
            .and_then(services::find)
            .map(|s| s.endpoints.iter().map(|(node, _)| endpoint_name(*node)).collect())
            .unwrap_or_default()
    }

    /// This cell's number of attempts.
    pub fn attempts(&self) -> u32 {
        attempts(self.check, self.endpoints().len())
    }
}

/// Node `i`'s address on its pod bridge.
pub fn bridge_ip(node: &Node, family: Family) -> IpAddr {
    let i = node_number(node);
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::new(10, 244, i as u8, 1)),
        Family::V6 => IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x244, i, 0, 0, 0, 1)),
    }
}

/// `node-3` → 3.
fn node_number(node: &Node) -> u16 {
    node.name
        .strip_prefix("node-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The echo server's name on node `i` (0-based): its `pods[0]`.
pub fn endpoint_name(node: usize) -> String {
    format!("node-{}-pod-1", node + 1)
}

fn client_text(client: Client) -> String {
    match client {
        Client::Pod(i) => format!("node-{} pod", i + 1),
        Client::Endpoint(i) => format!("{} (itself an endpoint)", endpoint_name(i)),
        Client::Host(i) => format!("node-{}", i + 1),
        Client::Fabric => "fabric".into(),
    }
}

fn target_text(target: Target) -> String {
    match target {
        Target::ClusterIp(_) => "ClusterIP".into(),
        Target::NodeIp(i) => format!("node-{}", i + 1),
        Target::Cbr0(i) => format!("node-{} cbr0", i + 1),
        Target::Loopback => "loopback".into(),
        Target::Fixed(name, _, _) => name.into(),
    }
}

fn cell(
    service: Option<&'static str>,
    client: Client,
    target: Target,
    port: u16,
    udp: bool,
    check: Check,
) -> Cell {
    let name = format!(
        "{}: {} → {}:{port}/{}",
        service.unwrap_or("(no Service)"),
        client_text(client),
        target_text(target),
        if udp { "udp" } else { "tcp" }
    );
    Cell {
        name,
        service,
        client,
        target,
        port,
        udp,
        check,
    }
}

fn tcp(service: &'static str, client: Client, target: Target, port: u16, check: Check) -> Cell {
    cell(Some(service), client, target, port, false, check)
}

fn udp(service: &'static str, client: Client, target: Target, port: u16, check: Check) -> Cell {
    cell(Some(service), client, target, port, true, check)
}

/// Every cell, without families.
pub fn cells() -> Vec<Cell> {
    use Check::*;
    use Client::*;
    use Target::*;
    let ext = Fixed("externalIP", services::EXTERNAL_IP, services::EXTERNAL_IP6);
    let lb_local = Fixed("LB IP", services::LB_LOCAL, services::LB_LOCAL6);
    let lb = Fixed("LB IP", services::LB_CLUSTER, services::LB_CLUSTER6);
    let unallocated = Fixed(
        "unallocated Service-CIDR IP",
        services::UNALLOCATED,
        services::UNALLOCATED6,
    );
    vec![
        tcp("web", Pod(0), ClusterIp("web"), 80, Spread),
        udp("web", Pod(0), ClusterIp("web"), 53, Spread),
        tcp("web", Host(0), ClusterIp("web"), 80, Cover),
        tcp("web", Endpoint(0), ClusterIp("web"), 80, Cover),
        udp("web", Endpoint(0), ClusterIp("web"), 53, Cover),
        tcp("sticky", Pod(0), ClusterIp("sticky"), 80, Sticky),
        tcp("np", Fabric, NodeIp(0), services::NP_TCP, Cover),
        tcp("np", Fabric, NodeIp(1), services::NP_TCP, Cover),
        udp("np", Fabric, NodeIp(0), services::NP_UDP, Cover),
        tcp("np", Fabric, ext, 80, Cover),
        tcp("np", Pod(0), ext, 80, Cover),
        tcp("np", Pod(2), NodeIp(0), services::NP_TCP, Cover),
        tcp("np", Host(0), NodeIp(0), services::NP_TCP, Cover),
        tcp("np", Host(0), Loopback, services::NP_TCP, Cover),
        tcp("np", Pod(0), Cbr0(0), services::NP_TCP, Cover),
        tcp("local", Fabric, NodeIp(0), services::LOCAL_TCP, Cover),
        tcp("local", Fabric, NodeIp(2), services::LOCAL_TCP, Cover),
        tcp("local", Fabric, lb_local, 80, Cover),
        tcp("local", Pod(1), lb_local, 80, Cover),
        tcp("local", Pod(2), ClusterIp("local"), 80, Cover),
        tcp("local", Host(2), NodeIp(2), services::LOCAL_TCP, Cover),
        tcp("local", Host(0), NodeIp(0), services::LOCAL_TCP, Cover),
        tcp("local", Pod(2), NodeIp(2), services::LOCAL_TCP, Cover),
        tcp("local", Pod(0), NodeIp(0), services::LOCAL_TCP, Cover),
        tcp("local", Host(2), lb_local, 80, Cover),
        tcp("local", Fabric, NodeIp(0), services::HEALTH_CHECK, Http),
        tcp("local", Fabric, NodeIp(2), services::HEALTH_CHECK, Http),
        tcp("lb", Fabric, lb, 80, Cover),
        tcp("lb", Pod(0), lb, 80, Cover),
        tcp("empty", Pod(0), ClusterIp("empty"), 80, Cover),
        udp("empty", Pod(0), ClusterIp("empty"), 53, Cover),
        tcp("empty", Fabric, NodeIp(0), services::EMPTY_TCP, Cover),
        udp("empty", Fabric, NodeIp(0), services::EMPTY_UDP, Cover),
        tcp("term", Pod(0), ClusterIp("term"), 80, Cover),
        tcp("termmix", Pod(0), ClusterIp("termmix"), 80, Cover),
        tcp("notserving", Pod(0), ClusterIp("notserving"), 80, Cover),
        tcp("itp", Pod(1), ClusterIp("itp"), 80, Cover),
        tcp("itp", Pod(0), ClusterIp("itp"), 80, Cover),
        tcp("itp", Host(0), ClusterIp("itp"), 80, Cover),
        cell(None, Pod(0), unallocated, 80, false, Cover),
        tcp("web6only", Pod(0), ClusterIp("web6only"), 80, Cover),
        tcp("localterm", Fabric, NodeIp(0), services::LOCALTERM_TCP, Cover),
        tcp("localterm", Fabric, NodeIp(1), services::LOCALTERM_TCP, Cover),
        tcp("itpterm", Pod(0), ClusterIp("itpterm"), 80, Cover),
        tcp("itpterm", Pod(1), ClusterIp("itpterm"), 80, Cover),
        tcp("stickynp", Fabric, NodeIp(0), services::STICKY_TCP, Sticky),
    ]
}

/// The owner of an address a server saw as its peer: a pod's name, `node-i` (its fabric address),
/// `node-i cbr0` (its pod-bridge address), `fabric`, `loopback`, or the address itself.
pub fn owner(cluster: &Cluster, ip: IpAddr) -> String {
    if ip == netns::fabric_ip(Family::of(ip)) {
        return "fabric".into();
    }
    if ip.is_loopback() {
        return "loopback".into();
    }
    for node in &cluster.nodes {
        if Family::BOTH.iter().any(|&f| node.ip_of(f) == ip) {
            return node.name.clone();
        }
        if Family::BOTH.iter().any(|&f| bridge_ip(node, f) == ip) {
            return format!("{} cbr0", node.name);
        }
        if let Some(pod) = node
            .pods
            .iter()
            .find(|p| Family::BOTH.iter().any(|&f| p.ip_of(f) == ip))
        {
            return pod.name.clone();
        }
    }
    ip.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_names_are_unique_and_name_real_services() {
        let cells = cells();
        let mut names: Vec<&str> = cells.iter().map(|c| c.name.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), cells.len(), "duplicate cell names");
        for c in &cells {
            if let Some(s) = c.service {
                assert!(services::find(s).is_some(), "{}: no Service {s}", c.name);
            }
        }
    }

    #[test]
    fn attempts_cover_every_endpoint() {
        // 3 endpoints: each missed with probability (2/3)^n <= 1e-6 / 3.
        let n = attempts(Check::Cover, 3);
        assert!(3.0 * (2.0f64 / 3.0).powi(n as i32) <= FALSE_FAILURE, "{n}");
        let n = attempts(Check::Cover, 2);
        assert!(2.0 * 0.5f64.powi(n as i32) <= FALSE_FAILURE, "{n}");
        assert_eq!(attempts(Check::Spread, 3), SPREAD_3 as u32);
        assert_eq!(attempts(Check::Cover, 0), 3);
    }
}
