//! Stale UDP flows (kube-proxy's conntrack cleanup, sans IO).
//!
//! UDP has no connection to close: a client that keeps sending from one socket keeps its
//! conntrack entry, and with it the DNAT to the endpoint chosen first (or no DNAT at all, if the
//! flow started before the Service had endpoints), for as long as it sends. So after a sync that
//! changed UDP Services, and after the agent's first sync, every UDP entry to a service
//! destination that has endpoints must be DNATed to one of them, and no entry may remain to a
//! destination that went away; the others are deleted, and the client's next datagram takes the
//! current rules. Entries are judged against the programmed snapshot itself (not against a diff
//! of endpoints), so the cleanup also fixes flows that started before the agent and flows whose
//! endpoint only changed its target port. (Flows to Services deleted while the agent was down are
//! not known to it, as for kube-proxy.) This module decides; [`crate::sys::conntrack`] dumps and
//! deletes.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::model::{Changes, NodeInfo, Protocol, ServicePort, Snapshot, categorize, ports_of};
pub use crate::sys::conntrack::Flow;

/// An endpoint a flow may be DNATed to.
type Target = (IpAddr, u16);

/// The virtual destinations of one family's service ports (protocol number, ClusterIP, external
/// or load-balancer IP, port), for flows to them that no proxy NATed.
///
/// A connection that starts while no rules DNAT a Service (say, a cut-over to another proxy
/// whose rules serve nothing) leaves an entry without NAT, and conntrack keeps it unreplied for
/// up to 120 s (TCP `SYN_SENT`): every packet of the same four-tuple skips the nat hooks meanwhile,
/// so a client that retries from the same port is rejected as traffic to a ClusterIP port that is
/// no Service, whichever proxy serves by then. After every swap of the serving entry points those
/// entries are deleted, and the next packet is NATed afresh.
#[derive(Debug, Default)]
pub struct UnnatedServiceFlows(BTreeSet<(u8, IpAddr, u16)>);

impl UnnatedServiceFlows {
    /// The virtual destinations of `snapshot`'s service ports.
    pub fn of(snapshot: &Snapshot) -> Self {
        let destinations = snapshot.services.values().flat_map(|sp| {
            let protocol = sp.name.protocol.number();
            std::iter::once(sp.cluster_ip)
                .chain(sp.external_ips.iter().copied())
                .chain(sp.load_balancer_ips.iter().copied())
                .map(move |ip| (protocol, ip, sp.port))
        });
        Self(destinations.collect())
    }

    /// No service port: nothing to look for.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `flow` goes to a service port's virtual address and was not DNATed (it would be answered
    /// by the address itself).
    pub fn matches(&self, flow: &Flow) -> bool {
        flow.reply_src == flow.orig_dst
            && flow.reply_sport == flow.orig_dport
            && self.0.contains(&(flow.protocol, flow.orig_dst, flow.orig_dport))
    }
}

/// The endpoints a port DNATs internal and external traffic to.
type Targets = (BTreeSet<Target>, BTreeSet<Target>);

/// The UDP destinations of one family's Services that have endpoints, with the endpoints each
/// may be DNATed to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UdpDestinations {
    /// Service address and port (ClusterIP, external and load-balancer IPs).
    pub services: BTreeMap<(IpAddr, u16), BTreeSet<Target>>,
    /// NodePorts.
    pub node_ports: BTreeMap<u16, BTreeSet<Target>>,
    /// The addresses NodePorts are served on; `None`: every local address (then any destination
    /// with a NodePort's number counts, as kube-proxy matches them).
    pub node_port_addresses: Option<BTreeSet<IpAddr>>,
}

impl UdpDestinations {
    /// The UDP destinations of `snapshot` as this node DNATs them; NodePorts are served on
    /// `node_port_addresses` (`None`: every local address).
    pub fn of(snapshot: &Snapshot, node: &NodeInfo, node_port_addresses: Option<&[IpAddr]>) -> Self {
        let mut d = UdpDestinations {
            node_port_addresses: node_port_addresses.map(|a| a.iter().copied().collect()),
            ..Default::default()
        };
        for port in snapshot
            .services
            .values()
            .filter(|p| p.name.protocol == Protocol::Udp)
        {
            let (internal, external) = targets(port, snapshot, node);
            if !internal.is_empty() {
                d.services.insert((port.cluster_ip, port.port), internal);
            }
            if external.is_empty() {
                continue;
            }
            for ip in port.external_ips.iter().chain(port.load_balancer_ips.iter()) {
                d.services.insert((*ip, port.port), external.clone());
            }
            if let Some(np) = port.node_port {
                d.node_ports.insert(np, external.clone());
            }
        }
        d
    }

    /// Whether `flow` is a UDP flow to one of these destinations that is not DNATed to one of its
    /// endpoints. Flows to destinations without endpoints are left alone (they are rejected).
    pub fn is_stale(&self, flow: &Flow) -> bool {
        if flow.protocol != Protocol::Udp.number() {
            return false;
        }
        let target = (flow.reply_src, flow.reply_sport);
        if let Some(eps) = self.services.get(&(flow.orig_dst, flow.orig_dport)) {
            return !eps.contains(&target);
        }
        match self.node_ports.get(&flow.orig_dport) {
            Some(eps) if self.serves_node_ports_on(&flow.orig_dst) => !eps.contains(&target),
            _ => false,
        }
    }

    fn serves_node_ports_on(&self, addr: &IpAddr) -> bool {
        self.node_port_addresses.as_ref().is_none_or(|a| a.contains(addr))
    }

    /// Whether there is nothing to check (then the kernel need not be read at all).
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && self.node_ports.is_empty()
    }
}

/// The endpoints a port may DNAT internal (ClusterIP) and external traffic to, as the backends
/// do. With `externalTrafficPolicy: Local`, pod and node-local traffic to external destinations
/// still goes to any endpoint, so those flows may point at cluster endpoints too.
fn targets(port: &ServicePort, snapshot: &Snapshot, node: &NodeInfo) -> Targets {
    let eps = snapshot
        .endpoints
        .get(&port.name)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let c = categorize(eps, node);
    let set = |list: &[&crate::model::Endpoint]| list.iter().map(|e| (e.ip, e.port)).collect::<BTreeSet<_>>();
    let internal = if port.internal_policy_local {
        set(&c.local)
    } else {
        set(&c.cluster)
    };
    let external = if port.external_policy_local && !c.local.is_empty() {
        set(&c.local).union(&set(&c.cluster)).copied().collect()
    } else if port.external_policy_local {
        BTreeSet::new() // no local endpoint: external traffic is dropped, nothing to check
    } else {
        set(&c.cluster)
    };
    (internal, external)
}

/// What a cleanup after one sync deletes: flows to current destinations that are not DNATed to
/// a current endpoint, and flows to destinations that went away.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cleanup {
    /// The programmed UDP destinations.
    pub current: UdpDestinations,
    /// Service destinations of changed Services that no longer exist (or have no endpoints left).
    pub gone_services: BTreeSet<(IpAddr, u16)>,
    /// NodePorts of changed Services that no longer exist (or have no endpoints left).
    pub gone_node_ports: BTreeSet<u16>,
}

impl Cleanup {
    /// Whether `flow` must be deleted.
    pub fn is_stale(&self, flow: &Flow) -> bool {
        if flow.protocol != Protocol::Udp.number() {
            return false;
        }
        self.current.is_stale(flow)
            || self.gone_services.contains(&(flow.orig_dst, flow.orig_dport))
            || (self.gone_node_ports.contains(&flow.orig_dport)
                && self.current.serves_node_ports_on(&flow.orig_dst))
    }

    /// Whether it can delete nothing.
    pub fn is_empty(&self) -> bool {
        self.current.is_empty() && self.gone_services.is_empty() && self.gone_node_ports.is_empty()
    }

    /// Merges a cleanup that could not run into this newer one: its destinations that are still
    /// gone stay gone; what it knew of current destinations is replaced by this one's.
    pub fn merge(&mut self, older: Cleanup) {
        self.gone_services.extend(
            older
                .gone_services
                .into_iter()
                .filter(|d| !self.current.services.contains_key(d)),
        );
        self.gone_node_ports.extend(
            older
                .gone_node_ports
                .into_iter()
                .filter(|p| !self.current.node_ports.contains_key(p)),
        );
    }
}

/// The cleanup a sync from `old` to `new` needs, if any: when a UDP port of a changed Service
/// gained or lost a destination or an endpoint. `None` for `old` (the agent's first sync) checks
/// every UDP destination.
pub fn cleanup_after(
    old: Option<&Snapshot>,
    new: &Snapshot,
    changes: &Changes,
    node: &NodeInfo,
    node_port_addresses: Option<&[IpAddr]>,
) -> Option<Cleanup> {
    let udp = |s: &Snapshot, service| -> Vec<(ServicePort, Targets)> {
        ports_of(&s.services, service)
            .filter(|(k, _)| k.protocol == Protocol::Udp)
            .map(|(_, p)| (p.clone(), targets(p, s, node)))
            .collect()
    };
    if let Some(old) = old
        && !changes
            .services
            .iter()
            .any(|service| udp(old, service) != udp(new, service))
    {
        return None;
    }
    let current = UdpDestinations::of(new, node, node_port_addresses);
    let Some(old) = old else {
        return (!current.is_empty()).then(|| Cleanup {
            current,
            ..Default::default()
        });
    };
    let before = UdpDestinations::of(old, node, node_port_addresses);
    let gone_services = before
        .services
        .keys()
        .filter(|k| !current.services.contains_key(*k))
        .copied()
        .collect();
    let gone_node_ports = before
        .node_ports
        .keys()
        .filter(|k| !current.node_ports.contains_key(*k))
        .copied()
        .collect();
    Some(Cleanup {
        current,
        gone_services,
        gone_node_ports,
    })
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::{ServiceName, fixtures};

    fn ip(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        Ipv4Addr::new(a, b, c, d).into()
    }

    fn snapshot(endpoints: &[(u8, u16)], protocol: Protocol) -> Snapshot {
        let mut s = Snapshot::default();
        let mut port = fixtures::cluster_ip(
            fixtures::port_name("ns", "dns", "", protocol),
            ip(10, 96, 0, 10),
            53,
        );
        port.node_port = Some(30053);
        port.external_ips = vec![ip(192, 0, 2, 1)];
        fixtures::add(
            &mut s,
            port,
            endpoints
                .iter()
                .map(|(n, p)| fixtures::ready(ip(10, 244, 1, *n), *p, "n2"))
                .collect(),
        );
        s
    }

    fn node() -> NodeInfo {
        NodeInfo {
            name: "n1".into(),
            addresses: vec![ip(10, 250, 0, 11)],
            zone: None,
        }
    }

    fn flow(dst: IpAddr, dport: u16, src: IpAddr, sport: u16) -> Flow {
        Flow {
            protocol: 17,
            orig_dst: dst,
            orig_dport: dport,
            reply_src: src,
            reply_sport: sport,
        }
    }

    #[test]
    fn unnated_flows_to_service_addresses_and_nothing_else() {
        let d = UnnatedServiceFlows::of(&snapshot(&[(12, 53)], Protocol::Tcp));
        assert!(!d.is_empty());
        let (cip, ext) = (ip(10, 96, 0, 10), ip(192, 0, 2, 1));
        let tcp = |f: Flow| Flow { protocol: 6, ..f };
        let cases = [
            ("to the ClusterIP, not NATed", tcp(flow(cip, 53, cip, 53)), true),
            ("to an external IP, not NATed", tcp(flow(ext, 53, ext, 53)), true),
            (
                "to the ClusterIP, DNATed",
                tcp(flow(cip, 53, ip(10, 244, 1, 12), 53)),
                false,
            ),
            (
                "to another port of the ClusterIP",
                tcp(flow(cip, 54, cip, 54)),
                false,
            ),
            ("another protocol", flow(cip, 53, cip, 53), false),
            (
                "to an address of no Service",
                tcp(flow(ip(10, 0, 0, 1), 53, ip(10, 0, 0, 1), 53)),
                false,
            ),
        ];
        for (what, f, unnated) in cases {
            assert_eq!(d.matches(&f), unnated, "{what}");
        }
        assert!(UnnatedServiceFlows::of(&Snapshot::default()).is_empty());
    }

    #[test]
    fn flows_not_dnated_to_a_current_endpoint_are_stale() {
        let node_ips = [ip(10, 250, 0, 11)];
        let d = UdpDestinations::of(&snapshot(&[(12, 5353)], Protocol::Udp), &node(), Some(&node_ips));
        let (cip, ext, node_ip) = (ip(10, 96, 0, 10), ip(192, 0, 2, 1), ip(10, 250, 0, 11));
        let cases = [
            (
                "to the current endpoint",
                flow(cip, 53, ip(10, 244, 1, 12), 5353),
                false,
            ),
            (
                "to a removed endpoint",
                flow(cip, 53, ip(10, 244, 1, 11), 5353),
                true,
            ),
            (
                "to the endpoint's old target port",
                flow(cip, 53, ip(10, 244, 1, 12), 5354),
                true,
            ),
            (
                "never DNATed (started before the endpoints)",
                flow(cip, 53, cip, 53),
                true,
            ),
            (
                "external IP, removed endpoint",
                flow(ext, 53, ip(10, 244, 1, 11), 5353),
                true,
            ),
            (
                "NodePort on a node address, removed endpoint",
                flow(node_ip, 30053, ip(10, 244, 1, 11), 5353),
                true,
            ),
            (
                "NodePort number on another address: not ours",
                flow(ip(198, 51, 100, 7), 30053, ip(198, 51, 100, 7), 30053),
                false,
            ),
            ("another port of the ClusterIP", flow(cip, 54, cip, 54), false),
        ];
        for (what, f, stale) in cases {
            assert_eq!(d.is_stale(&f), stale, "{what}");
        }
        assert!(
            !d.is_stale(&Flow {
                protocol: 6,
                ..flow(cip, 53, cip, 53)
            }),
            "TCP is left to TCP"
        );
        // Without endpoints nothing is checked: the flows are rejected, not DNATed.
        assert!(UdpDestinations::of(&snapshot(&[], Protocol::Udp), &node(), None).is_empty());
        assert!(UdpDestinations::of(&snapshot(&[(12, 5353)], Protocol::Tcp), &node(), None).is_empty());
        // NodePorts on every local address: any destination with the NodePort's number counts.
        let all = UdpDestinations::of(&snapshot(&[(12, 5353)], Protocol::Udp), &node(), None);
        assert!(
            all.is_stale(&flow(ip(10, 250, 0, 99), 30053, ip(10, 244, 1, 11), 5353)),
            "a secondary address"
        );
        assert!(!all.is_stale(&flow(ip(10, 250, 0, 99), 30053, ip(10, 244, 1, 12), 5353)));
    }

    #[test]
    fn local_traffic_policies_allow_the_endpoints_the_backends_use() {
        let mut s = Snapshot::default();
        let mut port = fixtures::cluster_ip(
            fixtures::port_name("ns", "lb", "", Protocol::Udp),
            ip(10, 96, 0, 20),
            53,
        );
        port.load_balancer_ips = vec![ip(192, 0, 2, 20)];
        port.external_policy_local = true;
        port.internal_policy_local = true;
        let local = fixtures::ready(ip(10, 244, 1, 11), 5353, "n1");
        let remote = fixtures::ready(ip(10, 244, 2, 11), 5353, "n2");
        fixtures::add(&mut s, port, vec![local, remote]);
        let d = UdpDestinations::of(&s, &node(), None);
        let (cip, lb) = (ip(10, 96, 0, 20), ip(192, 0, 2, 20));
        // ITP=Local: the ClusterIP goes to the local endpoint only.
        assert!(!d.is_stale(&flow(cip, 53, ip(10, 244, 1, 11), 5353)));
        assert!(d.is_stale(&flow(cip, 53, ip(10, 244, 2, 11), 5353)));
        // ETP=Local: pods and the node reach the LB IP through any endpoint; outside clients
        // through the local one. Both are current.
        assert!(!d.is_stale(&flow(lb, 53, ip(10, 244, 1, 11), 5353)));
        assert!(!d.is_stale(&flow(lb, 53, ip(10, 244, 2, 11), 5353)));
    }

    #[test]
    fn a_cleanup_that_could_not_run_keeps_what_is_still_gone() {
        let n = node();
        let changed = Changes {
            services: [ServiceName {
                namespace: "ns".into(),
                name: "dns".into(),
            }]
            .into(),
        };
        let b = snapshot(&[(12, 5353)], Protocol::Udp);
        let failed =
            cleanup_after(Some(&b), &Snapshot::default(), &changed, &n, None).expect("service deleted");
        // Later the Service is back with the same ClusterIP: its destinations are current again.
        let mut next =
            cleanup_after(Some(&Snapshot::default()), &b, &changed, &n, None).expect("service added");
        next.merge(failed.clone());
        assert!(
            next.gone_services.is_empty() && next.gone_node_ports.is_empty(),
            "{next:?}"
        );
        // Or it stays gone: the failed deletions are still wanted.
        let mut later = Cleanup::default();
        later.merge(failed);
        assert!(later.is_stale(&flow(ip(10, 96, 0, 10), 53, ip(10, 244, 1, 12), 5353)));
    }

    #[test]
    fn cleanup_runs_when_a_udp_destination_or_endpoint_changed() {
        let changed = Changes {
            services: [ServiceName {
                namespace: "ns".into(),
                name: "dns".into(),
            }]
            .into(),
        };
        let (a, b, moved) = (
            snapshot(&[(11, 5353), (12, 5353)], Protocol::Udp),
            snapshot(&[(12, 5353)], Protocol::Udp),
            snapshot(&[(12, 5354)], Protocol::Udp),
        );
        let n = node();
        let needed = |old: Option<&Snapshot>, new: &Snapshot, changes: &Changes| {
            cleanup_after(old, new, changes, &n, None).is_some()
        };
        assert!(!needed(Some(&a), &a, &changed), "unchanged");
        assert!(needed(Some(&a), &b, &changed), "endpoint removed");
        assert!(needed(Some(&b), &a, &changed), "endpoint added");
        assert!(needed(Some(&b), &moved, &changed), "target port changed");
        assert!(
            !needed(Some(&a), &b, &Changes::default()),
            "services outside the changes"
        );
        assert!(
            needed(None, &b, &Changes::default()),
            "the first sync checks everything"
        );
        assert!(
            !needed(None, &snapshot(&[(12, 5353)], Protocol::Tcp), &Changes::default()),
            "nothing UDP"
        );

        // A deleted Service: flows to its destinations go, wherever they were DNATed to.
        let node_ips = [ip(10, 250, 0, 11)];
        let deleted =
            cleanup_after(Some(&b), &Snapshot::default(), &changed, &n, Some(&node_ips)).expect("cleanup");
        let (cip, node_ip, ep) = (ip(10, 96, 0, 10), ip(10, 250, 0, 11), ip(10, 244, 1, 12));
        assert!(deleted.is_stale(&flow(cip, 53, ep, 5353)));
        assert!(deleted.is_stale(&flow(ip(192, 0, 2, 1), 53, ep, 5353)));
        assert!(deleted.is_stale(&flow(node_ip, 30053, ep, 5353)));
        assert!(!deleted.is_stale(&flow(cip, 54, ep, 5353)));
    }
}
