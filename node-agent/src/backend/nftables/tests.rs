//! Tests of the nftables backend: the render is golden-tested against what the kernel lists back
//! (`nft list table ip switchyard` and `ip6 switchyard` are the oracle), and the netlink encoding
//! is checked against `nft -f` of our own text render (both must list identically). The scenario
//! exists in both families, as a dual-stack cluster would have it.

use std::{
    fs::File,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsFd,
    path::PathBuf,
};

use nix::sched::{CloneFlags, setns};

use super::*;
use crate::{
    backend::Backend,
    model::{
        DualSnapshot, Endpoint, IpFamily, IpNet, NodeInfo, Protocol, ServicePort, ServicePortName, fixtures,
    },
};

/// A network namespace for one test, deleted on drop.
pub(crate) struct TestNetns(pub String);

impl TestNetns {
    pub(crate) fn new(tag: &str) -> Self {
        let name = format!("swyu{}-{tag}", std::process::id());
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        let ok = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("ip")
            .success();
        assert!(ok, "ip netns add {name}");
        Self(name)
    }

    /// Runs `f` on a thread inside the namespace.
    pub(crate) fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let ns = File::open(&path).expect("netns file");
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("netns thread")
    }

    pub(crate) fn sh(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &self.0])
            .args(args)
            .output()
            .expect("run");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

fn name(ns: &str, svc: &str, port: &str, protocol: Protocol) -> ServicePortName {
    fixtures::port_name(ns, svc, port, protocol)
}

/// The scenario's address `a` in `family`: IPv4 as written; IPv6 maps `10.x.y.z` into
/// `fd00:10:x:y::z` and the documentation ranges `192.0.2.z` / `203.0.113.z` into `2001:db8::z` /
/// `2001:db8:113::z` (each decimal octet spelled as a hex group, so the addresses stay readable).
fn addr(family: IpFamily, a: [u8; 4]) -> IpAddr {
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
fn dual_scenario() -> (DualSnapshot, Settings) {
    (
        DualSnapshot {
            v4: scenario_of(IpFamily::V4),
            v6: scenario_of(IpFamily::V6),
        },
        settings(),
    )
}

fn settings() -> Settings {
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
        service_cidrs: vec![
            "10.96.0.0/16".parse().expect("cidr"),
            "fd00:10:96::/112".parse().expect("cidr"),
        ],
    }
}

fn scenario_of(family: IpFamily) -> Snapshot {
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

fn golden(file: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("src/backend/nftables/testdata")
        .join(file);
    if std::env::var_os("SWITCHYARD_UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        std::fs::write(&path, actual).expect("write golden");
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("missing golden {}", path.display()));
    assert_eq!(
        actual,
        want,
        "{} differs (SWITCHYARD_UPDATE_GOLDEN=1 rewrites it)",
        path.display()
    );
}

#[test]
fn render_text_is_golden() {
    let (snap, settings) = dual_scenario();
    golden("scenario.render.nft", &render::full(&snap.v4, &settings).text());
    golden("scenario6.render.nft", &render::full(&snap.v6, &settings).text());
}

fn list(ns: &TestNetns, family: IpFamily) -> String {
    ns.sh(&["nft", "list", "table", ir::family_name(family), "switchyard"])
}

#[test]
fn kernel_lists_exactly_the_golden_ruleset_and_matches_nft_of_our_text() {
    let (snap, settings) = dual_scenario();
    // Programmed over netlink.
    let ns = TestNetns::new("nft-golden");
    let (s2, set2) = (snap.clone(), settings.clone());
    let stats = ns
        .run(move || {
            NftablesBackend::new(set2)
                .sync(&s2, &Changes::default(), true)
                .map_err(|e| e.to_string())
        })
        .expect("full sync");
    assert_eq!(stats.services, snap.v4.services.len() + snap.v6.services.len());
    let listed = list(&ns, IpFamily::V4);
    golden("scenario.list.nft", &listed);
    let listed6 = list(&ns, IpFamily::V6);
    golden("scenario6.list.nft", &listed6);

    // The same rulesets loaded by nft from our text render list identically.
    let oracle = TestNetns::new("nft-oracle");
    let script = std::env::temp_dir().join(format!("swyu{}-render.nft", std::process::id()));
    std::fs::write(&script, NftablesBackend::new(settings).render_text(&snap)).expect("write script");
    oracle.sh(&["nft", "-f", &script.display().to_string()]);
    let _ = std::fs::remove_file(&script);
    assert_eq!(listed, list(&oracle, IpFamily::V4));
    assert_eq!(listed6, list(&oracle, IpFamily::V6));
}

/// The sets, maps and chains of an `nft list table` output, sorted: the kernel lists objects in
/// creation order, so an endpoint map a partial sync creates comes after older ones.
fn sorted_blocks(listing: &str) -> Vec<String> {
    let mut blocks: Vec<String> = Vec::new();
    let mut current: Option<String> = None;
    for line in listing.lines() {
        if let Some(block) = current.as_mut() {
            block.push_str(line);
            block.push('\n');
            if line == "\t}" {
                blocks.extend(current.take());
            }
        } else if ["\tset ", "\tmap ", "\tchain "]
            .iter()
            .any(|p| line.starts_with(p))
        {
            current = Some(format!("{line}\n"));
        }
    }
    blocks.sort();
    blocks
}

#[test]
fn partial_sync_touches_only_changed_services_and_cleanup_removes_everything() {
    let (mut snap, settings) = dual_scenario();
    let ns = TestNetns::new("nft-partial");
    let mut backend = NftablesBackend::new(settings.clone());
    let (s1, backend_full) = ns.run({
        let snap = snap.clone();
        move || {
            let stats = backend
                .sync(&snap, &Changes::default(), true)
                .map_err(|e| e.to_string());
            (stats, backend)
        }
    });
    let full = s1.expect("full sync");
    let mut backend = backend_full;

    // In both families: change one service (drop an endpoint of dns) and delete another
    // (sticky); in IPv6 only, delete a third (one), as when a Service becomes single-stack.
    let key = |s: &Snapshot, svc: &str| {
        s.services
            .keys()
            .find(|k| k.service.name == svc)
            .expect("service")
            .clone()
    };
    let (dns, sticky, one) = (
        key(&snap.v4, "dns"),
        key(&snap.v4, "sticky"),
        key(&snap.v4, "one"),
    );
    for s in [&mut snap.v4, &mut snap.v6] {
        s.endpoints.get_mut(&dns).expect("eps").pop();
        s.services.remove(&sticky);
        s.endpoints.remove(&sticky);
    }
    snap.v6.services.remove(&one);
    snap.v6.endpoints.remove(&one);
    let changes = Changes {
        services: [&dns, &sticky, &one]
            .into_iter()
            .map(|k| k.service.clone())
            .collect(),
    };
    let (partial, backend2) = ns.run({
        let snap = snap.clone();
        move || {
            let stats = backend.sync(&snap, &changes, false).map_err(|e| e.to_string());
            (stats, backend)
        }
    });
    let partial = partial.expect("partial sync");
    assert!(!partial.full);
    assert!(
        partial.objects_written * 4 < full.objects_written,
        "partial {partial:?} vs full {full:?}"
    );
    let (listed, listed6) = (list(&ns, IpFamily::V4), list(&ns, IpFamily::V6));
    assert!(
        !listed.contains("10.244.3.11") && !listed6.contains("fd00:10:244:3::11"),
        "removed endpoint still programmed"
    );
    assert!(
        !listed.contains("web/sticky") && !listed6.contains("web/sticky"),
        "deleted service still has chains or sets"
    );
    assert!(
        !listed.contains("10.96.0.16") && !listed6.contains("fd00:10:96::16"),
        "deleted service still in maps"
    );
    assert!(
        listed.contains("10.96.0.11") && !listed6.contains("fd00:10:96::11"),
        "single-stack change"
    );
    // The result equals a fresh full render of the new snapshot.
    let oracle = TestNetns::new("nft-partial-oracle");
    let s3 = snap.clone();
    let set3 = settings.clone();
    oracle
        .run(move || {
            NftablesBackend::new(set3)
                .sync(&s3, &Changes::default(), true)
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .expect("oracle");
    assert_eq!(
        sorted_blocks(&listed),
        sorted_blocks(&list(&oracle, IpFamily::V4))
    );
    assert_eq!(
        sorted_blocks(&listed6),
        sorted_blocks(&list(&oracle, IpFamily::V6))
    );

    let mut backend = backend2;
    ns.run(move || {
        backend.cleanup().map_err(|e| e.to_string())?;
        backend.cleanup().map_err(|e| e.to_string())
    })
    .expect("cleanup twice");
    assert_eq!(ns.sh(&["nft", "list", "ruleset"]).trim(), "");
}

/// Adding such a service or changing its endpoints must not make the kernel re-validate the chain
/// graph: no chains, no rules, no `goto` elements, only keys and DNAT targets.
#[test]
fn services_without_affinity_or_local_external_policy_are_map_elements_only() {
    let (dual, settings) = dual_scenario();
    for snap in dual.families() {
        for (name, port) in &snap.services {
            let eps = snap.endpoints.get(name).map(Vec::as_slice).unwrap_or_default();
            let frag = render::service(port, eps, &settings);
            let chained = port.affinity_timeout_seconds.is_some()
                || (port.external_policy_local && port.externally_accessible());
            let jumps = frag
                .elements
                .iter()
                .filter(|(_, e)| matches!(e.verdict, Some(ir::Verdict::Goto(_) | ir::Verdict::Jump(_))));
            let jumps: Vec<_> = jumps
                .filter(|(_, e)| e.verdict != Some(ir::Verdict::Goto("reject-chain".into())))
                .collect();
            assert_eq!(
                chained,
                !frag.chains.is_empty() || !jumps.is_empty(),
                "{name}: {frag:?}"
            );
        }
        // Slot j of n DNATs to endpoint j, in the map for n endpoints.
        let dns = snap
            .services
            .keys()
            .find(|k| k.service.name == "dns")
            .expect("dns");
        let frag = render::service(&snap.services[dns], &snap.endpoints[dns], &settings);
        let slots: Vec<(String, ir::Key)> = frag
            .elements
            .iter()
            .filter(|(_, e)| e.dnat.is_some())
            .map(|(set, e)| (render::element_set(set, &e.key).into_owned(), e.key.clone()))
            .collect();
        assert_eq!(slots.len(), 3);
        assert!(
            slots
                .iter()
                .all(|(set, k)| set == "ip-endpoints-3" && k.slot().is_some_and(|s| s.count == 3)),
            "{slots:?}"
        );
    }
}

#[test]
fn service_cidrs_drop_unhandled_cluster_ips_per_family() {
    let (snap, settings) = dual_scenario();
    let chain = |text: &str| -> Vec<String> {
        let start = text.find("chain cluster-ips-check {").expect("cluster-ips-check");
        let body = &text[start..];
        body[..body.find('}').expect("end of chain")]
            .lines()
            .skip(1)
            .map(|l| l.trim().to_owned())
            .filter(|l| !l.is_empty())
            .collect()
    };
    let drop4 = "ip daddr 10.96.0.0/16 drop comment \"Drop traffic to unallocated ClusterIPs\"";
    let drop6 = "ip6 daddr fd00:10:96::/112 drop comment \"Drop traffic to unallocated ClusterIPs\"";
    let v4 = chain(&render::full(&snap.v4, &settings).text());
    let v6 = chain(&render::full(&snap.v6, &settings).text());
    // After the reject of handled ClusterIPs' other ports, each family's own CIDR only.
    assert_eq!(v4.last().map(String::as_str), Some(drop4), "{v4:?}");
    assert_eq!(v6.last().map(String::as_str), Some(drop6), "{v6:?}");
    assert!(!v4.iter().any(|l| l.contains("fd00:10:96")));
    // Without known Service CIDRs nothing is dropped (as kube-proxy without ServiceCIDRs).
    let none = Settings {
        service_cidrs: Vec::new(),
        ..settings.clone()
    };
    let v4 = chain(&render::full(&snap.v4, &none).text());
    assert!(!v4.iter().any(|l| l.contains("drop")), "{v4:?}");
}
