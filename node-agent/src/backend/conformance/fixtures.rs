//! The fixture builder of backend tests: one scenario with every service shape (ClusterIP, UDP
//! with a local endpoint, NodePort and externalIP over SCTP, LoadBalancer with source ranges and
//! `externalTrafficPolicy: Local`, internal policy Local, ClientIP affinity, no and terminating
//! endpoints), in both families as a dual-stack cluster has it, its settings, and one change of
//! it that a partial sync must handle.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{
    backend::Settings,
    model::{
        Changes, DualSnapshot, Endpoint, IpFamily, IpNet, NodeInfo, Protocol, ServicePort, ServicePortName,
        Snapshot, fixtures,
    },
};

pub fn name(ns: &str, svc: &str, port: &str, protocol: Protocol) -> ServicePortName {
    fixtures::port_name(ns, svc, port, protocol)
}

/// The scenario's address `a` in `family`: IPv4 as written; IPv6 maps `10.x.y.z` into
/// `fd00:10:x:y::z` and the documentation ranges `192.0.2.z` / `203.0.113.z` into `2001:db8::z` /
/// `2001:db8:113::z` (each decimal octet spelled as a hex group, so the addresses stay readable).
pub fn addr(family: IpFamily, a: [u8; 4]) -> IpAddr {
    match family {
        IpFamily::V4 => Ipv4Addr::from(a).into(),
        IpFamily::V6 => {
            let text = match a {
                [10, x, y, z] => format!("fd00:10:{x}:{y}::{z}"),
                [192, 0, 2, z] => format!("2001:db8::{z}"),
                [203, 0, 113, z] => format!("2001:db8:113::{z}"),
                other => panic!("no IPv6 twin for {other:?}"),
            };
            text.parse::<Ipv6Addr>().expect("ipv6").into()
        }
    }
}

/// The scenario in both families, as a dual-stack cluster has it.
pub fn dual_scenario() -> (DualSnapshot, Settings) {
    (
        DualSnapshot {
            v4: scenario_of(IpFamily::V4),
            v6: scenario_of(IpFamily::V6),
        },
        settings(),
    )
}

pub fn settings() -> Settings {
    Settings {
        node: NodeInfo {
            name: "node-1".into(),
            addresses: vec![
                addr(IpFamily::V4, [10, 250, 0, 11]),
                addr(IpFamily::V6, [10, 250, 0, 11]),
            ],
            zone: None,
        },
        cluster_cidrs: vec![
            "10.244.0.0/16".parse().expect("cidr"),
            "fd00:10:244::/48".parse().expect("cidr"),
        ],
        masquerade_all: false,
        node_port_addresses: Default::default(),
        masquerade_mark: 0x4000,
        ipvs: Default::default(),
        localhost_node_ports: true,
        nftables_localhost_node_ports: false,
        service_cidrs: vec![
            "10.96.0.0/16".parse().expect("cidr"),
            "fd00:10:96::/112".parse().expect("cidr"),
        ],
    }
}

pub fn scenario_of(family: IpFamily) -> Snapshot {
    let port = |n: ServicePortName, cip: [u8; 4], p: u16| fixtures::cluster_ip(n, addr(family, cip), p);
    let ep =
        |ip: [u8; 4], port: u16, node: &str| -> Endpoint { fixtures::ready(addr(family, ip), port, node) };
    let mut s = Snapshot::new(family);
    let mut add = |p: ServicePort, eps: Vec<Endpoint>| {
        if !eps.is_empty() {
            s.endpoints.insert(p.name.clone(), eps);
        }
        s.services.insert(p.name.clone(), p);
    };
    // ClusterIP, one endpoint, TCP.
    add(
        port(name("default", "one", "http", Protocol::Tcp), [10, 96, 0, 11], 80),
        vec![ep([10, 244, 2, 11], 8080, "node-2")],
    );
    // Three endpoints, one local (hairpin), UDP.
    add(
        port(name("default", "dns", "dns", Protocol::Udp), [10, 96, 0, 10], 53),
        vec![
            ep([10, 244, 1, 11], 53, "node-1"),
            ep([10, 244, 2, 11], 53, "node-2"),
            ep([10, 244, 3, 11], 53, "node-3"),
        ],
    );
    // NodePort + externalIP, SCTP.
    let mut np = port(name("default", "np", "", Protocol::Sctp), [10, 96, 0, 12], 9000);
    np.node_port = Some(30900);
    np.external_ips = vec![addr(family, [192, 0, 2, 10])];
    add(np, vec![ep([10, 244, 2, 12], 9000, "node-2")]);
    // LoadBalancer with source ranges (not byte-aligned), ETP=Local with a local endpoint.
    let mut lb = port(name("web", "lb", "https", Protocol::Tcp), [10, 96, 0, 13], 443);
    lb.node_port = Some(30443);
    lb.load_balancer_ips = vec![addr(family, [192, 0, 2, 100])];
    let range = match family {
        IpFamily::V4 => "203.0.113.0/25",
        IpFamily::V6 => "2001:db8:113::/60",
    };
    lb.load_balancer_source_ranges = vec![range.parse::<IpNet>().expect("net")];
    lb.external_policy_local = true;
    lb.health_check_node_port = Some(31000);
    add(
        lb,
        vec![
            ep([10, 244, 1, 13], 8443, "node-1"),
            ep([10, 244, 2, 13], 8443, "node-2"),
        ],
    );
    // ETP=Local without local endpoints.
    let mut remote = port(name("web", "remote", "", Protocol::Tcp), [10, 96, 0, 14], 80);
    remote.node_port = Some(30080);
    remote.external_policy_local = true;
    add(remote, vec![ep([10, 244, 2, 14], 80, "node-2")]);
    // ITP=Local without local endpoints.
    let mut itp = port(name("web", "itp", "", Protocol::Tcp), [10, 96, 0, 15], 80);
    itp.internal_policy_local = true;
    add(itp, vec![ep([10, 244, 3, 15], 80, "node-3")]);
    // ClientIP affinity, two endpoints.
    let mut aff = port(name("web", "sticky", "", Protocol::Tcp), [10, 96, 0, 16], 80);
    aff.affinity_timeout_seconds = Some(600);
    add(
        aff,
        vec![
            ep([10, 244, 1, 16], 80, "node-1"),
            ep([10, 244, 2, 16], 80, "node-2"),
        ],
    );
    // No endpoints at all, and only a terminating one (fallback).
    add(
        port(name("web", "empty", "", Protocol::Tcp), [10, 96, 0, 17], 80),
        vec![],
    );
    let mut term = ep([10, 244, 2, 18], 80, "node-2");
    term.ready = false;
    term.terminating = true;
    add(
        port(name("web", "terminating", "", Protocol::Tcp), [10, 96, 0, 18], 80),
        vec![term],
    );
    s
}

/// The key of the first service port of `svc` in `snap`.
pub fn key(snap: &Snapshot, svc: &str) -> ServicePortName {
    snap.services
        .keys()
        .find(|k| &*k.service.name == svc)
        .expect("service")
        .clone()
}

/// A change of `before` touching every kind of partial-sync work: in both families, one endpoint of
/// `dns` leaves and `sticky` is deleted; in IPv6 only, `one` is deleted (as when a Service becomes
/// single-stack); a new ClusterIP service `added` appears with two endpoints. Returns the new
/// snapshot and the changes.
pub fn changed(before: &DualSnapshot) -> (DualSnapshot, Changes) {
    let mut snap = before.clone();
    let (dns, sticky, one) = (
        key(&snap.v4, "dns"),
        key(&snap.v4, "sticky"),
        key(&snap.v4, "one"),
    );
    let added = name("web", "added", "", Protocol::Tcp);
    for family in IpFamily::ALL {
        let s = snap.get_mut(family);
        s.endpoints.get_mut(&dns).expect("eps").pop();
        s.services.remove(&sticky);
        s.endpoints.remove(&sticky);
        let port = fixtures::cluster_ip(added.clone(), addr(family, [10, 96, 0, 19]), 8080);
        s.services.insert(added.clone(), port);
        let eps = vec![
            fixtures::ready(addr(family, [10, 244, 1, 19]), 80, "node-1"),
            fixtures::ready(addr(family, [10, 244, 2, 19]), 80, "node-2"),
        ];
        s.endpoints.insert(added.clone(), eps);
    }
    snap.v6.services.remove(&one);
    snap.v6.endpoints.remove(&one);
    let changes = Changes {
        services: [&dns, &sticky, &one, &added]
            .into_iter()
            .map(|k| k.service.clone())
            .collect(),
    };
    (snap, changes)
}
