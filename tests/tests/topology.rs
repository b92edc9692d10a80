//! The namespace topology itself, without a control plane or an agent: both families route between
//! pods across nodes and from the fabric to pods with the sources untouched, IPv6 addresses are
//! usable at once (none tentative), `swy-echo` answers on both families (IPv4 peers printed as
//! plain `a.b.c.d:port`), and nothing of it reaches the root namespace.

use std::net::SocketAddr;

use switchyard_e2e::{
    Family,
    netns::{self, Cluster},
    run,
    traffic::{Outcome, probe, start_server},
};

/// Every address and route of the root namespace, both families.
fn root_state() -> String {
    ["-4 addr", "-6 addr", "-4 route", "-6 route"]
        .iter()
        .map(|a| run("ip", &a.split(' ').collect::<Vec<_>>()).expect("ip in the root namespace"))
        .collect()
}

#[test]
fn dual_stack_topology_routes_both_families_inside_the_namespaces_only() {
    // No apiserver here: the fabric's forwarder gets a port nothing listens on.
    let port = switchyard_e2e::ports::free_loopback_port().expect("free port");
    let cluster = Cluster::create(2, 2, port).expect("2 namespace nodes");
    let (n1, n2) = (&cluster.nodes[0], &cluster.nodes[1]);
    assert_eq!(n1.ip6.to_string(), "fd00:10:250::11");
    assert_eq!(n2.pods[1].ip6.to_string(), "fd00:10:244:2::12");
    assert_eq!(n2.pod_cidr6, "fd00:10:244:2::/64");

    let mut all: Vec<&str> = vec![&cluster.fabric];
    for n in &cluster.nodes {
        all.push(&n.netns);
        all.extend(n.pods.iter().map(|p| p.netns.as_str()));
    }
    for ns in &all {
        let tentative = Cluster::exec(ns, &["ip", "-6", "addr", "show", "tentative"]).expect("ip addr");
        assert_eq!(
            tentative.trim(),
            "",
            "{ns}: tentative IPv6 addresses (DAD must be off)"
        );
    }

    let _servers: Vec<_> = cluster
        .nodes
        .iter()
        .map(|n| start_server(&n.pods[0], &[8080], &[5353]).expect("echo"))
        .collect();
    for family in Family::BOTH {
        // Pod to pod across nodes, TCP and UDP: no NAT, the server sees the client pod's address.
        let client = &n1.pods[1];
        for udp in [false, true] {
            let target = SocketAddr::new(n2.pods[0].ip_of(family), if udp { 5353 } else { 8080 });
            let o = probe(&client.netns, target, udp, 3, 1000).expect("probe");
            assert!(
                o.iter().all(|x| x.server() == Some(n2.pods[0].name.as_str())
                    && x.peer_ip() == Some(client.ip_of(family))),
                "{family:?} udp={udp} pod to pod: {o:?}"
            );
        }
        // The fabric (outside the cluster) to a pod, routed via the node.
        let o = probe(
            &cluster.fabric,
            SocketAddr::new(n1.pods[0].ip_of(family), 8080),
            false,
            2,
            1000,
        )
        .expect("probe");
        assert!(
            o.iter().all(|x| x.peer_ip() == Some(netns::fabric_ip(family))),
            "{family:?} fabric to pod: {o:?}"
        );
        // A node to a pod of another node (host-gw route), sourced from its fabric address.
        let o = probe(
            &n2.netns,
            SocketAddr::new(n1.pods[0].ip_of(family), 8080),
            false,
            2,
            1000,
        )
        .expect("probe");
        assert!(
            o.iter().all(|x| x.peer_ip() == Some(n2.ip_of(family))),
            "{family:?} node to remote pod: {o:?}"
        );
    }
    // Exactly the IPv4 text the other tests parse: `ok <name> a.b.c.d:port`, never `::ffff:`.
    let o = probe(
        &n1.pods[1].netns,
        SocketAddr::new(n2.pods[0].ip.into(), 8080),
        false,
        1,
        1000,
    )
    .expect("probe");
    match &o[..] {
        [Outcome::Answered { server, peer }] => {
            assert_eq!(server, &n2.pods[0].name);
            assert!(
                peer.starts_with(&format!("{}:", n1.pods[1].ip)) && !peer.contains('['),
                "{peer}"
            );
        }
        other => panic!("{other:?}"),
    }
    let o = probe(
        &n1.pods[1].netns,
        SocketAddr::new(n2.pods[0].ip6.into(), 8080),
        false,
        1,
        1000,
    )
    .expect("probe");
    assert!(
        matches!(&o[..], [Outcome::Answered { peer, .. }] if peer.starts_with(&format!("[{}]:", n1.pods[1].ip6))),
        "{o:?}"
    );

    // Nothing of the cluster in the root namespace: no address, no route.
    let root = root_state();
    for needle in ["fd00:10:", "10.244.", "10.250."] {
        assert!(!root.contains(needle), "root namespace has {needle}:\n{root}");
    }
}
