//! Tests of the iptables backend.
//!
//! - Pure: the render of a scenario covering every service shape is compared with golden files in
//!   `testdata/` (`SWITCHYARD_UPDATE_GOLDEN=1` rewrites them), plus table tests of the helpers.
//! - Kernel (root): in a throwaway network namespace per test, a full sync must leave exactly the
//!   golden text in `iptables-save`, partial syncs must add/remove only what changed, and cleanup
//!   must leave no `SWY` string; for both the `legacy` and the `nft` variant.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::render::{kernel_probability, probability, render, save_string};
use super::*;
use crate::backend::conformance::{
    golden,
    netns::TestNetns,
    suite::{Kit, Subject, conformance_suite},
};
use crate::model::{
    DualSnapshot, Endpoint, IpFamily, IpNet, NodeInfo, Protocol, ServicePort, ServicePortName,
};
use crate::sys::{
    iptables::fake::{FakeIptables, Faulty},
    sysctl::FakeSysctl,
};

// ---------------------------------------------------------------------------------------------
// Scenario

const NODE: &str = "node-a";
const REMOTE: &str = "node-b";

fn settings() -> Settings {
    Settings {
        node: NodeInfo {
            name: NODE.into(),
            addresses: vec![ip("192.168.0.10"), fixtures::ipv6_twin(ip("192.168.0.10"))],
            zone: None,
        },
        cluster_cidrs: vec![
            net("10.244.0.0/16"),
            fixtures::ipv6_twin_net(net("10.244.0.0/16")),
        ],
        ..Settings::default()
    }
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// The dual-stack form of a scenario: the snapshot and its IPv6 twin.
fn dual(snap: &Snapshot) -> DualSnapshot {
    fixtures::with_ipv6_twin(snap)
}

fn spn(svc: &str, port_name: &str, protocol: Protocol) -> ServicePortName {
    fixtures::port_name("ns", svc, port_name, protocol)
}

fn port(svc: &str, port_name: &str, protocol: Protocol, cluster_ip: &str, port: u16) -> ServicePort {
    fixtures::cluster_ip(spn(svc, port_name, protocol), ip(cluster_ip), port)
}

fn ep(addr: &str, port: u16, node: &str) -> Endpoint {
    fixtures::ready(ip(addr), port, node)
}

use crate::model::fixtures::{self, add};

/// Every service shape the backend handles.
fn scenario() -> Snapshot {
    let mut s = Snapshot::default();
    let tcp = Protocol::Tcp;
    // ClusterIP with one endpoint, and with three (one local).
    add(
        &mut s,
        port("one", "http", tcp, "10.96.0.11", 80),
        vec![ep("10.244.1.11", 8080, REMOTE)],
    );
    add(
        &mut s,
        port("three", "http", tcp, "10.96.0.13", 80),
        vec![
            ep("10.244.0.13", 8080, NODE),
            ep("10.244.1.13", 8080, REMOTE),
            ep("10.244.2.13", 8080, REMOTE),
        ],
    );
    // NodePort, unnamed port.
    add(
        &mut s,
        ServicePort {
            node_port: Some(30020),
            ..port("np", "", tcp, "10.96.0.20", 80)
        },
        vec![ep("10.244.1.20", 8080, REMOTE), ep("10.244.2.20", 8080, REMOTE)],
    );
    // External IP.
    add(
        &mut s,
        ServicePort {
            external_ips: vec![ip("203.0.113.21")],
            ..port("ext", "https", tcp, "10.96.0.21", 443)
        },
        vec![ep("10.244.1.21", 8443, REMOTE)],
    );
    // LoadBalancer with source ranges (one contains the node IP).
    add(
        &mut s,
        ServicePort {
            node_port: Some(30030),
            load_balancer_ips: vec![ip("198.51.100.30")],
            load_balancer_source_ranges: vec![net("192.168.0.0/24"), net("203.0.113.0/24")],
            ..port("lb", "http", tcp, "10.96.0.30", 80)
        },
        vec![ep("10.244.1.30", 8080, REMOTE), ep("10.244.2.30", 8080, REMOTE)],
    );
    // ClientIP affinity.
    add(
        &mut s,
        ServicePort {
            affinity_timeout_seconds: Some(10800),
            ..port("sticky", "http", tcp, "10.96.0.31", 80)
        },
        vec![ep("10.244.1.31", 8080, REMOTE), ep("10.244.2.31", 8080, REMOTE)],
    );
    // externalTrafficPolicy: Local with a local endpoint (LB, health-check node port) ...
    add(
        &mut s,
        ServicePort {
            node_port: Some(30040),
            load_balancer_ips: vec![ip("198.51.100.40")],
            external_policy_local: true,
            health_check_node_port: Some(32040),
            ..port("etp-local", "http", tcp, "10.96.0.40", 80)
        },
        vec![ep("10.244.0.40", 8080, NODE), ep("10.244.1.40", 8080, REMOTE)],
    );
    // ... and without one (NodePort + external IP).
    add(
        &mut s,
        ServicePort {
            node_port: Some(30041),
            external_ips: vec![ip("203.0.113.41")],
            external_policy_local: true,
            ..port("etp-nolocal", "http", tcp, "10.96.0.41", 80)
        },
        vec![ep("10.244.1.41", 8080, REMOTE)],
    );
    // internalTrafficPolicy: Local with and without a local endpoint.
    add(
        &mut s,
        ServicePort {
            internal_policy_local: true,
            ..port("itp-local", "http", tcp, "10.96.0.50", 80)
        },
        vec![ep("10.244.0.50", 8080, NODE), ep("10.244.1.50", 8080, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            internal_policy_local: true,
            ..port("itp-nolocal", "http", tcp, "10.96.0.51", 80)
        },
        vec![ep("10.244.1.51", 8080, REMOTE)],
    );
    // No endpoints at all, with every kind of destination.
    add(
        &mut s,
        ServicePort {
            node_port: Some(30060),
            external_ips: vec![ip("203.0.113.60")],
            load_balancer_ips: vec![ip("198.51.100.60")],
            ..port("empty", "http", tcp, "10.96.0.60", 80)
        },
        vec![],
    );
    // UDP and TCP ports of one service; SCTP.
    let dns_eps = || vec![ep("10.244.1.10", 53, REMOTE), ep("10.244.2.10", 53, REMOTE)];
    add(
        &mut s,
        port("dns", "dns", Protocol::Udp, "10.96.0.10", 53),
        dns_eps(),
    );
    add(&mut s, port("dns", "dns-tcp", tcp, "10.96.0.10", 53), dns_eps());
    add(
        &mut s,
        port("sctp", "sctp", Protocol::Sctp, "10.96.0.70", 9999),
        vec![ep("10.244.1.70", 9999, REMOTE)],
    );
    // Only terminating endpoints: the serving one is used, the non-serving one is not.
    add(
        &mut s,
        port("term", "http", tcp, "10.96.0.80", 80),
        vec![
            Endpoint {
                ready: false,
                serving: true,
                terminating: true,
                ..ep("10.244.1.80", 8080, REMOTE)
            },
            Endpoint {
                ready: false,
                serving: false,
                terminating: true,
                ..ep("10.244.2.80", 8080, REMOTE)
            },
        ],
    );
    s
}

/// Settings with restricted node-port addresses, masquerade-all and no cluster CIDR.
fn variant_settings() -> Settings {
    Settings {
        cluster_cidrs: Vec::new(),
        masquerade_all: true,
        node_port_addresses: crate::backend::NodePortIps::of_addresses(&[
            ip("192.168.0.10"),
            ip("192.168.1.10"),
        ]),
        ..settings()
    }
}

fn variant_scenario() -> Snapshot {
    let full = scenario();
    let mut s = Snapshot::default();
    for name in ["np", "etp-local"] {
        for (k, sp) in full.services.iter().filter(|(k, _)| &*k.service.name == name) {
            add(
                &mut s,
                sp.clone(),
                full.endpoints.get(k).cloned().unwrap_or_default(),
            );
        }
    }
    s
}

fn changes(names: &[&str]) -> Changes {
    fixtures::changes(names)
}

// ---------------------------------------------------------------------------------------------
// Goldens

/// Compares `actual` with golden `name` (the kit's helper; `SWITCHYARD_UPDATE_GOLDEN=1` rewrites).
fn check_golden(name: &str, actual: &str) {
    golden::check("iptables", name, actual);
}

fn read_golden(name: &str) -> String {
    golden::read("iptables", name)
}

#[test]
fn iptables_golden_full_scenario() {
    check_golden("scenario.rules", &render(&scenario(), &settings(), None).text());
    // The same scenario over IPv6 (ip6tables-restore input).
    check_golden(
        "scenario6.rules",
        &render(&fixtures::ipv6_twin_snapshot(&scenario()), &settings(), None).text(),
    );
}

#[test]
fn iptables_golden_node_port_addresses_masquerade_all() {
    check_golden(
        "variant.rules",
        &render(&variant_scenario(), &variant_settings(), None).text(),
    );
}

#[test]
fn iptables_golden_partial() {
    let snap = scenario();
    let partial = render(&snap, &settings(), Some(&changes(&["one", "etp-local"])));
    check_golden("partial.rules", &partial.text());
    let full = render(&snap, &settings(), None);
    // Same desired state, same top-level chains, fewer service chains written.
    assert_eq!(partial.nat_chains, full.nat_chains);
    assert_eq!(partial.filter, full.filter);
    assert_eq!(partial.rules_total, full.rules_total);
    for chain in render::NAT_TOP_CHAINS {
        assert_eq!(
            partial.nat.chains.get(chain),
            full.nat.chains.get(chain),
            "{chain}"
        );
    }
    let written: BTreeSet<&String> = partial.nat.chains.keys().collect();
    let expected: BTreeSet<&String> = full
        .nat
        .chains
        .keys()
        .filter(|c| {
            render::NAT_TOP_CHAINS.contains(&c.as_str())
                || snap
                    .services
                    .keys()
                    .filter(|k| &*k.service.name == "one" || &*k.service.name == "etp-local")
                    .any(|k| {
                        ["SVC", "SVL", "EXT", "FW"]
                            .iter()
                            .any(|kind| **c == crate::backend::names::ipt_service_chain(kind, k))
                            || snap
                                .endpoints
                                .get(k)
                                .into_iter()
                                .flatten()
                                .any(|e| **c == crate::backend::names::ipt_endpoint_chain(k, e))
                    })
        })
        .collect();
    assert_eq!(written, expected);
}

#[test]
fn iptables_render_is_deterministic_and_counts() {
    let a = render(&scenario(), &settings(), None);
    let b = render(&scenario(), &settings(), None);
    assert_eq!(a, b);
    let text = a.text();
    assert_eq!(
        a.rules_total,
        text.lines().filter(|l| l.starts_with("-A ")).count()
    );
    assert_eq!(a.services, 15);
    assert_eq!(
        a.endpoints,
        text.lines().filter(|l| l.starts_with(":SWY-SEP-")).count()
    );
    let declared: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .map(|l| l.split(' ').next().unwrap_or("").to_owned())
        .collect();
    let wanted: BTreeSet<String> = a.nat_chains.union(&a.filter_chains).cloned().collect();
    assert_eq!(declared, wanted);
    // Every jump target of a rule is a declared chain or a standard target.
    for line in text.lines().filter(|l| l.starts_with("-A ")) {
        let target = line
            .split(" -j ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .unwrap_or("");
        // A rule without a verdict only counts (the localhost NodePort nfacct rule).
        assert!(
            !line.contains(" -j ")
                || declared.contains(target)
                || ["ACCEPT", "DROP", "REJECT", "RETURN", "MARK", "MASQUERADE", "DNAT"].contains(&target),
            "dangling jump: {line}"
        );
    }
}

/// Targeted semantics, independent of the goldens: (service, lines the render must contain,
/// substrings it must not contain).
#[test]
fn iptables_render_semantics_table() {
    let text = render(&scenario(), &settings(), None).text();
    let svc = |name: &str, port_name: &str, kind: &str| {
        crate::backend::names::ipt_service_chain(kind, &spn(name, port_name, Protocol::Tcp))
    };
    let must: Vec<String> = vec![
        // No endpoints: REJECT for cluster IP, external IP, LB IP and node port; nothing in nat.
        r#"-A SWY-SERVICES -d 10.96.0.60/32 -p tcp -m comment --comment "ns/empty:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable"#.into(),
        r#"-A SWY-EXTERNAL-SERVICES -p tcp -m comment --comment "ns/empty:http has no endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30060 -j REJECT --reject-with icmp-port-unreachable"#.into(),
        r#"-A SWY-EXTERNAL-SERVICES -d 198.51.100.60/32 -p tcp -m comment --comment "ns/empty:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable"#.into(),
        // ITP=Local without local endpoints: DROP.
        r#"-A SWY-SERVICES -d 10.96.0.51/32 -p tcp -m comment --comment "ns/itp-nolocal:http has no local endpoints" -m tcp --dport 80 -j DROP"#.into(),
        // ITP=Local with local endpoint: cluster IP to SVL.
        format!(r#"-A SWY-SERVICES -d 10.96.0.50/32 -p tcp -m comment --comment "ns/itp-local:http cluster IP" -m tcp --dport 80 -j {}"#, svc("itp-local", "http", "SVL")),
        // ETP=Local without local endpoints: DROP for external destinations, short-circuits kept.
        r#"-A SWY-EXTERNAL-SERVICES -d 203.0.113.41/32 -p tcp -m comment --comment "ns/etp-nolocal:http has no local endpoints" -m tcp --dport 80 -j DROP"#.into(),
        format!(r#"-A {} -s 10.244.0.0/16 -m comment --comment "pod traffic for ns/etp-nolocal:http external destinations" -j {}"#, svc("etp-nolocal", "http", "EXT"), svc("etp-nolocal", "http", "SVC")),
        // ETP=Local with local endpoints: EXT ends in SVL; health check node port accepted.
        format!("-A {} -j {}", svc("etp-local", "http", "EXT"), svc("etp-local", "http", "SVL")),
        r#"-A SWY-NODEPORTS -p tcp -m comment --comment "ns/etp-local:http health check node port" -m tcp --dport 32040 -j ACCEPT"#.into(),
        // Source ranges: FW chain, node-IP range adds the LB IP as source, DROP in filter.
        format!(r#"-A {} -s 198.51.100.30/32 -m comment --comment "ns/lb:http loadbalancer IP" -j {}"#, svc("lb", "http", "FW"), svc("lb", "http", "EXT")),
        format!(r#"-A SWY-PROXY-FIREWALL -d 198.51.100.30/32 -p tcp -m comment --comment "ns/lb:http traffic not accepted by {}" -m tcp --dport 80 -j DROP"#, svc("lb", "http", "FW")),
        // Three endpoints: 1/3, 1/2, unconditional.
        "--probability 0.3333333333 -j".into(),
        "--probability 0.5000000000 -j".into(),
        // Protocols.
        "-A SWY-SERVICES -d 10.96.0.10/32 -p udp -m comment --comment \"ns/dns:dns cluster IP\" -m udp --dport 53 -j".into(),
        "-A SWY-SERVICES -d 10.96.0.70/32 -p sctp -m comment --comment \"ns/sctp:sctp cluster IP\" -m sctp --dport 9999 -j".into(),
        // Terminating fallback.
        "-j DNAT --to-destination 10.244.1.80:8080".into(),
        // Node ports dispatch is the last rule of nat SWY-SERVICES.
        r#"-A SWY-SERVICES -m comment --comment "switchyard service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j SWY-NODEPORTS"#.into(),
    ];
    for m in &must {
        assert!(text.contains(m.as_str()), "missing: {m}");
    }
    let must_not: Vec<String> = vec![
        "10.244.2.80".into(),        // not serving
        svc("empty", "http", "SVC"), // no endpoints: no nat chains
        svc("empty", "http", "EXT"),
        svc("itp-nolocal", "http", "SVL"), // no local endpoints
        format!("-A {} -j", svc("etp-nolocal", "http", "EXT")), // no fall-through jump
    ];
    for m in &must_not {
        assert!(!text.contains(m.as_str()), "unexpected: {m}");
    }
    let nat = text.split("*nat\n").nth(1).unwrap_or("");
    let last_services = nat
        .lines()
        .rfind(|l| l.starts_with("-A SWY-SERVICES "))
        .unwrap_or("");
    assert!(last_services.ends_with("-j SWY-NODEPORTS"), "{last_services}");
}

#[test]
fn iptables_probabilities() {
    let cases = [
        (1, "1.0000000000"),
        (2, "0.5000000000"),
        (3, "0.3333333333"),
        (7, "0.1428571429"),
        (1000, "0.0010000000"),
    ];
    for (k, want) in cases {
        assert_eq!(probability(k), want, "k={k}");
    }
    let kernel = [
        (0.3333333333, "0.33333333349"),
        (0.5, "0.50000000000"),
        (0.25, "0.25000000000"),
        (0.1428571429, "0.14285714272"),
    ];
    for (p, want) in kernel {
        assert_eq!(kernel_probability(p), want, "p={p}");
    }
}

#[test]
fn iptables_save_string_quoting() {
    let cases = [
        ("ns-x_1", "ns-x_1"),
        ("ns/web:http", "\"ns/web:http\""),
        ("a b", "\"a b\""),
        ("a\"b", "\"a\\\"b\""),
        ("a'b", "\"a\\'b\""),
        ("a\\b", "\"a\\\\b\""),
        ("", "\"\""),
    ];
    for (input, want) in cases {
        assert_eq!(save_string(input), want, "{input:?}");
    }
}

#[test]
fn iptables_jump_rule_lines() {
    let lines: Vec<String> = JUMP_RULES.iter().map(JumpRule::save_line).collect();
    assert!(lines.contains(
        &"-A PREROUTING -m comment --comment \"switchyard service portals\" -j SWY-SERVICES".to_owned()
    ));
    assert!(lines.contains(
        &"-A INPUT -m conntrack --ctstate NEW -m comment --comment \"switchyard externally-visible service portals\" -j SWY-EXTERNAL-SERVICES"
            .to_owned()
    ));
    assert_eq!(
        lines.iter().collect::<BTreeSet<_>>().len(),
        JUMP_RULES.len(),
        "no duplicates"
    );
    let backend = IptablesBackend::new(Variant::Nft, settings());
    assert_eq!(backend.mode(), ProxyMode::Iptables);
    assert_eq!(
        backend.render_text(&dual(&scenario())),
        format!(
            "# iptables-restore input (IPv4)\n{}# ip6tables-restore input (IPv6)\n{}",
            render(&scenario(), &settings(), None).text(),
            render(&fixtures::ipv6_twin_snapshot(&scenario()), &settings(), None).text()
        )
    );
    assert!(IptablesBackend::from_variant_name("bogus", settings()).is_err());
    assert_eq!(
        IptablesBackend::from_variant_name("legacy", settings())
            .map(|b| b.variant())
            .ok(),
        Some(Variant::Legacy)
    );
}

#[test]
fn iptables_own_chains_from_save() {
    let save = "*nat\n:PREROUTING ACCEPT [0:0]\n:SWY-SERVICES - [0:0]\n:KUBE-SERVICES - [0:0]\n:SWY-SEP-X - [3:4]\n-A SWY-SERVICES -j SWY-SEP-X\nCOMMIT\n";
    let chains: Vec<String> = own_chains(save).into_iter().collect();
    assert_eq!(chains, vec!["SWY-SEP-X".to_owned(), "SWY-SERVICES".to_owned()]);
}

// ---------------------------------------------------------------------------------------------
// Kernel tests

/// Keeps the lines describing our chains (table headers, `COMMIT`, `:SWY-*`, `-A SWY-*`), with
/// chain counters zeroed and probabilities in the kernel's spelling.
fn normalise(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let keep = line.starts_with('*')
            || line == "COMMIT"
            || line.starts_with(":SWY-")
            || line.starts_with("-A SWY-");
        if !keep {
            continue;
        }
        let line = if line.starts_with(':') {
            match line.rfind(" [") {
                Some(i) => format!("{} [0:0]", &line[..i]),
                None => line.to_owned(),
            }
        } else if let Some((head, tail)) = line.split_once("--probability ") {
            let (value, rest) = tail.split_once(' ').unwrap_or((tail, ""));
            format!(
                "{head}--probability {} {rest}",
                kernel_probability(value.parse().unwrap())
            )
        } else {
            line.to_owned()
        };
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The normalised full renders of `snap` and its IPv6 twin.
fn render_pair(snap: &Snapshot) -> (String, String) {
    let v6 = fixtures::ipv6_twin_snapshot(snap);
    (
        normalise(&render(snap, &settings(), None).text()),
        normalise(&render(&v6, &settings(), None).text()),
    )
}

fn kernel_text(ipt: &Iptables) -> String {
    let filter = ipt.save(Table::Filter).unwrap();
    let nat = ipt.save(Table::Nat).unwrap();
    normalise(&format!("{filter}{nat}"))
}

fn whole_save(ipt: &Iptables) -> String {
    format!(
        "{}{}",
        ipt.save(Table::Filter).unwrap(),
        ipt.save(Table::Nat).unwrap()
    )
}

fn without_comments(save: &str) -> String {
    save.lines()
        .filter(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
}

fn service_chains(snap: &Snapshot, name: &str) -> Vec<String> {
    let mut out = vec![];
    for k in snap.services.keys().filter(|k| &*k.service.name == name) {
        for kind in ["SVC", "SVL", "EXT", "FW"] {
            out.push(crate::backend::names::ipt_service_chain(kind, k));
        }
        for e in snap.endpoints.get(k).into_iter().flatten() {
            out.push(crate::backend::names::ipt_endpoint_chain(k, e));
        }
    }
    out
}

fn round_trip(variant: Variant, n: u32) {
    let started = std::time::Instant::now();
    let ns = TestNetns::new(&format!("ipt-{n}"));
    let ipt = Iptables::new(variant, Some(ns.0.clone()));
    let ipt6 = ipt.clone().for_family(IpFamily::V6);
    let mut backend = IptablesBackend::with_netns(variant, settings(), Some(ns.0.clone()));
    // Both families' kernel state equals the render of the dual-stack form of `snap`.
    let both = |snap: &Snapshot| (kernel_text(&ipt), kernel_text(&ipt6), render_pair(snap));

    // Cleanup when nothing was ever programmed.
    backend.cleanup().unwrap();

    // Full sync: the kernel's listing of our chains is the golden text, in both families.
    let snap = scenario();
    let stats = backend.sync(&dual(&snap), &Changes::default(), true).unwrap();
    assert!(stats.full);
    assert_eq!(stats.services, 30);
    let golden = normalise(&read_golden("scenario.rules"));
    assert_eq!(
        kernel_text(&ipt),
        golden,
        "{variant}: kernel differs from golden after full sync"
    );
    assert_eq!(
        kernel_text(&ipt6),
        normalise(&read_golden("scenario6.rules")),
        "{variant}: ip6tables differs from the IPv6 golden after full sync"
    );
    let save = whole_save(&ipt);
    for rule in &JUMP_RULES {
        let count = save.lines().filter(|l| *l == rule.save_line()).count();
        assert_eq!(count, 1, "{variant}: jump rule {}", rule.save_line());
    }

    // A second full sync changes nothing and does not duplicate jump rules.
    backend.sync(&dual(&snap), &Changes::default(), true).unwrap();
    assert_eq!(kernel_text(&ipt), golden);
    assert_eq!(
        without_comments(&whole_save(&ipt)),
        without_comments(&save),
        "{variant}: second full sync changed the rules"
    );

    // Partial sync: a service is deleted; its chains go, everything else stays.
    let mut snap2 = snap.clone();
    let sticky: Vec<ServicePortName> = snap2
        .services
        .keys()
        .filter(|k| &*k.service.name == "sticky")
        .cloned()
        .collect();
    for k in &sticky {
        snap2.services.remove(k);
        snap2.endpoints.remove(k);
    }
    let stats = backend.sync(&dual(&snap2), &changes(&["sticky"]), false).unwrap();
    assert!(!stats.full);
    let (text, text6, (want, want6)) = both(&snap2);
    assert_eq!(
        (&text, &text6),
        (&want, &want6),
        "{variant}: after deleting a service"
    );
    for chain in service_chains(&snap, "sticky")
        .into_iter()
        .chain(service_chains(&fixtures::ipv6_twin_snapshot(&snap), "sticky"))
    {
        assert!(
            !text.contains(&chain) && !text6.contains(&chain),
            "{variant}: stale chain {chain} left"
        );
    }

    // Partial sync: an endpoint is added to one service and removed from another.
    let mut snap3 = snap2.clone();
    let one = spn("one", "http", Protocol::Tcp);
    snap3
        .endpoints
        .entry(one)
        .or_default()
        .push(ep("10.244.2.11", 8080, REMOTE));
    let np = spn("np", "", Protocol::Tcp);
    if let Some(eps) = snap3.endpoints.get_mut(&np) {
        eps.truncate(1);
    }
    let stats = backend
        .sync(&dual(&snap3), &changes(&["one", "np"]), false)
        .unwrap();
    assert!(!stats.full);
    let (text, text6, (want, want6)) = both(&snap3);
    assert_eq!((text, text6), (want, want6), "{variant}: after endpoint changes");

    // A Service that leaves IPv6 (dual-stack -> single-stack IPv4) loses only its IPv6 rules.
    let mut single = dual(&snap3);
    single.v6.services.retain(|k, _| &*k.service.name != "np");
    single.v6.endpoints.retain(|k, _| &*k.service.name != "np");
    backend.sync(&single, &changes(&["np"]), false).unwrap();
    assert_eq!(
        kernel_text(&ipt),
        normalise(&render(&single.v4, &settings(), None).text()),
        "{variant}: IPv4 kept np"
    );
    assert_eq!(
        kernel_text(&ipt6),
        normalise(&render(&single.v6, &settings(), None).text()),
        "{variant}: IPv6 dropped np"
    );
    backend.sync(&dual(&snap3), &changes(&["np"]), false).unwrap();

    // Cleanup removes everything, in both families, twice.
    backend.cleanup().unwrap();
    let save = format!("{}{}", whole_save(&ipt), whole_save(&ipt6));
    assert!(!save.contains("SWY"), "{variant}: left after cleanup:\n{save}");
    backend.cleanup().unwrap();

    // After cleanup the next sync is full even when asked for a partial one.
    let stats = backend.sync(&dual(&snap3), &changes(&["one"]), false).unwrap();
    assert!(stats.full);
    let (text, text6, (want, want6)) = both(&snap3);
    assert_eq!((text, text6), (want, want6));
    backend.cleanup().unwrap();
    assert!(!whole_save(&ipt).contains("SWY") && !whole_save(&ipt6).contains("SWY"));
    // Timing is the sync benchmark's business (it failed here under a loaded CI machine): printed.
    eprintln!("{variant}: round trip took {:?}", started.elapsed());
}

#[test]
fn iptables_kernel_round_trip_legacy() {
    round_trip(Variant::Legacy, 1);
}

#[test]
fn iptables_kernel_round_trip_nft() {
    round_trip(Variant::Nft, 2);
}

/// Chains asked for by name on the kernel tools, both variants: no table, a table without the
/// chains, one of them there; a missing chain is no error (iptables-nft 1.8.9 calls it
/// "incompatible"), and asking creates no table.
#[test]
fn iptables_kernel_existing_chains_are_found_by_name() {
    for (n, variant) in [Variant::Legacy, Variant::Nft].into_iter().enumerate() {
        let ns = TestNetns::new(&format!("ipt-exists-{n}"));
        let ipt = Iptables::new(variant, Some(ns.0.clone()));
        let wanted = ["SWY-IPVS-SERVICES", "SWY-IPVS-FILTER"];
        let ask = |table| ipt.existing_chains(table, &wanted).expect("existing_chains");
        assert!(ask(Table::Nat).is_empty(), "{variant}: no nat table");
        let created = match variant {
            Variant::Legacy => ipt.legacy_table_exists(Table::Nat).expect("ip_tables_names"),
            Variant::Nft => {
                let out = std::process::Command::new("ip")
                    .args(["netns", "exec", &ns.0, "nft", "list", "tables"])
                    .output()
                    .expect("nft list tables");
                assert!(out.status.success(), "nft list tables: {out:?}");
                String::from_utf8_lossy(&out.stdout).contains("ip nat")
            }
        };
        assert!(!created, "{variant}: asking created the nat table");
        ipt.restore("*nat\n:SWY-OTHER - [0:0]\nCOMMIT\n")
            .expect("restore");
        assert!(ask(Table::Nat).is_empty(), "{variant}: not ours");
        ipt.restore("*nat\n:SWY-IPVS-SERVICES - [0:0]\nCOMMIT\n")
            .expect("restore");
        assert_eq!(ask(Table::Nat), ["SWY-IPVS-SERVICES"], "{variant}");
        assert!(ask(Table::Filter).is_empty(), "{variant}: filter");
        assert_eq!(
            ipt.chain_rules(Table::Nat, "SWY-NONE")
                .expect("chain_rules of a missing chain"),
            "",
            "{variant}"
        );
    }
}

/// A refused restore is reported as a kernel error and forces the next sync to be full.
#[test]
fn iptables_kernel_failure_forces_full_sync() {
    let ns = TestNetns::new("ipt-3");
    let ipt = Iptables::new(Variant::Nft, Some(ns.0.clone()));
    let mut backend = IptablesBackend::with_netns(Variant::Nft, variant_settings(), Some(ns.0.clone()));
    let snap = variant_scenario();
    backend.sync(&dual(&snap), &Changes::default(), true).unwrap();
    // The second golden (node-port addresses, masquerade-all, no cluster CIDR) holds in the kernel too.
    assert_eq!(kernel_text(&ipt), normalise(&read_golden("variant.rules")));
    // Someone else references one of our service chains: deleting it must fail.
    let chain = service_chains(&snap, "np")
        .into_iter()
        .find(|c| c.starts_with("SWY-SVC-"))
        .unwrap();
    ipt.restore(&format!(
        "*nat\n:FOREIGN - [0:0]\n-A FOREIGN -j {chain}\nCOMMIT\n"
    ))
    .unwrap();
    let mut snap2 = snap.clone();
    snap2.services.retain(|k, _| &*k.service.name != "np");
    let err = backend.sync(&dual(&snap2), &changes(&["np"]), false).unwrap_err();
    assert!(matches!(err, BackendError::Kernel { .. }), "{err}");
    ipt.restore("*nat\n:FOREIGN - [0:0]\n-X FOREIGN\nCOMMIT\n")
        .unwrap();
    let stats = backend.sync(&dual(&snap2), &changes(&[]), false).unwrap();
    assert!(stats.full);
    assert_eq!(
        kernel_text(&ipt),
        normalise(&render(&snap2, &variant_settings(), None).text())
    );
    backend.cleanup().unwrap();
    assert!(!whole_save(&ipt).contains("SWY"));
}

#[test]
fn iptables_localhost_node_ports_follow_the_setting() {
    let np_jump = |text: &str| -> String {
        text.lines()
            .find(|l| l.starts_with("-A SWY-SERVICES") && l.ends_with("-j SWY-NODEPORTS"))
            .expect("the node-port jump")
            .to_owned()
    };
    let guard = super::render::localnet_guard_rule();
    // On (kube-proxy's default): loopback is not excluded, and the guard drops martian localnet
    // traffic from outside.
    let on = render(&scenario(), &settings(), None).text();
    assert!(!np_jump(&on).contains("127.0.0.0/8"), "{}", np_jump(&on));
    assert!(on.lines().any(|l| l == guard), "guard rule missing:\n{on}");
    assert!(super::render::serves_localhost_node_ports(
        &settings(),
        IpFamily::V4
    ));
    // Off: 127.0.0.0/8 never reaches SWY-NODEPORTS (refused at once), no guard.
    let off_settings = Settings {
        localhost_node_ports: false,
        ..settings()
    };
    let off = render(&scenario(), &off_settings, None).text();
    assert!(
        np_jump(&off).starts_with("-A SWY-SERVICES ! -d 127.0.0.0/8 "),
        "{}",
        np_jump(&off)
    );
    assert!(!off.lines().any(|l| l == guard));
    assert!(!super::render::serves_localhost_node_ports(
        &off_settings,
        IpFamily::V4
    ));
    // IPv6 never (no route_localnet for ::1), and restricted NodePort addresses never.
    let v6 = render(&fixtures::ipv6_twin_snapshot(&scenario()), &settings(), None).text();
    assert!(np_jump(&v6).starts_with("-A SWY-SERVICES ! -d ::1/128 "));
    assert!(!v6.lines().any(|l| l.starts_with("-A SWY-FIREWALL")));
    assert!(!super::render::serves_localhost_node_ports(
        &variant_settings(),
        IpFamily::V4
    ));
    // The jump into the guard chain from INPUT and OUTPUT is one of the ensured jump rules.
    let guard_jumps: Vec<_> = super::JUMP_RULES
        .iter()
        .filter(|j| j.target == super::render::FIREWALL)
        .map(|j| j.chain)
        .collect();
    assert_eq!(guard_jumps, ["INPUT", "OUTPUT"]);
}

/// Our lines of both families' `filter` and `nat` tables (chains, their rules, the jumps into
/// them), as `iptables-save` lists them.
fn owned_lines(tools: [&dyn SaveRestore; 2]) -> String {
    let mut out = String::new();
    for ipt in tools {
        for table in [Table::Filter, Table::Nat] {
            let save = ipt.save(table).expect("iptables-save");
            for line in save.lines().filter(|l| l.contains("SWY-") && !l.starts_with('#')) {
                out.push_str(&format!("{} {}: {line}\n", ipt.tool(), table.as_str()));
            }
        }
    }
    out
}

type FakeProxier = IptablesProxier<Faulty<FakeIptables>, FakeSysctl>;

/// The iptables backend on fake tools.
struct FakeSubject(FakeProxier);

/// Fails the next `n` writes: the first in IPv4, the second in IPv6, and so on.
fn fail_writes<I: SaveRestore, S: crate::sys::sysctl::Sysctl>(
    b: &mut IptablesProxier<Faulty<I>, S>,
    n: usize,
) {
    b.tools_mut(IpFamily::V4).fail_next(n.div_ceil(2));
    b.tools_mut(IpFamily::V6).fail_next(n / 2);
}

impl Subject for FakeSubject {
    type B = FakeProxier;
    fn backend(&mut self) -> &mut Self::B {
        &mut self.0
    }
    fn owned(&self) -> String {
        owned_lines(IpFamily::ALL.map(|f| self.0.tools(f).inner() as &dyn SaveRestore))
    }
    fn fail_writes(&mut self, n: usize) {
        fail_writes(&mut self.0, n);
    }
    fn disturb(&mut self) -> bool {
        remove_prerouting_jump(self.0.tools_mut(IpFamily::V4))
    }
}

/// Deletes our nat PREROUTING jump behind the backend's back (as `iptables -t nat -F PREROUTING`
/// would).
fn remove_prerouting_jump(tools: &mut impl SaveRestore) -> bool {
    let rule = super::JUMP_RULES
        .iter()
        .find(|r| r.table == Table::Nat && r.chain == "PREROUTING")
        .expect("the PREROUTING jump");
    let removed = tools
        .remove_rule(Table::Nat, "PREROUTING", &rule.spec())
        .expect("remove the jump");
    assert_eq!(removed, 1, "our jump was there once");
    true
}

struct FakeKit;

impl Kit for FakeKit {
    type S = FakeSubject;
    fn with_subject<T: Send>(&self, f: impl FnOnce(&mut Self::S) -> T + Send) -> T {
        let tools = IpFamily::ALL.map(|family| Faulty::new(FakeIptables::new(family)));
        let settings = crate::backend::conformance::fixtures::settings();
        f(&mut FakeSubject(IptablesProxier::with_adapters(
            Variant::Nft,
            settings,
            tools,
            FakeSysctl::new(),
        )))
    }
    fn cleanup_parts(&self) -> usize {
        2
    }
}

type KernelProxier = IptablesProxier<Faulty<Iptables>, crate::sys::sysctl::HostSysctl>;

/// The iptables backend on the kernel's tools of one variant, in a network namespace.
struct KernelSubject(KernelProxier);

impl Subject for KernelSubject {
    type B = KernelProxier;
    fn backend(&mut self) -> &mut Self::B {
        &mut self.0
    }
    fn owned(&self) -> String {
        owned_lines(IpFamily::ALL.map(|f| self.0.tools(f).inner() as &dyn SaveRestore))
    }
    fn fail_writes(&mut self, n: usize) {
        fail_writes(&mut self.0, n);
    }
    fn disturb(&mut self) -> bool {
        remove_prerouting_jump(self.0.tools_mut(IpFamily::V4))
    }
}

struct KernelKit(Variant);

static NETNS_SERIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Kit for KernelKit {
    type S = KernelSubject;
    fn with_subject<T: Send>(&self, f: impl FnOnce(&mut Self::S) -> T + Send) -> T {
        let n = NETNS_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ns = TestNetns::new(&format!("ipt-suite-{}{n}", self.0));
        let netns = Some(ns.0.clone());
        let tools =
            IpFamily::ALL.map(|family| Faulty::new(Iptables::new(self.0, netns.clone()).for_family(family)));
        let settings = crate::backend::conformance::fixtures::settings();
        let sysctl = crate::sys::sysctl::HostSysctl::new(netns);
        f(&mut KernelSubject(IptablesProxier::with_adapters(
            self.0, settings, tools, sysctl,
        )))
    }
    fn cleanup_parts(&self) -> usize {
        2
    }
}

/// The conformance suite on fake iptables tools (no root).
mod conformance_fake {
    super::conformance_suite!(super::FakeKit);
}

/// The conformance suite on the kernel with `iptables-legacy` (root; a network namespace per case).
mod conformance_kernel_legacy {
    super::conformance_suite!(super::KernelKit(super::Variant::Legacy));
}

/// The conformance suite on the kernel with `iptables-nft` (root; a network namespace per case).
mod conformance_kernel_nft {
    super::conformance_suite!(super::KernelKit(super::Variant::Nft));
}

/// A full sync on the fake tools leaves exactly the golden text the kernel test compares the
/// kernel's `iptables-save` with, in both families.
#[test]
fn fake_saves_exactly_the_golden_rules() {
    let tools = IpFamily::ALL.map(FakeIptables::new);
    let mut backend = IptablesProxier::with_adapters(Variant::Nft, settings(), tools, FakeSysctl::new());
    backend
        .sync(&dual(&scenario()), &Changes::default(), true)
        .expect("full sync");
    let text = |f: IpFamily| {
        let ipt = backend.tools(f);
        normalise(&format!(
            "{}{}",
            ipt.save(Table::Filter).expect("save"),
            ipt.save(Table::Nat).expect("save")
        ))
    };
    assert_eq!(text(IpFamily::V4), normalise(&read_golden("scenario.rules")));
    assert_eq!(text(IpFamily::V6), normalise(&read_golden("scenario6.rules")));
    assert_eq!(backend.sysctl().get(super::render::ROUTE_LOCALNET), "1");
}

/// `n` ClusterIP services `big-<i>` with two remote endpoints each.
fn two_endpoint_services(n: usize) -> Snapshot {
    let mut s = Snapshot::default();
    for i in 0..n {
        let (hi, lo) = (i / 200, i % 200);
        add(
            &mut s,
            port(
                &format!("big-{i}"),
                "http",
                Protocol::Tcp,
                &format!("10.96.{}.{}", 10 + hi, 10 + lo),
                80,
            ),
            vec![
                ep(&format!("10.244.{}.{}", 10 + hi, 10 + lo), 8080, REMOTE),
                ep(&format!("10.245.{}.{}", 10 + hi, 10 + lo), 8080, REMOTE),
            ],
        );
    }
    s
}

/// Above 1,000 endpoints (kube-proxy's large-cluster mode) the rules to and in the endpoint
/// chains lose their comments, the others keep theirs; at 1,000 nothing changes.
#[test]
fn iptables_large_clusters_drop_the_per_endpoint_comments() {
    let count = |snap: &Snapshot| {
        let r = render(snap, &settings(), None);
        let text = r.text();
        let commented = |prefix: &str| {
            text.lines()
                .filter(|l| l.starts_with(prefix) && l.contains("-m comment"))
                .count()
        };
        let rules = |prefix: &str| text.lines().filter(|l| l.starts_with(prefix)).count();
        (
            r.large_cluster,
            commented("-A SWY-SVC-") + commented("-A SWY-SEP-"),
            rules("-A SWY-SVC-") + rules("-A SWY-SEP-"),
            commented("-A SWY-SERVICES"),
        )
    };
    // 500 services × 2 = 1,000 endpoints: not large; every per-endpoint rule commented (the SVC
    // chains' masquerade rule included).
    let (large, commented, rules, top) = count(&two_endpoint_services(500));
    assert!(!large);
    assert_eq!((commented, rules), (500 * 7, 500 * 7));
    assert_eq!(top, 500 + 1, "a jump per service and the NodePorts rule");
    // 501 × 2 = 1,002: large; only the SVC chains' masquerade rule keeps its comment, as in
    // kube-proxy; the top-level jumps keep theirs.
    let (large, commented, rules, top) = count(&two_endpoint_services(501));
    assert!(large);
    assert_eq!((commented, rules), (501, 501 * 7));
    assert_eq!(top, 501 + 1, "a jump per service and the NodePorts rule");
}

/// A partial sync that crosses the large-cluster threshold is made full, so that no unchanged
/// service keeps chains in the other comment style; one that does not cross it stays partial.
#[test]
fn iptables_crossing_the_large_cluster_threshold_syncs_in_full() {
    let tools = IpFamily::ALL.map(FakeIptables::new);
    let mut backend = IptablesProxier::with_adapters(Variant::Nft, settings(), tools, FakeSysctl::new());
    let mut snap = two_endpoint_services(500);
    let sync = |b: &mut IptablesProxier<FakeIptables, FakeSysctl>, s: &Snapshot, names: &[&str], full| {
        b.sync(&dual(s), &changes(names), full).expect("sync").full
    };
    assert!(sync(&mut backend, &snap, &[], true));
    let before = backend.tools(IpFamily::V4).save(Table::Nat).expect("save");
    assert!(
        before.contains("\"ns/big-7:http -> 10.244.10.17:8080\""),
        "commented while small"
    );
    snap = two_endpoint_services(501);
    assert!(
        sync(&mut backend, &snap, &["big-500"], false),
        "the crossing sync is full"
    );
    let after = backend.tools(IpFamily::V4).save(Table::Nat).expect("save");
    assert!(
        !after.contains(" -> 10.244."),
        "no per-endpoint comment left once large"
    );
    // Staying large: partial again.
    let mut more = two_endpoint_services(501);
    more.endpoints.values_mut().next().expect("eps").pop();
    let first = more.services.keys().next().expect("svc").service.name.clone();
    assert!(
        !sync(&mut backend, &more, &[&*first], false),
        "partial while large"
    );
}

/// A partial sync leaves out the top-level chains whose rules did not change (on iptables-nft a
/// restore costs per chain it names, and nat `SWY-SERVICES` names every service's chain) and
/// writes those that did; either way the tables end as a full sync of the same state leaves them.
#[test]
fn iptables_partial_syncs_write_top_level_chains_only_when_they_change() {
    let tools = IpFamily::ALL.map(FakeIptables::new);
    let mut backend = IptablesProxier::with_adapters(Variant::Nft, settings(), tools, FakeSysctl::new());
    let as_full = |snap: &Snapshot| {
        let tools = IpFamily::ALL.map(FakeIptables::new);
        let mut fresh = IptablesProxier::with_adapters(Variant::Nft, settings(), tools, FakeSysctl::new());
        fresh
            .sync(&dual(snap), &Changes::default(), true)
            .expect("full sync");
        owned_lines([fresh.tools(IpFamily::V4), fresh.tools(IpFamily::V6)])
    };
    let mut snap = two_endpoint_services(300);
    assert!(
        backend
            .sync(&dual(&snap), &Changes::default(), true)
            .expect("full")
            .full
    );

    // An endpoint moves: the service's own chains only (its SVC and SEP chains and the stale SEP
    // chain's deletion, 11 objects per family), not the 300-rule SWY-SERVICES and the other
    // top-level chains (~320 objects per family).
    let first = snap.services.keys().next().cloned().expect("a service");
    snap.endpoints.get_mut(&first).expect("endpoints")[0] = ep("10.250.0.1", 8080, REMOTE);
    let moved = backend
        .sync(&dual(&snap), &changes(&[&*first.service.name]), false)
        .expect("partial sync");
    assert!(!moved.full);
    assert!(
        moved.objects_written <= 22,
        "wrote {} objects",
        moved.objects_written
    );
    let owned = |b: &IptablesProxier<FakeIptables, FakeSysctl>| {
        owned_lines([b.tools(IpFamily::V4), b.tools(IpFamily::V6)])
    };
    assert_eq!(owned(&backend), as_full(&snap), "after the endpoint moved");

    // A new service: SWY-SERVICES changes, so it is written again, with the new rule.
    add(
        &mut snap,
        port("new", "http", Protocol::Tcp, "10.96.200.1", 80),
        vec![ep("10.250.0.2", 8080, REMOTE)],
    );
    let added = backend
        .sync(&dual(&snap), &changes(&["new"]), false)
        .expect("partial sync");
    assert!(!added.full);
    assert!(
        added.objects_written > 300,
        "wrote {} objects",
        added.objects_written
    );
    assert_eq!(owned(&backend), as_full(&snap), "after the new service");

    // After a failed sync (the next is full) every chain is written again.
    backend.tools_mut(IpFamily::V4).fail_writes(1);
    assert!(backend.sync(&dual(&snap), &changes(&["new"]), false).is_err());
    let after_failure = backend
        .sync(&dual(&snap), &changes(&["new"]), false)
        .expect("sync after the failure");
    assert!(after_failure.full);
    assert_eq!(owned(&backend), as_full(&snap), "after the failure");
}
