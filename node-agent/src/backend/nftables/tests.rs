//! Tests of the nftables backend: the render is golden-tested against what the kernel lists back
//! (`nft list table ip switchyard` and `ip6 switchyard` are the oracle), and the netlink encoding
//! is checked against `nft -f` of our own text render (both must list identically). The scenario
//! exists in both families, as a dual-stack cluster would have it.

use super::*;
use crate::{
    backend::{
        Backend,
        conformance::{
            fixtures::dual_scenario,
            golden,
            netns::TestNetns,
            suite::{Kit, Subject, conformance_suite},
        },
    },
    model::IpFamily,
    sys::nft::{
        KernelNft,
        fake::{FakeNft, Faulty},
    },
};

fn golden(file: &str, actual: &str) {
    golden::check("nftables", file, actual);
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

/// A fresh namespace `name` holding a full sync of `snap` by a new backend: the oracle a partial
/// sync's result is compared with.
fn fully_synced(name: &str, snap: &crate::model::DualSnapshot, settings: &Settings) -> TestNetns {
    let ns = TestNetns::new(name);
    let (snap, settings) = (snap.clone(), settings.clone());
    ns.run(move || {
        NftablesBackend::new(settings)
            .sync(&snap, &Changes::default(), true)
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .expect("oracle full sync");
    ns
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
            .find(|k| &*k.service.name == svc)
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
    let oracle = fully_synced("nft-partial-oracle", &snap, &settings);
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

/// `ns`'s IPv4 table lists as a fresh full sync of `snap` does (after `what`), the full sync made
/// in namespace `oracle_tag` (unique per test: tests run in parallel).
fn assert_like_a_full_sync(
    ns: &TestNetns,
    oracle_tag: &str,
    snap: &crate::model::DualSnapshot,
    settings: &Settings,
    what: &str,
) {
    let oracle = fully_synced(oracle_tag, snap, settings);
    assert_eq!(
        sorted_blocks(&list(ns, IpFamily::V4)),
        sorted_blocks(&list(&oracle, IpFamily::V4)),
        "after the partial sync of {what}"
    );
}

/// `backend.verify()` in `ns` finds no drift (after `what`).
fn assert_no_drift(ns: &TestNetns, backend: &NftablesBackend, what: &str) {
    let drift = ns.run(move || backend.verify().map_err(|e| e.to_string()));
    assert_eq!(drift, Ok(Vec::new()), "verify after {what}");
}

/// Such a service needs no chain or rule of its own (adding one, or changing its endpoints, adds
/// and deletes elements only): its verdict-map elements go to the shared count chains.
#[test]
fn services_without_affinity_or_local_external_policy_have_no_chains_of_their_own() {
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
            let shared = |target: &str| target == "reject-chain" || target.starts_with("dnat-");
            let jumps: Vec<_> = jumps
                .filter(|(_, e)| !matches!(&e.verdict, Some(ir::Verdict::Goto(t)) if shared(t)))
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
            .find(|k| &*k.service.name == "dns")
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

/// The fake lists exactly what the kernel lists for the same sync: both are compared with the same
/// golden listings (the kernel one in `kernel_lists_exactly_the_golden_ruleset_…`).
#[test]
fn fake_lists_exactly_the_golden_ruleset() {
    let (snap, settings) = dual_scenario();
    let mut backend = Nftables::with_adapter(settings, FakeNft::new());
    let stats = backend.sync(&snap, &Changes::default(), true).expect("full sync");
    assert_eq!(stats.services, snap.v4.services.len() + snap.v6.services.len());
    let listing = |family| backend.adapter().listing(family).expect("table");
    golden("scenario.list.nft", &listing(IpFamily::V4));
    golden("scenario6.list.nft", &listing(IpFamily::V6));
}

/// A ruleset listing (`nft list ruleset`, or the fake's tables one after the other) normalised:
/// each table's header and its sets, maps and chains sorted; tables sorted.
fn normalise(ruleset: &str) -> String {
    let mut tables: Vec<String> = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in ruleset.lines() {
        if line.starts_with("table ") {
            tables.extend(current.take().map(|(h, body)| h + &sorted_blocks(&body).concat()));
            current = Some((format!("{line}\n"), String::new()));
        } else if let Some((_, body)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    tables.extend(current.map(|(h, body)| h + &sorted_blocks(&body).concat()));
    tables.sort();
    tables.concat()
}

/// The nftables backend on the fake.
struct FakeSubject(Nftables<Faulty<FakeNft>>);

impl Subject for FakeSubject {
    type B = Nftables<Faulty<FakeNft>>;
    fn backend(&mut self) -> &mut Self::B {
        &mut self.0
    }
    fn owned(&self) -> String {
        let fake = self.0.adapter().inner();
        normalise(
            &IpFamily::ALL
                .map(|f| fake.listing(f).unwrap_or_default())
                .concat(),
        )
    }
    fn fail_writes(&mut self, n: usize) {
        self.0.adapter_mut().fail_next(n);
    }
    fn disturb(&mut self) -> bool {
        delete_v4_table(self.0.adapter_mut())
    }
}

/// `delete table ip switchyard` through `nft`, behind the backend's back.
fn delete_v4_table(nft: &mut impl NfTables) -> bool {
    let mut batch = Batch::new(IpFamily::V4);
    batch.delete_table();
    nft.apply(batch).expect("delete the table");
    true
}

struct FakeKit;

impl Kit for FakeKit {
    type S = FakeSubject;
    fn with_subject<T: Send>(&self, f: impl FnOnce(&mut Self::S) -> T + Send) -> T {
        f(&mut FakeSubject(Nftables::with_adapter(
            dual_scenario().1,
            Faulty::new(FakeNft::new()),
        )))
    }
    fn cleanup_parts(&self) -> usize {
        2
    }
}

/// The nftables backend on the kernel, in a network namespace (every call runs inside it).
struct KernelSubject(Nftables<Faulty<KernelNft>>);

impl Subject for KernelSubject {
    type B = Nftables<Faulty<KernelNft>>;
    fn backend(&mut self) -> &mut Self::B {
        &mut self.0
    }
    fn owned(&self) -> String {
        let out = std::process::Command::new("nft")
            .args(["list", "ruleset"])
            .output()
            .expect("run nft");
        assert!(out.status.success(), "nft list ruleset: {out:?}");
        normalise(&String::from_utf8_lossy(&out.stdout))
    }
    fn fail_writes(&mut self, n: usize) {
        self.0.adapter_mut().fail_next(n);
    }
    fn disturb(&mut self) -> bool {
        delete_v4_table(self.0.adapter_mut())
    }
}

struct KernelKit;

static NETNS_SERIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Kit for KernelKit {
    type S = KernelSubject;
    fn with_subject<T: Send>(&self, f: impl FnOnce(&mut Self::S) -> T + Send) -> T {
        let n = NETNS_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ns = TestNetns::new(&format!("nft-suite{n}"));
        ns.run(move || {
            f(&mut KernelSubject(Nftables::with_adapter(
                dual_scenario().1,
                Faulty::new(KernelNft::default()),
            )))
        })
    }
    fn cleanup_parts(&self) -> usize {
        2
    }
}

/// The fake and the kernel agree beyond the golden scenario: after the suite's full and partial
/// syncs both hold the same tables (root).
#[test]
fn fake_and_kernel_agree_after_full_and_partial_syncs() {
    crate::backend::conformance::suite::kits_agree(&FakeKit, &KernelKit);
}

/// The conformance suite on the fake nf_tables (no root).
mod conformance_fake {
    super::conformance_suite!(super::FakeKit);
}

/// The conformance suite on the kernel (root; a network namespace per case).
mod conformance_kernel {
    super::conformance_suite!(super::KernelKit);
}

/// The scenario's settings with localhost NodePorts on in nftables mode.
fn localhost_settings() -> (crate::model::DualSnapshot, Settings) {
    let (snap, settings) = dual_scenario();
    let on = Settings {
        nftables_localhost_node_ports: true,
        ..settings
    };
    (snap, on)
}

/// Lines of `after` that `before` lacks, and of `before` that `after` lacks (each in order).
fn line_diff(before: &str, after: &str) -> (Vec<String>, Vec<String>) {
    let (b, a): (Vec<&str>, Vec<&str>) = (before.lines().collect(), after.lines().collect());
    let added = a
        .iter()
        .filter(|l| !b.contains(l))
        .map(|l| l.trim().to_owned())
        .collect();
    let removed = b
        .iter()
        .filter(|l| !a.contains(l))
        .map(|l| l.trim().to_owned())
        .collect();
    (added, removed)
}

const LOCALNET_GUARD: &str = "ct state new ip saddr != 127.0.0.0/8 ip daddr 127.0.0.0/8 drop comment \"block incoming localnet connections\"";
const LOCALHOST_DISPATCH: &str =
    "ip daddr 127.0.0.0/8 jump nodeports comment \"localhost NodePorts (route_localnet)\"";

/// Off (kube-proxy's nftables default) the goldens hold; on, the IPv4 table gains exactly the
/// guard in `filter-input` and the loopback dispatch in `nat-output`, each last in its chain, and
/// the IPv6 table nothing (`::1` is never routed off the node).
#[test]
fn localhost_node_ports_add_two_ipv4_rules_only() {
    let (snap, off) = dual_scenario();
    assert!(!off.nftables_localhost_node_ports, "the goldens are the default");
    let (_, on) = localhost_settings();
    let text = |s: &Snapshot, settings: &Settings| render::full(s, settings).text();
    let (added, removed) = line_diff(&text(&snap.v4, &off), &text(&snap.v4, &on));
    assert_eq!(added, [LOCALNET_GUARD, LOCALHOST_DISPATCH]);
    assert!(removed.is_empty(), "{removed:?}");
    assert_eq!(text(&snap.v6, &off), text(&snap.v6, &on));
    let chain_of = |name: &str| -> Vec<String> {
        let t = text(&snap.v4, &on);
        let start = t.find(&format!("chain {name} {{")).expect("chain");
        let body = &t[start..];
        body[..body.find('}').expect("end")]
            .lines()
            .map(|l| l.trim().to_owned())
            .filter(|l| !l.is_empty())
            .collect()
    };
    assert_eq!(
        chain_of("filter-input").last().map(String::as_str),
        Some(LOCALNET_GUARD)
    );
    assert_eq!(
        chain_of("nat-output").last().map(String::as_str),
        Some(LOCALHOST_DISPATCH)
    );
}

/// The two rules as the kernel lists them after a netlink sync: only those lines differ from the
/// golden listing, and `nft -f` of our text render lists the same.
#[test]
fn kernel_lists_the_localhost_rules_as_rendered() {
    let (snap, on) = localhost_settings();
    let ns = TestNetns::new("nft-localhost");
    let (s2, set2) = (snap.clone(), on.clone());
    ns.run(move || {
        NftablesBackend::new(set2)
            .sync(&s2, &Changes::default(), true)
            .map_err(|e| e.to_string())
    })
    .expect("full sync");
    let listed = list(&ns, IpFamily::V4);
    let (added, removed) = line_diff(&golden::read("nftables", "scenario.list.nft"), &listed);
    assert_eq!(added, [LOCALNET_GUARD, LOCALHOST_DISPATCH], "{listed}");
    assert!(removed.is_empty(), "{removed:?}");

    let oracle = TestNetns::new("nft-localhost-oracle");
    let script = std::env::temp_dir().join(format!("swyu{}-localhost.nft", std::process::id()));
    std::fs::write(&script, NftablesBackend::new(on).render_text(&snap)).expect("write script");
    oracle.sh(&["nft", "-f", &script.display().to_string()]);
    let _ = std::fs::remove_file(&script);
    assert_eq!(listed, list(&oracle, IpFamily::V4));
}

/// One element query answers with exactly the DNAT targets the render put in an endpoint map,
/// and says when an element is missing (root; the API benchmark polls the kernel with it).
#[test]
fn kernel_answers_an_element_query_with_the_rendered_targets() {
    let (dual, settings) = dual_scenario();
    let snap = &dual.v4;
    let dns = snap
        .services
        .keys()
        .find(|k| &*k.service.name == "dns")
        .expect("dns");
    let frag = render::service(&snap.services[dns], &snap.endpoints[dns], &settings);
    let slots: Vec<(String, ir::Key, (std::net::IpAddr, u16))> = frag
        .elements
        .iter()
        .filter_map(|(set, e)| {
            let target = e.dnat?;
            Some((
                render::element_set(set, &e.key).into_owned(),
                e.key.clone(),
                target,
            ))
        })
        .collect();
    assert_eq!(slots.len(), 3, "{slots:?}");
    let map = slots[0].0.clone();
    let keys: Vec<ir::Key> = slots.iter().map(|(_, k, _)| k.clone()).collect();
    let ns = TestNetns::new("nft-get");
    let (found, missing) = ns.run(|| {
        Nftables::with_adapter(settings.clone(), KernelNft::default())
            .sync(&dual, &crate::model::Changes::default(), true)
            .expect("full sync");
        let found = crate::sys::nft::get_elements(IpFamily::V4, &map, &keys).expect("query");
        let mut absent = keys.clone();
        if let ir::Key::AddrProtoPortSlot(_, _, port, _) = &mut absent[0] {
            *port += 1;
        }
        let missing = crate::sys::nft::get_elements(IpFamily::V4, &map, &absent).expect("query");
        (found, missing)
    });
    let found = found.expect("every rendered element is in the kernel");
    assert_eq!(found.len(), 3, "one answer per element");
    for (_, _, (ip, port)) in &slots {
        let value = crate::sys::nft::codec::dnat_value_bytes(ip, *port);
        assert!(
            found.iter().any(|p| p.windows(value.len()).any(|w| w == value)),
            "{ip}:{port} in the answer"
        );
    }
    assert_eq!(missing, None, "a key that is not in the map");
}

/// The dispatch over endpoint counts: per count in use, its map and its chains, each one rule
/// reading exactly that map (the masquerading ones marking first); nothing for counts not in use.
#[test]
fn dispatch_has_a_chain_per_count_and_destination_kind_reading_its_map() {
    use render::{
        dispatch,
        sets::{IP_ENDPOINTS, NODEPORT_ENDPOINTS},
    };
    use std::collections::BTreeSet;
    let mark = 0x4000;
    for counts in [vec![], vec![1], vec![1, 2, 64], (1..=256).collect::<Vec<u32>>()] {
        let set: BTreeSet<u32> = counts.iter().copied().collect();
        for (kind, prefixes) in [
            (IP_ENDPOINTS, &["dnat-ips", "dnat-masquerade-ips"][..]),
            (NODEPORT_ENDPOINTS, &["dnat-nodeports"][..]),
        ] {
            let d = dispatch(kind, &set, mark);
            let maps: Vec<&str> = d.sets.iter().map(|s| s.name.as_str()).collect();
            let want: Vec<String> = counts.iter().map(|n| format!("{kind}-{n}")).collect();
            assert_eq!(maps, want, "{kind} {counts:?}: one map per count");
            assert_eq!(d.chains.len(), counts.len() * prefixes.len(), "{kind} {counts:?}");
            for chain in &d.chains {
                let (prefix, n) = chain.name.rsplit_once('-').expect("a count suffix");
                let n: u32 = n.parse().expect("a count");
                assert!(set.contains(&n) && prefixes.contains(&prefix), "{}", chain.name);
                let map = format!("{kind}-{n}");
                let masquerades = prefix != "dnat-ips";
                let rule = match chain.rules.as_slice() {
                    [rule] => rule.exprs.as_slice(),
                    other => panic!("{}: {other:?}", chain.name),
                };
                match (masquerades, rule) {
                    (true, [ir::Expr::SetMarkOr(m), ir::Expr::DnatDaddrProtoPortSlot(k, reads)])
                    | (true, [ir::Expr::SetMarkOr(m), ir::Expr::DnatProtoPortSlot(k, reads)]) => {
                        assert_eq!((*m, *k, reads), (mark, n, &map), "{}", chain.name);
                    }
                    (false, [ir::Expr::DnatDaddrProtoPortSlot(k, reads)]) => {
                        assert_eq!((*k, reads), (n, &map), "{}", chain.name);
                    }
                    other => panic!("{}: {other:?}", chain.name),
                }
            }
        }
    }
}

/// Every destination served from an endpoint map has exactly one verdict-map element, which goes
/// to the chain of its kind and endpoint count; its slots fill that count's map.
#[test]
fn map_served_destinations_go_to_their_count_chain() {
    let (snap, settings) = dual_scenario();
    for (name, port) in &snap.v4.services {
        let eps = snap.v4.endpoints.get(name).map(Vec::as_slice).unwrap_or_default();
        let frag = render::service(port, eps, &settings);
        let slots: Vec<(&str, u32)> = frag
            .elements
            .iter()
            .filter_map(|(set, e)| e.key.slot().map(|s| (*set, s.count)))
            .collect();
        for (set, e) in &frag.elements {
            let Some(ir::Verdict::Goto(target)) = &e.verdict else {
                continue;
            };
            let Some((prefix, n)) = target.rsplit_once('-') else {
                continue;
            };
            let Ok(n) = n.parse::<u32>() else {
                continue; // a service's own chain
            };
            let (kind, want_set) = match prefix {
                "dnat-ips" | "dnat-masquerade-ips" => (render::sets::IP_ENDPOINTS, render::sets::SERVICE_IPS),
                "dnat-nodeports" => (render::sets::NODEPORT_ENDPOINTS, render::sets::SERVICE_NODEPORTS),
                _ => continue,
            };
            assert_eq!(*set, want_set, "{name}: {e:?}");
            assert!(
                slots.contains(&(kind, n)),
                "{name}: {target} without slots of {kind}-{n}"
            );
        }
        let dispatched = frag
            .elements
            .iter()
            .filter(|(_, e)| matches!(&e.verdict, Some(ir::Verdict::Goto(t)) if t.starts_with("dnat-")))
            .count();
        let destinations: std::collections::BTreeSet<_> = frag
            .elements
            .iter()
            .filter_map(|(_, e)| match &e.key {
                ir::Key::AddrProtoPortSlot(ip, proto, port, _) => Some(format!("{ip}.{proto:?}.{port}")),
                ir::Key::ProtoPortSlot(proto, port, _) => Some(format!("{proto:?}.{port}")),
                _ => None,
            })
            .collect();
        assert_eq!(
            dispatched,
            destinations.len(),
            "{name}: one element per map-served destination"
        );
    }
}

/// A partial sync that changes which endpoint counts are in use rewrites the dispatch to what a
/// full sync would program, through counts that start and stop being used (their maps and
/// chains created, and deleted once nothing refers to them).
#[test]
fn partial_syncs_through_many_endpoint_counts_match_a_full_sync() {
    let (mut snap, settings) = dual_scenario();
    let ns = TestNetns::new("nft-counts");
    let mut backend = NftablesBackend::new(settings.clone());
    let mut stats = Vec::new();
    let dns = snap
        .v4
        .services
        .keys()
        .find(|k| &*k.service.name == "dns")
        .expect("dns")
        .clone();
    let template = snap.v4.endpoints[&dns][0].clone();
    for count in [5usize, 8, 1, 13, 3, 2] {
        let eps: Vec<_> = (0..count)
            .map(|i| {
                let mut e = template.clone();
                e.ip = std::net::IpAddr::from([10, 244, 9, 10 + i as u8]);
                e
            })
            .collect();
        snap.v4.endpoints.insert(dns.clone(), eps);
        let changes = Changes {
            services: [dns.service.clone()].into_iter().collect(),
        };
        let full = stats.is_empty();
        let (result, b) = ns.run({
            let snap = snap.clone();
            move || {
                let r = backend.sync(&snap, &changes, full).map_err(|e| e.to_string());
                (r, backend)
            }
        });
        backend = b;
        stats.push(result.unwrap_or_else(|e| panic!("sync to {count} endpoints: {e}")));
        let what = format!("{count} endpoints");
        assert_like_a_full_sync(&ns, "nft-counts-oracle", &snap, &settings, &what);
        assert_no_drift(&ns, &backend, &format!("{count} endpoints"));
    }
    assert!(stats[1..].iter().all(|s| !s.full), "{stats:?}");
}

/// The pre-DNAT hooks to `firewall-check` exist only while a destination has source ranges: a
/// partial sync adds them with the first such Service and removes them with the last, bypassed
/// or not, and each state lists as a full sync of it does.
#[test]
fn firewall_hooks_come_and_go_with_source_ranges() {
    let (mut snap, settings) = dual_scenario();
    let lb = snap
        .v4
        .services
        .keys()
        .find(|k| &*k.service.name == "lb")
        .expect("lb")
        .clone();
    let ranges = |snap: &mut crate::model::DualSnapshot, on: bool| {
        for (s, range) in [
            (&mut snap.v4, "203.0.113.0/25"),
            (&mut snap.v6, "2001:db8:113::/60"),
        ] {
            let port = s.services.get_mut(&lb).expect("lb port");
            port.load_balancer_source_ranges = if on {
                vec![range.parse().expect("net")]
            } else {
                Vec::new()
            };
        }
    };
    let hooks = |listing: &str| {
        ["filter-prerouting-pre-dnat", "filter-output-pre-dnat"]
            .iter()
            .filter(|c| listing.contains(&format!("chain {c} {{")))
            .count()
    };
    ranges(&mut snap, false);
    let ns = TestNetns::new("nft-fw-hooks");
    let mut backend = NftablesBackend::new(settings.clone());
    // (source ranges on, bypassed, full sync) per step.
    let steps = [
        (false, false, true),
        (true, false, false),
        (false, false, false),
        (true, true, false),
        (false, true, false),
        (true, true, false),
    ];
    for (i, (on, bypassed, full)) in steps.into_iter().enumerate() {
        ranges(&mut snap, on);
        let changes = Changes {
            services: [lb.service.clone()].into_iter().collect(),
        };
        let (result, b) = ns.run({
            let snap = snap.clone();
            move || {
                let r = backend
                    .set_bypass(bypassed)
                    .and_then(|()| backend.sync(&snap, &changes, full))
                    .map_err(|e| e.to_string());
                (r, backend)
            }
        });
        backend = b;
        let stats = result.unwrap_or_else(|e| panic!("step {i}: {e}"));
        assert_eq!(stats.full, full, "step {i}");
        for family in [IpFamily::V4, IpFamily::V6] {
            let listed = list(&ns, family);
            assert_eq!(
                hooks(&listed),
                if on { 2 } else { 0 },
                "step {i} {family:?}:\n{listed}"
            );
            if on {
                let body = &listed[listed.find("chain filter-output-pre-dnat {").expect("hook")..];
                let first = body.lines().nth(2).unwrap_or_default().trim().to_owned();
                assert_eq!(
                    first.starts_with("return"),
                    bypassed,
                    "step {i} {family:?}: first rule {first}"
                );
            }
        }
        if !bypassed {
            assert_like_a_full_sync(&ns, "nft-fw-oracle", &snap, &settings, &format!("step {i}"));
        }
        assert_no_drift(&ns, &backend, &format!("step {i}"));
    }
}
