//! The mode advisor on a real apiserver with real agents in iptables mode (issue 14, item 4).
//!
//! 10,000 Services × 2 endpoints are loaded into the apiserver in bulk (as `api-bench` does). Two
//! namespace nodes run the agent in iptables mode (iptables-legacy, as kubelet's marker chains in
//! the node choose): `big` serves every unlabelled Service (10,000 plus `default/kubernetes`);
//! `small` serves only the five Services labelled `service-proxy-name: small-pool`. The real
//! operator governs both with an iptables policy. Shown, and asserted:
//! - `big`'s NodeProxy `status.advice` recommends switching to nftables for its 10,001 service
//!   ports (ManyServices), with the figures it used; `status.measurements` holds the measured sync
//!   window, the counts match the kernel's (`iptables-legacy-save`), the kernel release is the host's;
//! - `small` is told to stay on iptables (WithinLimits) with its own figures;
//! - the ProxyPolicy's `status.advice` (the operator's) counts one node per recommendation;
//! - `kubectl switchyard advise POLICY` prints both nodes' rows, their messages and the same
//!   pool summary (its JSON matches the operator's counts).

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{
    AdviceAction, ModeAdvice, NodeProxy, ProxyMode, ProxyPolicy, SyncMeasurements,
};
use switchyard_e2e::{
    agent::{self, Agent},
    controlplane::ControlPlane,
    eventually,
    netns::Cluster,
    objects::{self, Ep},
    operator::Operator,
    scale::{self, Model},
    tools,
};

const SERVICES: usize = 10_000;
const SMALL_NAME: &str = "small-pool";
const SMALL_SERVICES: usize = 5;
const POLICY: &str = "advisor-pool";
/// Bound of each wait for a status (generous: the machine may be busy).
const LIMIT: Duration = Duration::from_secs(180);

/// kubelet's marker chains in iptables-legacy, as on a node whose kubelet uses legacy: the agent
/// then picks legacy (iptables-nft would need a minute for 10k Services' first restore).
fn play_legacy_kubelet(netns: &str) {
    for tool in ["iptables-legacy", "ip6tables-legacy"] {
        for (table, chain) in [
            ("mangle", "KUBE-IPTABLES-HINT"),
            ("mangle", "KUBE-KUBELET-CANARY"),
        ] {
            scale::sys::in_netns(netns, &[tool, "-w", "5", "-t", table, "-N", chain]).expect("kubelet chain");
        }
    }
}

/// Rules in Switchyard's `SWY-*` chains in both families' legacy tables of the node (the status
/// counts the rules of our chains, not the jumps into them from the built-in chains).
fn kernel_rules(netns: &str) -> usize {
    ["iptables-legacy-save", "ip6tables-legacy-save"]
        .iter()
        .map(|tool| scale::sys::in_netns(netns, &[tool]).expect(tool))
        .map(|text| text.lines().filter(|l| l.starts_with("-A SWY-")).count())
        .sum()
}

/// The five Services only `small` serves, each with one endpoint.
async fn small_services(client: &kube::Client) {
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    for i in 0..SMALL_SERVICES {
        let name = format!("small-{i}");
        let body = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default",
                "labels": {"service.kubernetes.io/service-proxy-name": SMALL_NAME}},
            "spec": {"clusterIP": format!("10.96.250.{}", 10 + i),
                "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}});
        api.patch(&name, &PatchParams::apply("advisor-test"), &Patch::Apply(&body))
            .await
            .expect("small Service");
        let ep = Ep::ready(format!("10.129.0.{}", 10 + i), "remote");
        objects::apply_slice(client, &name, &[("http", 8080, "TCP")], &[ep])
            .await
            .expect("small slice");
    }
}

/// The node's published measurements and advice once `ok` holds for them.
async fn advice_of<F>(nps: &Api<NodeProxy>, node: &str, ok: F) -> (SyncMeasurements, ModeAdvice, NodeProxy)
where
    F: Fn(&SyncMeasurements, &ModeAdvice) -> bool,
{
    let ok = &ok;
    eventually(LIMIT, &format!("{node}: advice"), || async move {
        let np = nps.get(node).await.ok()?;
        let s = np.status.clone()?;
        let (m, a) = (s.measurements?, s.advice?);
        ok(&m, &a).then_some((m, a, np))
    })
    .await
    .unwrap_or_else(|e| {
        let last = futures::executor::block_on(nps.get(node))
            .ok()
            .and_then(|n| n.status);
        panic!(
            "{e}; last status: {:#?}",
            last.map(|s| (s.measurements, s.advice, s.sync))
        )
    })
}

fn start_agent(cp: &ControlPlane, node: &switchyard_e2e::netns::Node, token: &str, extra: &[&str]) -> Agent {
    let mut args = vec!["--mode", "iptables", "--cluster-cidr", scale::CLUSTER_CIDRS];
    args.extend_from_slice(extra);
    Agent::start(cp, node, token, &args).expect("start agent")
}

fn print_status(what: &str, m: &SyncMeasurements, a: &ModeAdvice) {
    println!(
        "{what}: status.measurements = {}\n{what}: status.advice = {}",
        serde_json::to_string_pretty(m).unwrap_or_default(),
        serde_json::to_string_pretty(a).unwrap_or_default()
    );
}

fn reasons(a: &ModeAdvice) -> Vec<&str> {
    a.reasons.iter().map(String::as_str).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_services_in_iptables_mode_are_advised_to_nftables_a_small_node_stays() {
    let t0 = Instant::now();
    let cp = ControlPlane::start().await.expect("control plane");
    agent::install_switchyard(&cp).expect("install Switchyard");
    let client = cp.admin_client().await.expect("client");
    let cluster = Cluster::create(2, 0, cp.port).expect("node namespaces");
    let (big, small) = (&cluster.nodes[0], &cluster.nodes[1]);
    for node in [big, small] {
        agent::create_node(&cp, node).await.expect("Node");
        play_legacy_kubelet(&node.netns);
    }
    println!(
        "control plane and 2 nodes up after {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    // The small node, the operator and the policy need not wait for the load.
    small_services(&client).await;
    let small_token = agent::agent_token(&cp, &small.name).await.expect("token");
    let _small_agent = start_agent(&cp, small, &small_token, &["--service-proxy-name", SMALL_NAME]);
    let _operator = Operator::start(&cp, "operator-a", &[]).await.expect("operator");
    cp.apply_json(
        &json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
        "metadata": {"name": POLICY}, "spec": {"nodeSelector": {}, "mode": "iptables"}}),
    )
    .expect("policy");
    let (model, t_load) = (Model::new(SERVICES, 2), Instant::now());
    scale::bulk_load(&client, &model.services, 32)
        .await
        .expect("load 10k Services and slices");
    println!(
        "{SERVICES} Services × 2 endpoints loaded in {:.1} s (at {:.1} s)",
        t_load.elapsed().as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );

    let big_token = agent::agent_token(&cp, &big.name).await.expect("token");
    let (_big_agent, t_agent) = (start_agent(&cp, big, &big_token, &[]), Instant::now());

    let nps: Api<NodeProxy> = Api::all(client.clone());
    let (m, a, np) = advice_of(&nps, &big.name, |m, _| m.services > SERVICES as i64).await;
    println!(
        "{}: advice {:.1} s after its agent started",
        big.name,
        t_agent.elapsed().as_secs_f64()
    );
    print_status(&big.name, &m, &a);
    assert_eq!(
        (m.mode, a.figures.mode),
        (ProxyMode::Iptables, ProxyMode::Iptables)
    );
    // 10,000 loaded ports plus default/kubernetes.
    assert_eq!(
        (m.services, m.endpoints),
        (SERVICES as i64 + 1, 2 * SERVICES as i64 + 1),
        "{m:?}"
    );
    assert!(m.syncs >= 1 && m.full_syncs >= 1 && m.average_millis > 0, "{m:?}");
    assert!(
        m.average_millis <= m.max_millis && m.p90_millis <= m.max_millis,
        "{m:?}"
    );
    let in_kernel = kernel_rules(&big.netns);
    println!(
        "{}: rules in status {}, rules in the kernel's SWY-* chains {in_kernel}",
        big.name, m.rules
    );
    assert_eq!(m.rules as usize, in_kernel, "the rule count is the kernel's");
    assert_eq!(
        (a.action, a.recommended_mode),
        (AdviceAction::Switch, ProxyMode::Nftables),
        "{}",
        a.message
    );
    assert!(reasons(&a).contains(&"ManyServices"), "{:?}", a.reasons);
    let uname = std::process::Command::new("uname")
        .arg("-r")
        .output()
        .expect("uname");
    let kernel = String::from_utf8_lossy(&uname.stdout).trim().to_owned();
    let caps = np.status.and_then(|s| s.capabilities).expect("capabilities");
    assert_eq!(
        (a.figures.kernel_version.as_str(), a.figures.nftables_usable),
        (kernel.as_str(), caps.nftables.usable)
    );
    assert!(caps.nftables.usable, "this kernel runs nftables: {caps:?}");
    assert_eq!(
        (
            a.figures.services,
            a.figures.endpoints,
            a.figures.rules,
            a.figures.syncs,
            a.figures.sync_average_millis
        ),
        (m.services, m.endpoints, m.rules, m.syncs, m.average_millis),
        "the advice carries the figures it used"
    );
    assert!(
        a.message.contains("10001 service ports") && a.message.contains(&format!("kernel {kernel}")),
        "{}",
        a.message
    );

    let (sm, sa, _) = advice_of(&nps, &small.name, |m, _| m.services == SMALL_SERVICES as i64).await;
    print_status(&small.name, &sm, &sa);
    assert_eq!(
        (sa.action, sa.recommended_mode),
        (AdviceAction::Stay, ProxyMode::Iptables),
        "{}",
        sa.message
    );
    assert_eq!(reasons(&sa)[0], "WithinLimits", "{:?}", sa.reasons);
    assert_eq!(
        (sm.endpoints, sa.figures.services),
        (SMALL_SERVICES as i64, SMALL_SERVICES as i64)
    );

    let policies: Api<ProxyPolicy> = Api::all(client.clone());
    let pool = eventually(LIMIT, "policy status.advice over both nodes", || {
        let policies = policies.clone();
        async move {
            let pool = policies.get(POLICY).await.ok()?.status?.advice?;
            (pool.advised_nodes == 2 && pool.figures.max_services > SERVICES as i64).then_some(pool)
        }
    })
    .await
    .expect("pool advice");
    println!(
        "{POLICY}: status.advice = {}",
        serde_json::to_string_pretty(&pool).unwrap_or_default()
    );
    let counts: Vec<(AdviceAction, ProxyMode, i32)> = pool
        .recommendations
        .iter()
        .map(|r| (r.action, r.mode, r.nodes))
        .collect();
    assert_eq!(
        counts,
        [
            (AdviceAction::Switch, ProxyMode::Nftables, 1),
            (AdviceAction::Stay, ProxyMode::Iptables, 1)
        ]
    );
    assert_eq!(
        (pool.figures.max_services, pool.figures.nodes_without_nftables),
        (SERVICES as i64 + 1, 0)
    );

    let kubeconfig = cp.admin_kubeconfig();
    let (ok, out, err) = tools::plugin(&kubeconfig, &["advise", POLICY]).expect("kubectl-switchyard");
    assert!(ok, "kubectl switchyard advise: {out}{err}");
    println!("$ kubectl switchyard advise {POLICY}\n{out}");
    let row = |node: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(node))
            .unwrap_or_else(|| panic!("no row for {node}:\n{out}"))
            .split_whitespace()
            .collect::<Vec<_>>()
    };
    let big_row = row(&big.name);
    assert_eq!(&big_row[1..3], ["iptables", kernel.as_str()], "{out}");
    assert_eq!(
        &big_row[7..13],
        [
            "10001",
            "20001",
            &in_kernel.to_string(),
            "switch",
            "→",
            "nftables"
        ],
        "{out}"
    );
    assert!(big_row[13].split(',').any(|r| r == "ManyServices"), "{out}");
    let small_row = row(&small.name);
    assert_eq!(
        &small_row[7..12],
        ["5", "5", &sm.rules.to_string(), "stay", "(iptables)"],
        "{out}"
    );
    assert!(
        out.contains(&format!("{}: switch to nftables: ", big.name)),
        "{out}"
    );
    let pool_line = out.lines().find(|l| l.starts_with("Pool: ")).expect("pool line");
    assert!(
        pool_line.starts_with("Pool: 1 switch to nftables (") && pool_line.contains("ManyServices"),
        "{out}"
    );
    assert!(
        pool_line.contains("1 stay on iptables (") && pool_line.contains("10001 service ports"),
        "{out}"
    );

    let (ok, json_out, err) = tools::plugin(&kubeconfig, &["advise", POLICY, "-o", "json"]).expect("json");
    assert!(ok, "{json_out}{err}");
    let report: Value = serde_json::from_str(&json_out).expect("advise JSON");
    let json_counts: Vec<(String, String, i64)> = report["pool"]["recommendations"]
        .as_array()
        .expect("recommendations")
        .iter()
        .map(|r| {
            (
                r["action"].to_string(),
                r["mode"].to_string(),
                r["nodes"].as_i64().unwrap_or(-1),
            )
        })
        .collect();
    let status_counts: Vec<(String, String, i64)> = pool
        .recommendations
        .iter()
        .map(|r| {
            (
                json!(r.action).to_string(),
                json!(r.mode).to_string(),
                i64::from(r.nodes),
            )
        })
        .collect();
    assert_eq!(
        json_counts, status_counts,
        "the plugin sums the nodes as the operator does"
    );
    println!("advisor e2e done in {:.1} s", t0.elapsed().as_secs_f64());
}
