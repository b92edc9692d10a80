//! Stale UDP flows after a sync (kube-proxy's conntrack cleanup, sans IO).
//!
//! UDP has no connection to close: a client that keeps sending from one socket keeps its
//! conntrack entry, and with it the DNAT to the endpoint chosen first, even after that endpoint
//! left the Service. So after each sync the agent deletes the conntrack entries that point at
//! endpoints a changed Service no longer uses, and the entries to destinations that gained their
//! first endpoint (created while packets were rejected, they carry no DNAT). This module decides
//! which flows those are; [`crate::sys::conntrack`] finds and deletes them.

use std::{collections::BTreeSet, net::IpAddr};

use crate::model::{Changes, DualSnapshot, NodeInfo, Protocol, ServicePort, Snapshot, categorize};

/// One conntrack entry, as far as the cleanup looks at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// IP protocol number.
    pub protocol: u8,
    /// Original destination (the service address the client sent to).
    pub orig_dst: IpAddr,
    /// Original destination port.
    pub orig_dport: u16,
    /// Reply source (the endpoint, after DNAT; the original destination without DNAT).
    pub reply_src: IpAddr,
}

/// The UDP flows to delete after one sync.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StaleFlows {
    /// Service destinations (address, port) that gained their first endpoint: every flow to them.
    pub destinations: BTreeSet<(IpAddr, u16)>,
    /// Node ports that gained their first endpoint.
    pub node_ports: BTreeSet<u16>,
    /// (service address, port, endpoint address): flows DNATed to an endpoint no longer used.
    pub endpoints: BTreeSet<(IpAddr, u16, IpAddr)>,
    /// (node port, endpoint address): NodePort flows DNATed to an endpoint no longer used.
    pub node_port_endpoints: BTreeSet<(u16, IpAddr)>,
}

impl StaleFlows {
    /// Whether nothing is stale (then the kernel need not be read at all).
    pub fn is_empty(&self) -> bool {
        self.destinations.is_empty()
            && self.node_ports.is_empty()
            && self.endpoints.is_empty()
            && self.node_port_endpoints.is_empty()
    }

    /// How many rules decide staleness (for logs).
    pub fn len(&self) -> usize {
        self.destinations.len() + self.node_ports.len() + self.endpoints.len() + self.node_port_endpoints.len()
    }

    /// Whether `flow` must be deleted.
    pub fn matches(&self, flow: &Flow) -> bool {
        if flow.protocol != Protocol::Udp.number() {
            return false;
        }
        let (dst, port, ep) = (flow.orig_dst, flow.orig_dport, flow.reply_src);
        self.destinations.contains(&(dst, port))
            || self.node_ports.contains(&port)
            || self.endpoints.contains(&(dst, port, ep))
            || self.node_port_endpoints.contains(&(port, ep))
    }
}

/// The endpoint addresses a service port DNATs to (cluster and local, as the backends use them).
fn used(port: &ServicePort, snapshot: &Snapshot, node: &NodeInfo) -> BTreeSet<IpAddr> {
    let eps = snapshot.endpoints.get(&port.name).map(Vec::as_slice).unwrap_or_default();
    let c = categorize(eps, node);
    c.cluster.iter().chain(c.local.iter()).map(|e| e.ip).collect()
}

/// Service addresses of a port: ClusterIP, external IPs, load-balancer IPs.
fn destinations(port: &ServicePort) -> impl Iterator<Item = IpAddr> + '_ {
    std::iter::once(port.cluster_ip).chain(port.external_ips.iter().copied()).chain(port.load_balancer_ips.iter().copied())
}

/// The stale UDP flows when going from `old` to `new` (only the Services in `changes` can differ).
pub fn stale_flows(old: &DualSnapshot, new: &DualSnapshot, changes: &Changes, node: &NodeInfo) -> StaleFlows {
    let mut stale = StaleFlows::default();
    for (old, new) in old.families().into_iter().zip(new.families()) {
        for service in &changes.services {
            let ports = |s: &'_ Snapshot| -> Vec<ServicePort> {
                s.services.values().filter(|p| &p.name.service == service && p.name.protocol == Protocol::Udp).cloned().collect()
            };
            let (old_ports, new_ports) = (ports(old), ports(new));
            for port in &old_ports {
                let before = used(port, old, node);
                let after = new_ports.iter().find(|p| p.name == port.name).map(|p| used(p, new, node)).unwrap_or_default();
                for ep in before.difference(&after) {
                    for dst in destinations(port) {
                        stale.endpoints.insert((dst, port.port, *ep));
                    }
                    if let Some(np) = port.node_port {
                        stale.node_port_endpoints.insert((np, *ep));
                    }
                }
            }
            for port in &new_ports {
                let before = old_ports.iter().find(|p| p.name == port.name).map(|p| used(p, old, node)).unwrap_or_default();
                if before.is_empty() && !used(port, new, node).is_empty() {
                    stale.destinations.extend(destinations(port).map(|d| (d, port.port)));
                    stale.node_ports.extend(port.node_port);
                }
            }
        }
    }
    stale
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::{ServiceName, fixtures};

    fn ip(last: u8) -> IpAddr {
        Ipv4Addr::new(10, 244, 1, last).into()
    }

    fn snapshot(endpoints: &[u8], node_port: Option<u16>, protocol: Protocol) -> DualSnapshot {
        let mut s = Snapshot::default();
        let mut port = fixtures::cluster_ip(fixtures::port_name("ns", "dns", "", protocol), Ipv4Addr::new(10, 96, 0, 10), 53);
        port.node_port = node_port;
        port.external_ips = vec![Ipv4Addr::new(192, 0, 2, 1).into()];
        fixtures::add(&mut s, port, endpoints.iter().map(|n| fixtures::ready(ip(*n), 5353, "n2")).collect());
        DualSnapshot::from(s)
    }

    fn changed() -> Changes {
        Changes { services: [ServiceName { namespace: "ns".into(), name: "dns".into() }].into() }
    }

    #[test]
    fn removed_endpoints_and_first_endpoints_make_flows_stale() {
        let node = NodeInfo { name: "n1".into(), ..Default::default() };
        let cip: IpAddr = Ipv4Addr::new(10, 96, 0, 10).into();
        let ext: IpAddr = Ipv4Addr::new(192, 0, 2, 1).into();
        let (a, b) = (snapshot(&[11, 12], Some(30053), Protocol::Udp), snapshot(&[12], Some(30053), Protocol::Udp));
        let none = snapshot(&[], Some(30053), Protocol::Udp);
        let deleted = DualSnapshot::default();
        let cases: Vec<(&str, &DualSnapshot, &DualSnapshot, StaleFlows)> = vec![
            ("unchanged", &a, &a, StaleFlows::default()),
            (
                "endpoint removed",
                &a,
                &b,
                StaleFlows {
                    endpoints: [(cip, 53, ip(11)), (ext, 53, ip(11))].into(),
                    node_port_endpoints: [(30053, ip(11))].into(),
                    ..Default::default()
                },
            ),
            ("endpoint added", &b, &a, StaleFlows::default()),
            (
                "first endpoint",
                &none,
                &b,
                StaleFlows { destinations: [(cip, 53), (ext, 53)].into(), node_ports: [30053].into(), ..Default::default() },
            ),
            (
                "service deleted",
                &b,
                &deleted,
                StaleFlows {
                    endpoints: [(cip, 53, ip(12)), (ext, 53, ip(12))].into(),
                    node_port_endpoints: [(30053, ip(12))].into(),
                    ..Default::default()
                },
            ),
        ];
        for (what, old, new, want) in cases {
            assert_eq!(stale_flows(old, new, &changed(), &node), want, "{what}");
        }
        // TCP Services are left to TCP (a closed endpoint resets its connections).
        let tcp = stale_flows(&snapshot(&[11], None, Protocol::Tcp), &snapshot(&[], None, Protocol::Tcp), &changed(), &node);
        assert!(tcp.is_empty());
        // Services outside `changes` are not looked at.
        assert!(stale_flows(&a, &b, &Changes::default(), &node).is_empty());
    }

    #[test]
    fn matching_looks_at_udp_destination_and_reply_source() {
        let cip: IpAddr = Ipv4Addr::new(10, 96, 0, 10).into();
        let stale = StaleFlows {
            endpoints: [(cip, 53, ip(11))].into(),
            node_port_endpoints: [(30053, ip(11))].into(),
            ..Default::default()
        };
        let flow = |protocol, dst, dport, src| Flow { protocol, orig_dst: dst, orig_dport: dport, reply_src: src };
        assert!(stale.matches(&flow(17, cip, 53, ip(11))));
        assert!(!stale.matches(&flow(17, cip, 53, ip(12))), "another endpoint");
        assert!(!stale.matches(&flow(6, cip, 53, ip(11))), "TCP");
        assert!(stale.matches(&flow(17, Ipv4Addr::new(10, 250, 0, 11).into(), 30053, ip(11))), "NodePort on any address");
        assert!(!stale.matches(&flow(17, cip, 54, ip(11))), "another port");
    }
}
