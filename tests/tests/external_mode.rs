//! Mode `external` with the real kube-proxy as the other proxy, under load, on the real apiserver
//! with the real operator and agents in namespace nodes (issue 13, item 2).
//!
//! node-1 (pool `a`) is handed to kube-proxy and taken back; node-2 stays on Switchyard's
//! nftables mode and sends load. The test plays the other proxy's DaemonSet, whose nodeSelector
//! is `switchyard.dev/service-proxy: external`: it starts kube-proxy (nftables mode) on node-1
//! when the operator labels the Node, and stops it when the label goes.
//!
//! 1. Rollback, kube-proxy never starts (the "DaemonSet" is off): the agent waits the gate's
//!    timeout for the other proxy's rules, never bypasses its own, and reports RolledBack;
//!    no connection fails.
//! 2. Rollback, the other proxy's rules appear but serve nothing (an empty `kube-proxy` table):
//!    the agent cuts over, its probes fail, it un-bypasses its rules (RolledBack) and Services
//!    answer again. Connections failing in the bypassed window are printed, not asserted.
//! 3. Hand-over under load: the label appears, kube-proxy starts, the agent bypasses its rules,
//!    the probes pass through kube-proxy, its rules go. No connection fails; nothing of
//!    Switchyard's is left on node-1; `kubectl get nodeproxies` shows `external`.
//! 4. Takeover under load (mode nftables again): the agent programs next to kube-proxy, reports
//!    nftables, the operator removes the label, kube-proxy stops, the agent's takeover removes
//!    kube-proxy's table. No connection fails; no `kube-proxy` table and no KUBE-* chain left.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node as K8sNode;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{NodeProxy, ProxyMode, SwitchPhase};
use switchyard_e2e::{
    agent::{Agent, TestEnv, agent_token},
    controlplane::ControlPlane,
    kernel,
    kube_proxy::{KubeProxy, Mode},
    netns::{Cluster, Node},
    objects::{Ep, apply_service, apply_slice},
    operator::Operator,
    traffic::{Load, Server, probe, start_load, start_server},
};

const WEB: &str = "10.96.0.130";
const NODE_PORT: u16 = 30130;
const CLUSTER_CIDR: &str = "10.244.0.0/16,fd00:10:244::/56";
const LABEL: &str = "switchyard.dev/service-proxy";
/// Attempts per load at most, 20 ms apart; each load is stopped when its phase is over.
const LOAD: u32 = 100_000;
const LIMIT: Duration = Duration::from_secs(150);

fn web() -> SocketAddr {
    SocketAddr::new(WEB.parse::<IpAddr>().expect("ip"), 80)
}

/// The other proxy's DaemonSet, played by the test: kube-proxy runs on the node while the Node
/// carries the label (when `enabled`).
struct DaemonSet {
    enabled: bool,
    pod: Option<KubeProxy>,
    starts: u32,
    /// Logs of kube-proxies that exited on their own.
    exited: Vec<String>,
}

impl DaemonSet {
    async fn reconcile(&mut self, cp: &ControlPlane, client: &Client, node: &Node) {
        let labelled = labelled(client, &node.name).await;
        let running = self.pod.as_mut().is_some_and(KubeProxy::running);
        if let Some(exited) = self.pod.as_ref().filter(|_| !running) {
            self.exited.push(exited.log_text());
        }
        if labelled && self.enabled && !running {
            println!(
                "daemonset: {} labelled {LABEL}=external: starting kube-proxy at {}",
                node.name,
                k8s_openapi::jiff::Timestamp::now()
            );
            self.pod = Some(KubeProxy::start(cp, node, Mode::Nftables, CLUSTER_CIDR).expect("kube-proxy"));
            self.starts += 1;
        } else if !labelled && let Some(mut pod) = self.pod.take() {
            println!("daemonset: {} no longer labelled: stopping kube-proxy", node.name);
            pod.stop();
        }
    }
}

async fn labelled(client: &Client, node: &str) -> bool {
    let n = Api::<K8sNode>::all(client.clone()).get(node).await.expect("node");
    n.metadata
        .labels
        .unwrap_or_default()
        .get(LABEL)
        .map(String::as_str)
        == Some("external")
}

async fn node_proxy(client: &Client, node: &str) -> NodeProxy {
    Api::<NodeProxy>::all(client.clone())
        .get(node)
        .await
        .expect("NodeProxy")
}

fn apply_policy(cp: &ControlPlane, spec: Value) {
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": "hand"}, "spec": spec});
    cp.kubectl_ok(
        &["apply", "--server-side", "--force-conflicts", "-f", "-"],
        Some(&body.to_string()),
    )
    .expect("apply policy");
}

/// Waits, playing the DaemonSet, until node-1's last switch answered a token other than
/// `previous` while its phase is Active; returns the NodeProxy.
async fn switch_answered(
    env: &TestEnv,
    client: &Client,
    ds: &mut DaemonSet,
    previous: Option<String>,
    what: &str,
) -> NodeProxy {
    let node = &env.cluster.nodes[0];
    let start = Instant::now();
    loop {
        ds.reconcile(&env.cp, client, node).await;
        let np = node_proxy(client, &node.name).await;
        let st = np.status.clone().unwrap_or_default();
        let token = st.last_switch.as_ref().and_then(|l| l.rollout_token.clone());
        if token.is_some() && token != previous && st.phase == Some(SwitchPhase::Active) {
            return np;
        }
        assert!(
            start.elapsed() < LIMIT,
            "{what}: not answered in {LIMIT:?}: {:#?}\nagent log:\n{}",
            np.status,
            env.agents[0].log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn last_token(np: &NodeProxy) -> Option<String> {
    np.status.as_ref()?.last_switch.as_ref()?.rollout_token.clone()
}

/// Load on node-1's Service path: a node-1 pod to the ClusterIP, node-2 to node-1's NodePort.
fn start_loads(env: &TestEnv) -> Vec<(String, Load)> {
    let (n1, n2) = (&env.cluster.nodes[0], &env.cluster.nodes[1]);
    println!("loads start at {}", k8s_openapi::jiff::Timestamp::now());
    vec![
        (
            format!("{} pod → ClusterIP", n1.name),
            start_load(&n1.pods[1].netns, web(), LOAD, 20).expect("load"),
        ),
        (
            format!("{} → {} NodePort", n2.name, n1.name),
            start_load(&n2.netns, SocketAddr::new(n1.ip.into(), NODE_PORT), LOAD, 20).expect("load"),
        ),
    ]
}

/// Stops the loads; prints and returns (attempts, failed) per load.
fn stop_loads(direction: &str, loads: Vec<(String, Load)>) -> Vec<(usize, usize)> {
    loads
        .into_iter()
        .map(|(what, load)| {
            let outcomes = load.stop().expect("load outcomes");
            let failed = outcomes.iter().filter(|o| o.server().is_none()).count();
            println!(
                "{direction}: {what}: {} attempts, {failed} failed",
                outcomes.len()
            );
            assert!(!outcomes.is_empty(), "{direction}: {what}: no attempt reported");
            // Which attempts (one every 20 ms from the load's start) failed, and how.
            let first: Vec<String> = outcomes
                .iter()
                .enumerate()
                .filter(|(_, o)| o.server().is_none())
                .take(5)
                .map(|(i, o)| format!("#{i} (~{} ms): {o:?}", i * 20))
                .collect();
            if !first.is_empty() {
                println!("{direction}: {what}: first failures: {first:?}");
            }
            (outcomes.len(), failed)
        })
        .collect()
}

/// `netns`'s TCP conntrack entries to `vip` that were not DNATed (their reply comes from `vip`).
fn unnated_entries(netns: &str, vip: &str) -> Vec<String> {
    let listing = Cluster::exec(netns, &["conntrack", "-L", "-p", "tcp", "--orig-dst", vip])
        .expect("conntrack listing");
    let reply_from_vip = format!("src={vip}");
    listing
        .lines()
        .filter(|l| {
            l.split_whitespace().filter(|w| w.starts_with("src=")).nth(1) == Some(reply_from_vip.as_str())
        })
        .map(str::to_owned)
        .collect()
}

fn assert_no_failures(direction: &str, counts: &[(usize, usize)]) {
    assert!(
        counts.iter().all(|(_, failed)| *failed == 0),
        "{direction}: failed connections: {counts:?}"
    );
}

/// Every connection from a node-1 pod to the ClusterIP answers.
fn services_answer(env: &TestEnv) -> bool {
    probe(&env.cluster.nodes[0].pods[0].netns, web(), false, 5, 1000)
        .is_ok_and(|o| o.iter().all(|o| o.server().is_some()))
}

/// Every `:KUBE-*` chain of `node` ([`kernel::kube_chains`]); the listings must succeed.
fn kube_chains(node: &Node) -> Vec<String> {
    kernel::kube_chains(&node.netns).expect("iptables saves")
}

fn ours(node: &Node) -> (bool, bool) {
    kernel::ours(&node.netns).unwrap_or_else(|e| panic!("{}: kernel listing: {e}", node.name))
}

async fn setup() -> (TestEnv, Client, Operator, Vec<Server>) {
    let mut env = TestEnv::start(2, 2).await.expect("test env");
    let client = env.cp.admin_client().await.expect("client");
    let nodes = env.cluster.nodes.clone();
    let servers: Vec<Server> = nodes
        .iter()
        .flat_map(|n| n.pods.iter())
        .map(|p| start_server(p, &[8080], &[]).expect("server"))
        .collect();
    apply_service(
        &client,
        "web",
        json!({"type": "NodePort", "clusterIP": WEB, "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": NODE_PORT, "protocol": "TCP"}]}),
        None,
    )
    .await
    .expect("service");
    let eps: Vec<Ep> = nodes
        .iter()
        .flat_map(|n| n.pods.iter().map(move |p| Ep::ready(p.ip, &n.name)))
        .collect();
    apply_slice(&client, "web", &[("http", 8080, "TCP")], &eps)
        .await
        .expect("slice");
    // kube-proxy binds 10256 and 10249 on the node's loopback: the agents use other ports.
    let args = [
        "--mode",
        "nftables",
        "--cluster-cidr",
        CLUSTER_CIDR,
        "--min-sync-period",
        "0.1",
        "--healthz-bind-address",
        "0.0.0.0:10356",
        "--metrics-bind-address",
        "0.0.0.0:10349",
    ];
    for node in &nodes {
        let token = agent_token(&env.cp, &node.name).await.expect("token");
        env.agents
            .push(Agent::start(&env.cp, node, &token, &args).expect("agent"));
    }
    let nodes_api: Api<K8sNode> = Api::all(client.clone());
    nodes_api
        .patch(
            &nodes[0].name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": {"pool": "a"}}})),
        )
        .await
        .expect("label node");
    let op = Operator::start(&env.cp, "op-1", &[]).await.expect("operator");
    switchyard_e2e::eventually(LIMIT, "agents serve", || async {
        for n in &env.cluster.nodes {
            let np = Api::<NodeProxy>::all(client.clone()).get(&n.name).await.ok()?;
            (np.status?.active_mode == Some(ProxyMode::Nftables)).then_some(())?;
        }
        services_answer(&env).then_some(())
    })
    .await
    .expect("agents serve");
    (env, client, op, servers)
}

fn policy(timeout: u32, failure_threshold: u32, mode: &str) -> Value {
    json!({
        "nodeSelector": {"matchLabels": {"pool": "a"}},
        "mode": mode,
        "healthGate": {
            "probes": [{"namespace": "default", "name": "web"}],
            "minHealthySeconds": 3, "timeoutSeconds": timeout, "failureThreshold": failure_threshold,
        },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_mode_hands_over_to_kube_proxy_and_takes_back_under_load() {
    let (env, client, op, _servers) = setup().await;
    let n1 = env.cluster.nodes[0].clone();
    let mut ds = DaemonSet {
        enabled: false,
        pod: None,
        starts: 0,
        exited: Vec::new(),
    };

    // 1. kube-proxy never starts: the wait times out, nothing was bypassed.
    let loads = start_loads(&env);
    apply_policy(&env.cp, policy(12, 3, "external"));
    let np = switch_answered(&env, &client, &mut ds, None, "rollback without kube-proxy").await;
    let last = np
        .status
        .as_ref()
        .and_then(|s| s.last_switch.clone())
        .expect("last switch");
    println!(
        "rollback, no other proxy: {} ({})",
        last.result,
        last.reason.clone().unwrap_or_default()
    );
    assert_eq!(last.result, "RolledBack");
    assert!(
        last.reason
            .as_deref()
            .unwrap_or_default()
            .contains("no other service proxy appeared"),
        "{last:?}"
    );
    assert_eq!(
        np.status.as_ref().and_then(|s| s.active_mode),
        Some(ProxyMode::Nftables)
    );
    assert!(
        labelled(&client, &n1.name).await,
        "the label stays while external is asked for"
    );
    assert_eq!(ours(&n1), (true, false), "our rules serve");
    assert!(services_answer(&env));
    assert_no_failures(
        "rollback, no other proxy",
        &stop_loads("rollback, no other proxy", loads),
    );

    // 2. The other proxy's rules appear but serve nothing: probes fail, ours come back.
    Cluster::exec(&n1.netns, &["nft", "add table ip kube-proxy"]).expect("empty kube-proxy table");
    let loads = start_loads(&env);
    apply_policy(&env.cp, policy(30, 2, "external"));
    let np = switch_answered(
        &env,
        &client,
        &mut ds,
        last_token(&np),
        "rollback on failing probes",
    )
    .await;
    let last = np
        .status
        .as_ref()
        .and_then(|s| s.last_switch.clone())
        .expect("last switch");
    println!(
        "rollback, failing probes: {} ({})",
        last.result,
        last.reason.clone().unwrap_or_default()
    );
    assert_eq!(last.result, "RolledBack");
    assert!(
        last.reason
            .as_deref()
            .unwrap_or_default()
            .contains("consecutive probe rounds"),
        "{last:?}"
    );
    assert_eq!(
        np.status.as_ref().and_then(|s| s.active_mode),
        Some(ProxyMode::Nftables)
    );
    assert_eq!(ours(&n1), (true, false), "our rules are back");
    assert!(services_answer(&env), "Services answer again after the rollback");
    // Connections opened while ours were bypassed had nothing to serve them: counted, not zero.
    let counts = stop_loads("rollback, failing probes", loads);
    assert!(counts.iter().all(|(attempts, _)| *attempts > 0));
    // Those connections left conntrack entries without NAT (unreplied, kept up to 120 s): the
    // rollback deleted them, or a later connection from the same port would skip the nat hooks
    // and be rejected as traffic to a ClusterIP port that is no Service.
    let unnated = unnated_entries(&n1.netns, WEB);
    assert!(
        unnated.is_empty(),
        "entries to {WEB} without NAT after the rollback: {unnated:?}"
    );
    Cluster::exec(&n1.netns, &["nft", "delete table ip kube-proxy"]).expect("remove the empty table");

    // Back to nftables (no switch: node-1 runs it): nobody asks for external, the label goes.
    // (A new generation re-plans a failed node from Pending; starting from here keeps the label
    // from going away and coming back while the DaemonSet is on.)
    apply_policy(&env.cp, policy(120, 3, "nftables"));
    let wait = Instant::now();
    while labelled(&client, &n1.name).await {
        assert!(
            wait.elapsed() < LIMIT,
            "the label stays without a request for external"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // 3. Hand-over to the real kube-proxy under load.
    // The loads span the switch: from the request reaching the node (the operator labels it in
    // the same reconcile that asks for external; nothing switches before) to its end.
    ds.enabled = true;
    apply_policy(&env.cp, policy(120, 3, "external"));
    let wait = Instant::now();
    while !labelled(&client, &n1.name).await {
        assert!(wait.elapsed() < LIMIT, "node-1 not labelled for the hand-over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let loads = start_loads(&env);
    let started = Instant::now();
    let np = switch_answered(&env, &client, &mut ds, last_token(&np), "hand-over").await;
    println!(
        "hand-over: answered ~{} ms after the loads started; agent log:\n{}",
        started.elapsed().as_millis(),
        env.agents[0]
            .log_text()
            .lines()
            .filter(|l| l.contains("switch:") || l.contains("took over"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let last = np
        .status
        .as_ref()
        .and_then(|s| s.last_switch.clone())
        .expect("last switch");
    assert_eq!(last.result, "Succeeded", "{last:?}\n{}", env.agents[0].log_text());
    assert_eq!(
        np.status.as_ref().and_then(|s| s.active_mode),
        Some(ProxyMode::External)
    );
    println!("hand-over: {} in {:?}", last.result, started.elapsed());
    assert!(
        ds.pod.as_mut().is_some_and(KubeProxy::running),
        "kube-proxy serves"
    );
    assert_eq!(ds.starts, 1, "kube-proxy exited: {:?}", ds.exited);
    assert_eq!(
        ours(&n1),
        (false, false),
        "no Switchyard objects left after the hand-over"
    );
    assert!(
        kernel::nft_tables(&n1.netns)
            .expect("tables")
            .contains("table ip kube-proxy")
    );
    let listing = env
        .cp
        .kubectl_ok(&["get", "nodeproxies"], None)
        .expect("kubectl get");
    println!("kubectl get nodeproxies:\n{listing}");
    let row = listing
        .lines()
        .find(|l| l.starts_with(&n1.name))
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>();
    assert_eq!(
        row.get(1..4),
        Some(&["external", "external", "Active"][..]),
        "{listing}"
    );
    // More attempts through kube-proxy before the load stops.
    assert!(services_answer(&env));
    let counts = stop_loads("hand-over", loads);
    if counts.iter().any(|c| c.1 > 0) {
        println!("AGENT LOG node-1:\n{}", env.agents[0].log_text());
        println!(
            "KUBE-PROXY LOG:\n{}",
            ds.pod.as_ref().map(KubeProxy::log_text).unwrap_or_default()
        );
    }
    assert_no_failures("hand-over", &counts);

    // 4. Takeover under load: nftables again.
    let loads = start_loads(&env);
    let started = Instant::now();
    apply_policy(&env.cp, policy(120, 3, "nftables"));
    let np = switch_answered(&env, &client, &mut ds, last_token(&np), "takeover").await;
    let last = np
        .status
        .as_ref()
        .and_then(|s| s.last_switch.clone())
        .expect("last switch");
    assert_eq!(last.result, "Succeeded", "{last:?}\n{}", env.agents[0].log_text());
    // The operator removes the label once nftables is active, the DaemonSet stops kube-proxy,
    // the agent's takeover removes what kube-proxy left.
    let wait = Instant::now();
    loop {
        ds.reconcile(&env.cp, &client, &n1).await;
        let gone = !labelled(&client, &n1.name).await
            && ds.pod.is_none()
            && !kernel::nft_tables(&n1.netns)
                .expect("tables")
                .contains("kube-proxy")
            && kube_chains(&n1).is_empty();
        if gone {
            break;
        }
        assert!(
            wait.elapsed() < LIMIT,
            "takeover: label {}, tables {:?}, chains {:?}\nagent log:\n{}\noperator log:\n{}",
            labelled(&client, &n1.name).await,
            kernel::nft_tables(&n1.netns),
            kube_chains(&n1),
            env.agents[0].log_text(),
            op.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("takeover: {} in {:?}", last.result, started.elapsed());
    assert_eq!(ours(&n1), (true, false), "ours serve alone");
    assert!(services_answer(&env));
    let counts = stop_loads("takeover", loads);
    if counts.iter().any(|c| c.1 > 0) {
        println!("AGENT LOG node-1:\n{}", env.agents[0].log_text());
    }
    assert_no_failures("takeover", &counts);
    let listing = env
        .cp
        .kubectl_ok(&["get", "nodeproxies"], None)
        .expect("kubectl get");
    println!("kubectl get nodeproxies:\n{listing}");
}
