//! Conformance with the real kube-proxy (issue 13, item 3): the matrix of `switchyard_e2e::conformance`
//! — every Service semantic of `dataplane.rs` (ClusterIP, NodePort, LoadBalancer and externalIPs;
//! ClientIP affinity (ClusterIP and NodePort); externalTrafficPolicy and internalTrafficPolicy
//! Local, also with only a terminating local endpoint; terminating and not-serving endpoints; no
//! endpoints; loadBalancerSourceRanges; hairpin; dual-stack and an
//! IPv6-only Service; TCP and UDP) seen from pods, nodes and the outside — runs through kube-proxy
//! v1.37.2 and through the agent, in nftables and in iptables mode, and every cell must agree:
//! which endpoints answer, with which source address, refused or dropped, a spread's uniformity, a
//! health check's status.
//!
//! One control plane holds the objects; per mode two twins of namespace nodes (the same names and
//! addresses behind separate fabrics) run side by side, one served by kube-proxy, one by the
//! agent, so both proxies see the same objects at the same time on fresh kernels. Differences we
//! make on purpose are in [`DELIBERATE`] (and README.md, "Conformance with kube-proxy"); cells
//! where we are wrong are in [`KNOWN_BUGS`], printed loudly; a listed cell that agrees fails.
//! `--nocapture` prints the matrix and its cell count.

use std::time::Instant;

use switchyard_e2e::{
    agent::install_switchyard,
    conformance::{
        cell::cells,
        judge::{Difference, Row, Status, judge, render},
        run::{Observed, run_matrix},
        services,
        twin::{Proxy, Twin, register_nodes},
    },
    controlplane::ControlPlane,
    kube_proxy::Mode,
};

/// Where we differ from kube-proxy on purpose.
const DELIBERATE: &[Difference] = &[];

/// Where we are wrong. Each entry is reported loudly; once a fix makes the cell agree the test
/// fails until the entry is removed.
const KNOWN_BUGS: &[Difference] = &[];

/// The modes, in the order they run.
const MODES: [Mode; 2] = [Mode::Nftables, Mode::Iptables("nft")];

/// kube-proxy's verdicts that show the oracle really served: a uniform spread, a refusal and a
/// drop, in every mode and family (a matrix of two dead proxies would otherwise agree).
const ANCHORS: [(&str, &str); 3] = [
    ("web: node-1 pod → ClusterIP:80/tcp", "uniform"),
    ("empty: node-1 pod → ClusterIP:80/tcp", "refused"),
    ("itp: node-1 pod → ClusterIP:80/tcp", "dropped"),
];

async fn observe(cp: &ControlPlane, mode: Mode, objects_applied: &mut bool) -> Vec<Observed> {
    let started = Instant::now();
    let mut twins = [Proxy::KubeProxy, Proxy::Switchyard]
        .map(|p| Twin::create(cp, p).unwrap_or_else(|e| panic!("{} twin: {e}", p.name())));
    if !*objects_applied {
        let admin = cp.admin_client().await.expect("admin client");
        register_nodes(cp, &twins[0].cluster).await.expect("Node objects");
        services::apply_all(&admin, &twins[0].cluster)
            .await
            .expect("Services and slices");
        *objects_applied = true;
    }
    for twin in &mut twins {
        let name = twin.proxy.name();
        twin.start(cp, mode)
            .await
            .unwrap_or_else(|e| panic!("{name} in {} mode: {e}", mode.name()));
    }
    println!(
        "{}: both proxies serve after {:?}",
        mode.name(),
        started.elapsed()
    );
    let clusters = [&twins[0].cluster, &twins[1].cluster];
    let cells = cells();
    let rows = tokio::task::block_in_place(|| run_matrix(&cells, &clusters)).expect("the matrix");
    for twin in &mut twins {
        assert!(
            twin.running(),
            "{} exited during the matrix:\n{}",
            twin.proxy.name(),
            twin.logs()
        );
    }
    println!("{}: {} cells in {:?}", mode.name(), rows.len(), started.elapsed());
    rows
}

fn anchors_hold(rows: &[Row]) {
    for mode in MODES {
        for (cell, shows) in ANCHORS {
            let of_mode: Vec<&Row> = rows
                .iter()
                .filter(|r| r.mode == mode.name() && r.cell == cell)
                .collect();
            assert_eq!(of_mode.len(), 2, "{} {cell}: one row per family", mode.name());
            for r in of_mode {
                assert!(
                    r.kube_proxy.to_string().contains(shows),
                    "{} {cell}: kube-proxy shows {} (expected {shows}): the oracle does not serve",
                    mode.name(),
                    r.kube_proxy
                );
            }
        }
    }
}

fn print_known_bugs(rows: &[Row], statuses: &[Status]) {
    let bugs: Vec<&Row> = rows
        .iter()
        .zip(statuses)
        .filter(|(_, s)| **s == Status::KnownBug)
        .map(|(r, _)| r)
        .collect();
    if bugs.is_empty() {
        return;
    }
    println!(
        "\n!!!!!!!! {} KNOWN BUG CELLS: Switchyard differs from kube-proxy !!!!!!!!",
        bugs.len()
    );
    for r in bugs {
        let reason = KNOWN_BUGS
            .iter()
            .find(|d| d.cell == r.cell)
            .map(|d| d.reason)
            .unwrap_or_default();
        println!(
            "!!! {} {:?} {}\n!!!     kube-proxy: {}\n!!!     switchyard: {}\n!!!     {reason}",
            r.mode, r.family, r.cell, r.kube_proxy, r.ours
        );
    }
    println!("!!!!!!!!\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchyard_agrees_with_kube_proxy_cell_by_cell() {
    let started = Instant::now();
    let cp = ControlPlane::start().await.expect("control plane");
    install_switchyard(&cp).expect("Switchyard's CRDs and RBAC");
    let mut applied = false;
    let mut rows = Vec::new();
    for mode in MODES {
        for o in observe(&cp, mode, &mut applied).await {
            let [kube_proxy, ours]: [_; 2] = o.verdicts.try_into().expect("a verdict per twin");
            rows.push(Row {
                mode: mode.name(),
                family: o.family,
                cell: o.cell,
                kube_proxy,
                ours,
            });
        }
    }
    let (statuses, failures) = judge(&rows, DELIBERATE, KNOWN_BUGS);
    println!(
        "\nthe matrix: mode, family, cell (Service: client → target), = where both proxies agree, then the \
         verdict: \"X ← Y\": endpoint X answered and saw source Y (a pod, a node, a node's cbr0, \
         the fabric); refused; dropped (no answer in {} ms); uniform (a spread); HTTP code\n",
        switchyard_e2e::conformance::run::PILOT_LIMIT_MS
    );
    println!("{}", render(&rows, &statuses));
    let count = |s: &Status| statuses.iter().filter(|x| *x == s).count();
    println!(
        "conformance matrix: {} cells ({} per mode, nftables and iptables, IPv4 and IPv6): {} equal, {} deliberate, {} known bugs, {} failed; {:?}",
        rows.len(),
        rows.len() / MODES.len(),
        count(&Status::Equal),
        count(&Status::Deliberate),
        count(&Status::KnownBug),
        failures.len(),
        started.elapsed()
    );
    print_known_bugs(&rows, &statuses);
    anchors_hold(&rows);
    assert!(
        failures.is_empty(),
        "{} cells differ from kube-proxy:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
