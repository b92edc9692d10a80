//! The whole product on the real apiserver and kernel: the operator (two replicas, Lease) rolls
//! ProxyPolicies out to real agents on namespace nodes in two pools, while clients keep
//! connecting to a Service from every node.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{NodeProxy, ProxyMode, ProxyPolicy};
use switchyard_e2e::{
    agent::TestEnv,
    kernel,
    netns::Node,
    objects::{Ep, apply_service, apply_slice},
    operator::Operator,
    throughout,
    traffic::{Load, Outcome, probe, start_load, start_server},
};

const WEB: &str = "10.96.0.100";
const LOCAL_ONLY: &str = "10.96.0.111";

fn web() -> SocketAddr {
    SocketAddr::new(WEB.parse().expect("ip"), 80)
}

/// What of ours is in a node's kernel: (nft table present, SWY iptables objects present). A
/// failed listing fails the test: `(false, _)` is only ever a listing that lacks the table.
fn ours(node: &Node) -> (bool, bool) {
    kernel::ours(&node.netns).unwrap_or_else(|e| panic!("{}: kernel listing: {e}", node.name))
}

async fn label_nodes(env: &TestEnv, pools: &[&str]) {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(env.cp.admin_client().await.expect("admin"));
    for (node, pool) in env.cluster.nodes.iter().zip(pools) {
        let patch = json!({"metadata": {"labels": {"pool": pool}}});
        nodes
            .patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("label node");
    }
}

async fn apply_policy(env: &TestEnv, name: &str, spec: Value) {
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": name}, "spec": spec});
    env.cp
        .kubectl_ok(
            &["apply", "--server-side", "--force-conflicts", "-f", "-"],
            Some(&body.to_string()),
        )
        .expect("apply policy");
}

async fn policy(env: &TestEnv, name: &str) -> ProxyPolicy {
    Api::<ProxyPolicy>::all(env.cp.admin_client().await.expect("admin"))
        .get(name)
        .await
        .expect("policy")
}

fn condition(p: &ProxyPolicy, kind: &str) -> Option<(String, String, String)> {
    p.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Waits until `check` holds for the policy (fresh generation observed), at most `limit`.
async fn until(
    env: &TestEnv,
    name: &str,
    limit: Duration,
    what: &str,
    check: impl Fn(&ProxyPolicy) -> bool,
) -> ProxyPolicy {
    let start = Instant::now();
    loop {
        let p = policy(env, name).await;
        let fresh = p.status.as_ref().and_then(|s| s.observed_generation) == p.metadata.generation;
        if fresh && check(&p) {
            return p;
        }
        assert!(
            start.elapsed() < limit,
            "{name}: {what} not reached in {limit:?}; status: {:#?}",
            p.status
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn ready(p: &ProxyPolicy) -> bool {
    condition(p, "Ready").is_some_and(|c| c.0 == "True")
}

async fn active_modes(env: &TestEnv) -> Vec<(String, Option<ProxyMode>)> {
    let proxies: Api<NodeProxy> = Api::all(env.cp.admin_client().await.expect("admin"));
    let mut out = Vec::new();
    for n in &env.cluster.nodes {
        out.push((
            n.name.clone(),
            proxies
                .get(&n.name)
                .await
                .ok()
                .and_then(|np| np.status?.active_mode),
        ));
    }
    out
}

/// Per-node switch seconds as the agents measured them (start to end of the switch).
async fn switch_times(env: &TestEnv, nodes: &[&Node]) -> Vec<String> {
    let proxies: Api<NodeProxy> = Api::all(env.cp.admin_client().await.expect("admin"));
    let mut out = Vec::new();
    for n in nodes {
        let last = proxies
            .get(&n.name)
            .await
            .ok()
            .and_then(|np| np.status?.last_switch);
        let secs = last.and_then(|l| {
            Some((l.finished_at?.0.as_millisecond() - l.started_at?.0.as_millisecond()) as f64 / 1000.0)
        });
        out.push(format!(
            "{} {}",
            n.name,
            secs.map(|s| format!("{s:.1}s")).unwrap_or_else(|| "-".into())
        ));
    }
    out
}

fn failed(outcomes: &[Outcome]) -> usize {
    outcomes.iter().filter(|o| o.server().is_none()).count()
}

/// A control plane with `pools` node labels, echo servers on every node's first pod behind the
/// `web` Service, agents in iptables mode, and two operator replicas.
async fn setup(pools: &[&str]) -> (TestEnv, Vec<switchyard_e2e::traffic::Server>, Vec<Operator>) {
    let mut env = TestEnv::start(pools.len(), 2)
        .await
        .expect("control plane and namespace nodes");
    label_nodes(&env, pools).await;
    let admin = env.cp.admin_client().await.expect("admin");
    let servers: Vec<_> = env
        .cluster
        .nodes
        .iter()
        .map(|n| start_server(&n.pods[0], &[8080], &[]).expect("server"))
        .collect();
    let eps: Vec<Ep> = env
        .cluster
        .nodes
        .iter()
        .map(|n| Ep::ready(n.pods[0].ip, &n.name))
        .collect();
    apply_service(
        &admin,
        "web",
        json!({"clusterIP": WEB, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        None,
    )
    .await
    .expect("web");
    apply_slice(&admin, "web", &[("http", 8080, "TCP")], &eps)
        .await
        .expect("slice");
    env.start_agents(&[
        "--mode",
        "iptables",
        "--cluster-cidr",
        "10.244.0.0/16",
        "--min-sync-period",
        "0.1",
    ])
    .await
    .expect("agents");
    for n in &env.cluster.nodes {
        let start = Instant::now();
        while !probe(&n.pods[1].netns, web(), false, 1, 500)
            .expect("probe")
            .iter()
            .all(|o| o.server().is_some())
        {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{} never served web",
                n.name
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let operators = vec![
        Operator::start(&env.cp, "op-a", &[]).await.expect("operator a"),
        Operator::start(&env.cp, "op-b", &[]).await.expect("operator b"),
    ];
    (env, servers, operators)
}

fn gate(probes: Value) -> Value {
    json!({"minHealthySeconds": 2, "timeoutSeconds": 30, "failureThreshold": 2, "probes": probes})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_moves_to_nftables_in_three_waves_under_load_and_back() {
    let (env, _servers, mut operators) = setup(&["general", "general", "general", "general", "edge"]).await;
    let general: Vec<&Node> = env.cluster.nodes.iter().take(4).collect();
    let loads: Vec<Load> = env
        .cluster
        .nodes
        .iter()
        .map(|n| start_load(&n.pods[1].netns, web(), 100_000, 20).expect("load"))
        .collect();

    // The edge pool asks for IPVS, which this kernel lacks: skipped and reported Incompatible.
    apply_policy(
        &env,
        "edge-ipvs",
        json!({"nodeSelector": {"matchLabels": {"pool": "edge"}}, "mode": "ipvs", "fallback": "skip"}),
    )
    .await;
    let p = until(
        &env,
        "edge-ipvs",
        Duration::from_secs(60),
        "incompatible reported",
        |p| p.status.as_ref().is_some_and(|s| s.incompatible_nodes == 1),
    )
    .await;
    assert_eq!(
        condition(&p, "IPVSDeprecated").map(|c| c.0).as_deref(),
        Some("True")
    );

    // General pool: iptables → nftables in waves of 1, 50 %, rest.
    apply_policy(&env, "general", json!({
        "nodeSelector": {"matchLabels": {"pool": "general"}}, "mode": "nftables",
        "rollout": {"waves": [{"name": "canary", "nodes": 1}, {"name": "half", "nodes": "50%"}, {"name": "rest", "nodes": "100%"}],
                    "maxUnavailable": 1},
        "healthGate": gate(json!([{"namespace": "default", "name": "web"}])),
    })).await;
    let p = until(&env, "general", Duration::from_secs(20), "plan computed", |p| {
        p.status.as_ref().is_some_and(|s| s.waves.len() == 3)
    })
    .await;
    let sizes: Vec<usize> = p
        .status
        .as_ref()
        .map(|s| s.waves.iter().map(|w| w.nodes.len()).collect())
        .unwrap_or_default();
    assert_eq!(sizes, vec![1, 2, 1], "waves of 1, 50 % of 4, rest");

    // The leader dies mid-rollout; the standby continues without re-running finished waves.
    until(&env, "general", Duration::from_secs(60), "canary done", |p| {
        p.status.as_ref().is_some_and(|s| {
            s.waves
                .first()
                .is_some_and(|w| format!("{:?}", w.state) == "Completed")
        })
    })
    .await;
    let leader = env
        .cp
        .kubectl_ok(
            &[
                "get",
                "lease",
                "-n",
                "switchyard-system",
                "switchyard-operator",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ],
            None,
        )
        .expect("lease");
    // The leader must be one of ours, and it is killed: a standby that takes over is the point.
    let leader = leader.trim();
    let identities: Vec<String> = operators.iter().map(|o| o.identity.clone()).collect();
    let op = operators
        .iter_mut()
        .find(|o| o.identity == leader)
        .unwrap_or_else(|| panic!("lease holder {leader:?} is none of the replicas {identities:?}"));
    op.kill();
    assert!(!op.running(), "the leader {leader} was killed");
    let standby = identities
        .iter()
        .find(|i| *i != leader)
        .expect("a standby")
        .clone();
    let p = until(&env, "general", Duration::from_secs(120), "Ready", ready).await;
    let holder = env
        .cp
        .kubectl_ok(
            &[
                "get",
                "lease",
                "-n",
                "switchyard-system",
                "switchyard-operator",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ],
            None,
        )
        .expect("lease");
    assert_eq!(holder.trim(), standby, "the standby finished the rollout");
    let status = p.status.clone().unwrap_or_default();
    assert_eq!(
        (status.target_nodes, status.updated_nodes, status.healthy_nodes),
        (4, 4, 4)
    );
    let times = switch_times(&env, &general).await;
    let modes = active_modes(&env).await;
    for n in &general {
        assert_eq!(
            ours(n),
            (true, false),
            "{}: exactly the nftables ruleset, no SWY leftovers",
            n.name
        );
    }
    assert_eq!(
        modes[4].1,
        Some(ProxyMode::Iptables),
        "the edge node kept its mode"
    );
    let table = env.cp.kubectl_ok(&["get", "proxypolicies"], None).expect("get");
    println!("{table}");
    // Events follow the status write of the same reconcile: allow them a moment.
    let mut events = String::new();
    for _ in 0..100 {
        events = env
            .cp
            .kubectl_ok(
                &[
                    "get",
                    "events",
                    "-A",
                    "-o",
                    "custom-columns=REASON:.reason,OBJECT:.regarding.name",
                ],
                None,
            )
            .unwrap_or_default();
        if events.contains("WaveStarted") && events.matches("WaveCompleted").count() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        events.contains("WaveStarted") && events.matches("WaveCompleted").count() >= 3,
        "{events}"
    );
    let wait = env
        .cp
        .kubectl(
            &[
                "wait",
                "--for=condition=Ready",
                "--timeout=30s",
                "proxypolicy/general",
            ],
            None,
        )
        .expect("kubectl");
    assert!(wait.0, "kubectl wait: {}", wait.2);

    // Reverse: back to iptables.
    apply_policy(&env, "general", json!({
        "nodeSelector": {"matchLabels": {"pool": "general"}}, "mode": "iptables",
        "rollout": {"waves": [{"name": "canary", "nodes": 1}, {"name": "half", "nodes": "50%"}, {"name": "rest", "nodes": "100%"}],
                    "maxUnavailable": 1},
        "healthGate": gate(json!([{"namespace": "default", "name": "web"}])),
    })).await;
    until(
        &env,
        "general",
        Duration::from_secs(120),
        "Ready after the reverse switch",
        ready,
    )
    .await;
    let back_times = switch_times(&env, &general).await;
    for n in &general {
        assert_eq!(
            ours(n),
            (false, true),
            "{}: exactly the iptables ruleset after switching back",
            n.name
        );
    }

    // Fallback instead of skip: the edge node runs nftables.
    apply_policy(
        &env,
        "edge-ipvs",
        json!({"nodeSelector": {"matchLabels": {"pool": "edge"}}, "mode": "ipvs", "fallback": "nftables",
        "healthGate": gate(json!([]))}),
    )
    .await;
    until(
        &env,
        "edge-ipvs",
        Duration::from_secs(60),
        "fallback applied",
        |p| ready(p) && p.status.as_ref().is_some_and(|s| s.updated_nodes == 1),
    )
    .await;
    assert_eq!(active_modes(&env).await[4].1, Some(ProxyMode::Nftables));

    let mut total = 0;
    let mut failures = 0;
    for l in loads {
        let o = l.stop().expect("load");
        total += o.len();
        failures += failed(&o);
    }
    println!("rollout under load: {total} connections from 5 nodes, {failures} failed");
    println!("per-node switch time iptables→nftables: {times:?}; nftables→iptables: {back_times:?}");
    assert_eq!(failures, 0, "connections failed during the rollouts");
    assert!(total > 500, "the load ran: {total}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_pause_or_roll_back_approval_waits_and_conflicts_are_reported() {
    let (env, _servers, _operators) = setup(&["general", "general", "general", "general", "edge"]).await;
    let admin = env.cp.admin_client().await.expect("admin");
    // Reachable only from node-1: internalTrafficPolicy Local with node-1's endpoint. A health gate
    // probing it passes on node-1 and fails on every other node.
    apply_service(
        &admin,
        "local-only",
        json!({"clusterIP": LOCAL_ONLY, "internalTrafficPolicy": "Local",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        None,
    )
    .await
    .expect("svc");
    let n1 = &env.cluster.nodes[0];
    apply_slice(
        &admin,
        "local-only",
        &[("http", 8080, "TCP")],
        &[Ep::ready(n1.pods[0].ip, &n1.name)],
    )
    .await
    .expect("slice");
    let probes = json!([{"namespace": "default", "name": "local-only"}]);
    let canary_on_node1 = json!({"name": "canary", "nodes": 1, "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "node-1"}}});

    // failurePolicy pause: node-1 (canary) passes, wave "rest" fails, the policy stops.
    apply_policy(&env, "general", json!({
        "nodeSelector": {"matchLabels": {"pool": "general"}}, "mode": "nftables",
        "rollout": {"waves": [canary_on_node1, {"name": "second", "nodes": 1}, {"name": "rest", "nodes": "100%"}],
                    "maxUnavailable": 1, "failurePolicy": "pause"},
        "healthGate": gate(probes.clone()),
    })).await;
    let p = until(&env, "general", Duration::from_secs(120), "Degraded", |p| {
        condition(p, "Degraded").is_some_and(|c| c.0 == "True")
    })
    .await;
    let waves: Vec<String> = p
        .status
        .as_ref()
        .map(|s| {
            s.waves
                .iter()
                .map(|w| format!("{}={:?}", w.name, w.state))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        waves,
        vec!["canary=Completed", "second=Failed", "rest=Pending"],
        "{p:#?}"
    );
    // For 3 s, looked at all along: the canary stays, the failed node is back, nothing more starts.
    throughout(Duration::from_secs(3), || async {
        let modes = active_modes(&env).await;
        let iptables = modes
            .iter()
            .filter(|(_, m)| *m == Some(ProxyMode::Iptables))
            .count();
        match (modes[0].1, iptables) {
            (Some(ProxyMode::Nftables), 4) => Ok(()),
            _ => Err(format!(
                "the canary stays switched, the failed node rolled back, later waves never started: {modes:?}"
            )),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for n in &env.cluster.nodes[1..] {
        assert_eq!(
            ours(n),
            (false, true),
            "{}: no nftables leftovers after the rollback",
            n.name
        );
    }

    // failurePolicy rollback: the same failure returns the canary to iptables too.
    apply_policy(&env, "general", json!({
        "nodeSelector": {"matchLabels": {"pool": "general"}}, "mode": "nftables",
        "rollout": {"waves": [canary_on_node1, {"name": "second", "nodes": 1}, {"name": "rest", "nodes": "100%"}],
                    "maxUnavailable": 1, "failurePolicy": "rollback"},
        "healthGate": gate(probes),
    })).await;
    until(&env, "general", Duration::from_secs(180), "rolled back", |p| {
        p.status
            .as_ref()
            .is_some_and(|s| s.waves.iter().any(|w| format!("{:?}", w.state) == "RolledBack"))
    })
    .await;
    let start = Instant::now();
    while active_modes(&env)
        .await
        .iter()
        .any(|(_, m)| *m != Some(ProxyMode::Iptables))
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not every node returned to iptables: {:?}",
            active_modes(&env).await
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for n in &env.cluster.nodes {
        assert_eq!(
            ours(n),
            (false, true),
            "{}: only iptables after the rollback",
            n.name
        );
    }

    // Approval: the canary waits for approval bound to the current generation.
    apply_policy(&env, "general", json!({
        "nodeSelector": {"matchLabels": {"pool": "general"}}, "mode": "nftables",
        "rollout": {"waves": [{"name": "canary", "nodes": 1, "requireApproval": true}, {"name": "rest", "nodes": "100%"}], "maxUnavailable": 2},
        "healthGate": gate(json!([])),
    })).await;
    let p = until(
        &env,
        "general",
        Duration::from_secs(30),
        "awaiting approval",
        |p| {
            p.status
                .as_ref()
                .is_some_and(|s| format!("{:?}", s.phase) == "Some(AwaitingApproval)")
        },
    )
    .await;
    let message = condition(&p, "Paused").map(|c| c.2).unwrap_or_default();
    assert!(
        message.contains("kubectl annotate"),
        "the message says what to do: {message}"
    );
    throughout(Duration::from_secs(3), || async {
        let modes = active_modes(&env).await;
        match modes.iter().all(|(_, m)| *m == Some(ProxyMode::Iptables)) {
            true => Ok(()),
            false => Err(format!("nothing switched before approval: {modes:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let generation = p.metadata.generation.unwrap_or_default();
    env.cp
        .kubectl_ok(
            &[
                "annotate",
                "--overwrite",
                "proxypolicy",
                "general",
                &format!("approve.switchyard.dev/canary={generation}"),
            ],
            None,
        )
        .expect("approve");
    until(
        &env,
        "general",
        Duration::from_secs(120),
        "Ready after approval",
        ready,
    )
    .await;

    // Overlap: a lower-priority policy on the same nodes loses and says so; its mode is not applied.
    apply_policy(
        &env,
        "general-shadow",
        json!({"nodeSelector": {"matchLabels": {"pool": "general"}}, "mode": "iptables", "priority": -5}),
    )
    .await;
    let p = until(&env, "general-shadow", Duration::from_secs(30), "Conflict", |p| {
        condition(p, "Conflict").is_some_and(|c| c.0 == "True")
    })
    .await;
    let message = condition(&p, "Conflict").map(|c| c.2).unwrap_or_default();
    assert!(
        message.contains("general") && message.contains("node-1"),
        "{message}"
    );
    throughout(Duration::from_secs(3), || async {
        let modes = active_modes(&env).await;
        match modes[..4].iter().all(|(_, m)| *m == Some(ProxyMode::Nftables)) {
            true => Ok(()),
            false => Err(format!("only the winner's mode applies: {modes:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}
