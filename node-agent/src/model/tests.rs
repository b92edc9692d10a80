//! Table tests for categorisation, conversion and change tracking.

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::json;

use std::net::{IpAddr, Ipv4Addr};

use super::{tracker::Tracker, *};

fn ep(ip: [u8; 4], node: &str, ready: bool, serving: bool, terminating: bool) -> Endpoint {
    Endpoint {
        ip: Ipv4Addr::from(ip).into(),
        port: 80,
        ready,
        serving,
        terminating,
        node_name: Some(node.into()),
        zone_hints: vec![],
    }
}

fn node(name: &str) -> NodeInfo {
    NodeInfo {
        name: name.into(),
        addresses: vec![],
        zone: None,
    }
}

#[test]
fn categorize_prefers_ready_then_serving_terminating() {
    let r1 = ep([10, 0, 0, 1], "a", true, true, false);
    let r2 = ep([10, 0, 0, 2], "b", true, true, false);
    let t1 = ep([10, 0, 0, 3], "a", false, true, true);
    let t2 = ep([10, 0, 0, 4], "b", false, false, true); // not serving: never used
    let n1 = ep([10, 0, 0, 5], "a", false, false, false); // not ready, not terminating
    let last_octet = |ip: &IpAddr| if let IpAddr::V4(a) = ip { a.octets()[3] } else { 0 };
    let ips = |v: &[&Endpoint]| v.iter().map(|e| last_octet(&e.ip)).collect::<Vec<_>>();
    // (endpoints, node, cluster octets, local octets, has any)
    type Case<'a> = (Vec<Endpoint>, &'a str, Vec<u8>, Vec<u8>, bool);
    let cases: Vec<Case> = vec![
        (
            vec![r1.clone(), r2.clone(), t1.clone()],
            "a",
            vec![1, 2],
            vec![1],
            true,
        ),
        (vec![r2.clone(), t1.clone()], "a", vec![2], vec![3], true), // local falls back independently
        (
            vec![t1.clone(), t2.clone(), n1.clone()],
            "b",
            vec![3],
            vec![],
            true,
        ),
        (vec![t2.clone(), n1.clone()], "a", vec![], vec![], false),
        (vec![], "a", vec![], vec![], false),
    ];
    for (eps, n, cluster, local, any) in cases {
        let c = categorize(&eps, &node(n));
        assert_eq!(ips(&c.cluster), cluster, "cluster {eps:?}");
        assert_eq!(ips(&c.local), local, "local {eps:?}");
        assert_eq!(c.has_any, any);
    }
}

#[test]
fn categorize_applies_zone_hints_only_when_all_hinted_and_zone_present() {
    let mut a = ep([10, 0, 0, 1], "a", true, true, false);
    let mut b = ep([10, 0, 0, 2], "b", true, true, false);
    a.zone_hints = vec!["z1".into()];
    b.zone_hints = vec!["z2".into()];
    let n = NodeInfo {
        zone: Some("z1".into()),
        ..node("x")
    };
    assert_eq!(categorize(&[a.clone(), b.clone()], &n).cluster.len(), 1);
    let n3 = NodeInfo {
        zone: Some("z3".into()),
        ..node("x")
    };
    assert_eq!(
        categorize(&[a.clone(), b.clone()], &n3).cluster.len(),
        2,
        "no hint for our zone: ignore hints"
    );
    b.zone_hints.clear();
    assert_eq!(
        categorize(&[a, b], &n).cluster.len(),
        2,
        "partially hinted: ignore hints"
    );
}

fn service(extra: serde_json::Value) -> Service {
    let mut base = json!({
        "metadata": {"namespace": "ns", "name": "web"},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}, {"name": "dns", "port": 53, "protocol": "UDP"}]},
    });
    merge(&mut base, extra);
    serde_json::from_value(base).expect("service")
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

#[test]
fn conversion_skips_what_kube_proxy_skips() {
    assert_eq!(convert::service_ports(&service(json!({})), None).len(), 2);
    let cases = [
        ("headless", json!({"spec": {"clusterIP": "None"}}), None, 0),
        (
            "external name",
            json!({"spec": {"type": "ExternalName"}}),
            None,
            0,
        ),
        (
            "ipv6 only: served by the IPv6 family",
            json!({"spec": {"clusterIP": "fd00::10"}}),
            None,
            2,
        ),
        (
            "headless dual-stack",
            json!({"spec": {"clusterIP": "None", "clusterIPs": ["None"]}}),
            None,
            0,
        ),
        (
            "other proxy",
            json!({"metadata": {"labels": {"service.kubernetes.io/service-proxy-name": "other"}}}),
            None,
            0,
        ),
        (
            "our proxy",
            json!({"metadata": {"labels": {"service.kubernetes.io/service-proxy-name": "swy"}}}),
            Some("swy"),
            2,
        ),
        ("unlabelled, named proxy", json!({}), Some("swy"), 0),
    ];
    for (what, extra, proxy, want) in cases {
        assert_eq!(
            convert::service_ports(&service(extra), proxy).len(),
            want,
            "{what}"
        );
    }
}

#[test]
fn conversion_reads_policies_affinity_and_lb() {
    let svc = service(json!({
        "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                 "sessionAffinity": "ClientIP", "externalIPs": ["192.0.2.7", "fd00::1"],
                 "loadBalancerSourceRanges": ["203.0.113.0/25", " 198.51.100.1/24 "], "healthCheckNodePort": 30999,
                 "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.100"}, {"hostname": "lb.example"}]}}
    }));
    let ports = convert::service_ports(&svc, None);
    assert_eq!(ports.len(), 1);
    let p = &ports[0];
    assert_eq!(p.node_port, Some(30080));
    assert_eq!(p.external_ips, vec![IpAddr::from([192, 0, 2, 7])]);
    assert_eq!(p.load_balancer_ips, vec![IpAddr::from([192, 0, 2, 100])]);
    assert_eq!(
        p.load_balancer_source_ranges
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>(),
        ["203.0.113.0/25", "198.51.100.0/24"]
    );
    assert_eq!(
        p.affinity_timeout_seconds,
        Some(convert::DEFAULT_AFFINITY_SECONDS)
    );
    assert!(p.external_policy_local && p.internal_policy_local);
    assert_eq!(p.health_check_node_port, Some(30999));
    assert_eq!(p.name.to_string(), "ns/web:http");
}

fn slice(name: &str, addrs: &[&str], ready: bool) -> EndpointSlice {
    let family = if addrs.iter().any(|a| a.contains(':')) {
        "IPv6"
    } else {
        "IPv4"
    };
    serde_json::from_value(json!({
        "metadata": {"namespace": "ns", "name": name, "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": family,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": addrs.iter().map(|a| json!({"addresses": [a], "conditions": {"ready": ready}, "nodeName": "n1"})).collect::<Vec<_>>(),
    }))
    .expect("slice")
}

#[test]
fn tracker_merges_slices_and_tracks_changed_services() {
    let mut t = Tracker::new(None);
    assert!(!t.synced());
    t.reset_services(&[service(json!({}))]);
    t.reset_slices(&[
        slice("web-a", &["10.244.1.11"], true),
        slice("web-b", &["10.244.2.11", "10.244.1.11"], true),
    ]);
    assert!(t.synced());
    let changes = t.take_changes();
    assert_eq!(changes.services.len(), 1);
    let snap = t.snapshot().v4;
    assert_eq!(snap.services.len(), 2);
    let http = snap
        .services
        .keys()
        .find(|k| &*k.port_name == "http")
        .expect("http")
        .clone();
    assert_eq!(
        snap.endpoints[&http].len(),
        2,
        "merged across slices, deduplicated"
    );
    assert!(
        snap.endpoints.keys().all(|k| &*k.port_name == "http"),
        "no endpoints for the dns port"
    );
    assert!(
        t.snapshot().v6.services.is_empty(),
        "a single-stack IPv4 Service has no IPv6 ports"
    );

    // No-op updates are not changes; real ones are.
    assert!(!t.apply_slice(&slice("web-a", &["10.244.1.11"], true)));
    assert_eq!(t.pending(), 0);
    assert!(t.apply_slice(&slice("web-a", &["10.244.1.11"], false)));
    assert_eq!(t.pending(), 1);
    t.take_changes();
    assert!(t.delete_service("ns", "web"));
    assert!(t.take_changes().services.contains(&ServiceName {
        namespace: "ns".into(),
        name: "web".into()
    }));
    assert!(t.snapshot().v4.services.is_empty());
    assert!(!t.delete_service("ns", "web"));
}

#[test]
fn dual_stack_services_yield_one_port_per_family_and_slices_sort_by_family() {
    let svc = service(json!({
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00:10:96::10"],
                 "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack",
                 "externalIPs": ["192.0.2.7", "2001:db8::7"], "loadBalancerSourceRanges": ["203.0.113.0/25"],
                 "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.100"}, {"ip": "2001:db8::100"}]}}
    }));
    let ports = convert::service_ports(&svc, None);
    assert_eq!(ports.len(), 2);
    let (v4, v6) = (&ports[0], &ports[1]);
    assert_eq!((v4.family(), v6.family()), (IpFamily::V4, IpFamily::V6));
    assert_eq!(v6.cluster_ip.to_string(), "fd00:10:96::10");
    assert_eq!(v4.external_ips, vec![IpAddr::from([192, 0, 2, 7])]);
    assert_eq!(
        v6.external_ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["2001:db8::7"]
    );
    assert_eq!(
        v6.load_balancer_ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["2001:db8::100"]
    );
    // Source ranges of one family restrict only that family's LB IPs (as in kube-proxy).
    assert!(v4.has_source_ranges());
    assert!(v6.load_balancer_source_ranges.is_empty() && !v6.has_source_ranges());

    let mut t = Tracker::new(None);
    t.reset_services(&[svc]);
    t.reset_slices(&[
        slice("web-v4", &["10.244.1.11"], true),
        slice("web-v6", &["fd00:10:244:1::11", "10.244.9.9"], true),
    ]);
    let snap = t.snapshot();
    let http = snap.v4.services.keys().next().expect("v4 port").clone();
    assert_eq!(
        snap.v4.endpoints[&http]
            .iter()
            .map(|e| e.ip.to_string())
            .collect::<Vec<_>>(),
        ["10.244.1.11"]
    );
    // The IPv6 slice's stray IPv4 address is dropped, not mixed into either family.
    assert_eq!(
        snap.v6.endpoints[&http]
            .iter()
            .map(|e| e.ip.to_string())
            .collect::<Vec<_>>(),
        ["fd00:10:244:1::11"]
    );
}
