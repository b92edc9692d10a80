//! The operator on a real kube-apiserver, with its real RBAC identity, two replicas and Lease
//! leader election. The test plays the node agents: it writes NodeProxy status exactly as the agent
//! protocol says (see `switchyard_operator`'s crate docs), so every rollout gate can be driven and
//! observed: dry run, waves, approval, failure with pause and with rollback, conflicts,
//! incompatible nodes and fallback, printer columns, `kubectl wait`, Events, and a leader killed
//! mid-rollout.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use k8s_openapi::api::{coordination::v1::Lease, core::v1::Node, events::v1::Event};
use kube::{
    Api, Client,
    api::{ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{NodeProxy, PolicyPhase, ProxyMode, ProxyPolicy, WaveState};
use switchyard_e2e::{
    agent::{SYSTEM_NAMESPACE, TestEnv},
    eventually,
    operator::Operator,
    throughout,
};

const LIMIT: Duration = Duration::from_secs(60);

/// Labels every node and registers an "agent" status on each: iptables active, given modes.
async fn setup_nodes(client: &Client, labels: &[(&str, &str)], supported: &[&str]) {
    let nodes: Api<Node> = Api::all(client.clone());
    let proxies: Api<NodeProxy> = Api::all(client.clone());
    for (node, pool) in labels {
        nodes
            .patch(
                node,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"pool": pool}}})),
            )
            .await
            .expect("label node");
        let uid = nodes.get(node).await.expect("node").metadata.uid.expect("uid");
        let np: NodeProxy = serde_json::from_value(json!({
            "apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy",
            "metadata": {"name": node, "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}]},
            "spec": {},
        }))
        .expect("nodeproxy");
        proxies
            .create(&PostParams::default(), &np)
            .await
            .expect("create NodeProxy as the agent would");
        write_status(&proxies, node, agent_status("iptables", supported, None)).await;
    }
}

fn agent_status(active: &str, supported: &[&str], last: Option<Value>) -> Value {
    let mut s = json!({
        "capabilities": {
            "kernelVersion": "6.18.0-test", "supportedModes": supported,
            "nftables": {"usable": true}, "iptablesLegacy": {"usable": true}, "iptablesNft": {"usable": true},
            "ipvs": {"usable": supported.contains(&"ipvs")}, "ipset": {"usable": true},
        },
        "activeMode": active,
        "phase": "Active",
        "conditions": [{"type": "Healthy", "status": "True", "reason": "GatePassed", "message": "ok", "lastTransitionTime": "2025-01-01T00:00:00Z"}],
    });
    if let Some(l) = last {
        s["lastSwitch"] = l;
    }
    s
}

async fn write_status(proxies: &Api<NodeProxy>, node: &str, status: Value) {
    switchyard_e2e::agent::write_agent_status(&proxies.clone().into_client(), node, status)
        .await
        .expect("agent status");
}

/// Plays every agent once: a node whose spec asks for a mode it does not run under a token it has
/// not answered switches (or, in `failing`, fails its health gate and rolls back). Returns the
/// nodes that acted.
async fn play_agents(proxies: &Api<NodeProxy>, failing: &BTreeSet<String>) -> Vec<String> {
    let mut acted = Vec::new();
    for np in proxies.list(&ListParams::default()).await.expect("list").items {
        let name = np.metadata.name.clone().unwrap_or_default();
        let (Some(desired), Some(token)) = (np.spec.desired_mode, np.spec.rollout_token.clone()) else {
            continue;
        };
        let Some(st) = np.status.clone() else { continue };
        let answered = st.last_switch.as_ref().and_then(|l| l.rollout_token.clone()) == Some(token.clone());
        if answered || st.active_mode == Some(desired) {
            continue;
        }
        let from = st.active_mode.map(|m| m.as_str()).unwrap_or("iptables");
        let supported: Vec<&str> = st
            .capabilities
            .as_ref()
            .map(|c| c.supported_modes.iter().map(|m| m.as_str()).collect())
            .unwrap_or_default();
        let fail = failing.contains(&name) && !token.contains("-rollback-");
        let active = if fail { from } else { desired.as_str() };
        let last = json!({
            "from": from, "to": desired.as_str(), "result": if fail { "RolledBack" } else { "Succeeded" },
            "reason": if fail { "health gate: probe default/kubernetes: no endpoint answered" } else { "switched" },
            "rolloutToken": token, "startedAt": "2025-01-01T00:00:00Z", "finishedAt": "2025-01-01T00:00:01Z",
        });
        write_status(proxies, &name, agent_status(active, &supported, Some(last))).await;
        acted.push(name);
    }
    acted
}

async fn policy_status(
    policies: &Api<ProxyPolicy>,
    name: &str,
) -> Option<switchyard_crds::v1alpha1::ProxyPolicyStatus> {
    policies.get(name).await.ok().and_then(|p| p.status)
}

fn condition<'a>(
    s: &'a switchyard_crds::v1alpha1::ProxyPolicyStatus,
    t: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    s.conditions.iter().find(|c| c.type_ == t)
}

async fn wait_status<F>(
    policies: &Api<ProxyPolicy>,
    name: &str,
    what: &str,
    ok: F,
) -> switchyard_crds::v1alpha1::ProxyPolicyStatus
where
    F: Fn(&switchyard_crds::v1alpha1::ProxyPolicyStatus) -> bool,
{
    let ok = &ok;
    eventually(LIMIT, what, || async move {
        policy_status(policies, name).await.filter(|s| ok(s))
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}; last status: {:#?}",
            futures::executor::block_on(policy_status(policies, name))
        )
    })
}

/// Plays agents until `ok` holds for the policy's status.
async fn drive<F>(
    proxies: &Api<NodeProxy>,
    policies: &Api<ProxyPolicy>,
    name: &str,
    failing: &BTreeSet<String>,
    what: &str,
    ok: F,
) -> switchyard_crds::v1alpha1::ProxyPolicyStatus
where
    F: Fn(&switchyard_crds::v1alpha1::ProxyPolicyStatus) -> bool,
{
    let ok = &ok;
    eventually(LIMIT, what, || async move {
        play_agents(proxies, failing).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        policy_status(policies, name).await.filter(|s| ok(s))
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}; last status: {:#?}",
            futures::executor::block_on(policy_status(policies, name))
        )
    })
}

async fn modes(
    proxies: &Api<NodeProxy>,
) -> BTreeMap<String, (Option<ProxyMode>, Option<ProxyMode>, Option<String>)> {
    proxies
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
        .into_iter()
        .map(|np| {
            (
                np.metadata.name.clone().unwrap_or_default(),
                (
                    np.spec.desired_mode,
                    np.status.and_then(|s| s.active_mode),
                    np.spec.rollout_token,
                ),
            )
        })
        .collect()
}

async fn events(client: &Client, policy: &str) -> Vec<(String, String)> {
    let api: Api<Event> = Api::all(client.clone());
    let mut out: Vec<(String, String)> = api
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(policy))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect();
    out.sort();
    out
}

/// Events are published after the status write of the same reconcile: poll until `check` holds
/// (at most 20 s) and return the events either way, so the caller's assertion reports them.
async fn events_when(
    client: &Client,
    policy: &str,
    check: impl Fn(&[(String, String)]) -> bool,
) -> Vec<(String, String)> {
    let start = std::time::Instant::now();
    loop {
        let evs = events(client, policy).await;
        if check(&evs) || start.elapsed() > Duration::from_secs(20) {
            return evs;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn lease_holder(client: &Client) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    leases
        .get("switchyard-operator")
        .await
        .ok()?
        .spec?
        .holder_identity
}

fn apply_policy(cp: &switchyard_e2e::controlplane::ControlPlane, yaml: &str) {
    cp.kubectl_ok(&["apply", "-f", "-"], Some(yaml))
        .expect("kubectl apply policy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waves_approval_and_leader_failover() {
    let env = TestEnv::start(6, 0).await.expect("control plane and 6 nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let names: Vec<String> = env.cluster.nodes.iter().map(|n| n.name.clone()).collect();
    setup_nodes(
        &admin,
        &names.iter().map(|n| (n.as_str(), "a")).collect::<Vec<_>>(),
        &["iptables", "nftables"],
    )
    .await;
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    let policies: Api<ProxyPolicy> = Api::all(admin.clone());
    let mut a = Operator::start(&env.cp, "op-a", &[]).await.expect("operator a");
    let holder = eventually(LIMIT, "a leader", || lease_holder(&admin))
        .await
        .expect("leader elected");
    assert_eq!(holder, "op-a");
    let b = Operator::start(&env.cp, "op-b", &[]).await.expect("operator b");
    eventually(LIMIT, "healthz of both", || async {
        (a.get("/healthz").map(|r| r.0) == Some(200) && b.get("/healthz").map(|r| r.0) == Some(200))
            .then_some(())
    })
    .await
    .expect("both replicas healthy");
    assert!(
        b.get("/healthz")
            .is_some_and(|(_, body)| body.contains("standby")),
        "{:?}",
        b.get("/healthz")
    );

    // 1. Dry run: paused, the plan is shown, nothing switches.
    apply_policy(
        &env.cp,
        r#"apiVersion: switchyard.dev/v1alpha1
kind: ProxyPolicy
metadata:
  name: pool-a
spec:
  nodeSelector: {matchLabels: {pool: a}}
  mode: nftables
  rollout:
    paused: true
    waves:
    - {name: canary, nodes: 1}
    - {name: half, nodes: 50%, requireApproval: true}
    - {name: rest, nodes: 100%}
"#,
    );
    let s = wait_status(&policies, "pool-a", "dry-run plan", |s| {
        s.phase == Some(PolicyPhase::Paused) && s.waves.len() == 3
    })
    .await;
    assert_eq!(
        s.waves.iter().map(|w| w.nodes.len()).collect::<Vec<_>>(),
        [1, 3, 2],
        "{s:#?}"
    );
    assert_eq!((s.target_nodes, s.updated_nodes), (6, 0));
    let paused = condition(&s, "Paused").expect("Paused");
    assert!(
        paused.status == "True" && paused.message.contains("dry run"),
        "{paused:?}"
    );
    throughout(Duration::from_secs(2), || async {
        let m = modes(&proxies).await;
        match m.values().all(|(d, _, _)| d.is_none()) {
            true => Ok(()),
            false => Err(format!("paused: nothing asked to switch: {m:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let canary = s.waves[0].nodes[0].clone();
    let half: Vec<String> = s.waves[1].nodes.clone();
    let table = env
        .cp
        .kubectl_ok(&["get", "proxypolicies"], None)
        .expect("get proxypolicies");
    println!("{table}");
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME", "MODE", "NODES", "UPDATED", "HEALTHY", "WAVE", "STATUS", "AGE"
        ],
        "{table}"
    );
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[..7],
        ["pool-a", "nftables", "6", "0", "0", "canary", "Paused"],
        "{table}"
    );

    // 2. Start: the canary switches, then the half wave waits for approval of generation 2.
    env.cp
        .kubectl_ok(
            &[
                "patch",
                "proxypolicy",
                "pool-a",
                "--type",
                "merge",
                "-p",
                r#"{"spec":{"rollout":{"paused":false}}}"#,
            ],
            None,
        )
        .expect("unpause");
    let none = BTreeSet::new();
    let s = drive(
        &proxies,
        &policies,
        "pool-a",
        &none,
        "canary done, half awaiting approval",
        |s| s.phase == Some(PolicyPhase::AwaitingApproval),
    )
    .await;
    assert_eq!(s.waves[0].state, WaveState::Completed);
    let msg = &condition(&s, "Paused").expect("Paused").message;
    assert!(msg.contains("wave half waits for approval: kubectl annotate --overwrite proxypolicy pool-a approve.switchyard.dev/half=2"), "{msg}");
    let m = modes(&proxies).await;
    assert_eq!(m[&canary].1, Some(ProxyMode::Nftables));
    assert_eq!(
        m.values().filter(|v| v.1 == Some(ProxyMode::Nftables)).count(),
        1,
        "{m:?}"
    );
    let canary_token = m[&canary].2.clone();
    // A stale approval (generation 1) does not count.
    env.cp
        .kubectl_ok(
            &[
                "annotate",
                "--overwrite",
                "proxypolicy",
                "pool-a",
                "approve.switchyard.dev/half=1",
            ],
            None,
        )
        .expect("annotate");
    // The operator has seen the stale approval once it says so; it still waits.
    let s = wait_status(&policies, "pool-a", "stale approval reported", |s| {
        condition(s, "Paused").is_some_and(|c| c.message.contains("not for generation 2"))
    })
    .await;
    assert_eq!(s.phase, Some(PolicyPhase::AwaitingApproval), "{s:#?}");
    play_agents(&proxies, &none).await;
    let s = policy_status(&policies, "pool-a").await.expect("status");
    assert_eq!(s.phase, Some(PolicyPhase::AwaitingApproval), "{s:#?}");
    env.cp
        .kubectl_ok(
            &[
                "annotate",
                "--overwrite",
                "proxypolicy",
                "pool-a",
                "approve.switchyard.dev/half=2",
            ],
            None,
        )
        .expect("approve");

    // 3. Half wave: one node switches at a time (maxUnavailable 1). After the first one, kill the leader.
    let s = drive(
        &proxies,
        &policies,
        "pool-a",
        &none,
        "first half node healthy",
        |s| s.waves[1].healthy >= 1,
    )
    .await;
    assert_eq!(s.waves[1].state, WaveState::Progressing);
    let switching = modes(&proxies)
        .await
        .values()
        .filter(|(d, a, _)| d.is_some() && d != a)
        .count();
    assert!(switching <= 1, "maxUnavailable 1");
    let leader = lease_holder(&admin).await.expect("holder");
    assert_eq!(leader, "op-a");
    a.kill();
    assert!(!a.running());
    let new_leader = eventually(Duration::from_secs(30), "op-b takes over", || async {
        lease_holder(&admin).await.filter(|h| h == "op-b")
    })
    .await;
    new_leader.unwrap_or_else(|e| panic!("{e}; op-b log:\n{}", b.log_text()));
    let s = drive(
        &proxies,
        &policies,
        "pool-a",
        &none,
        "rollout complete under op-b",
        |s| s.phase == Some(PolicyPhase::Ready),
    )
    .await;
    assert_eq!(
        (s.target_nodes, s.updated_nodes, s.healthy_nodes, s.failed_nodes),
        (6, 6, 6, 0)
    );
    assert!(s.waves.iter().all(|w| w.state == WaveState::Completed));
    assert_eq!(s.waves[1].nodes, half, "the plan did not change across leaders");
    let m = modes(&proxies).await;
    assert!(m.values().all(|v| v.1 == Some(ProxyMode::Nftables)), "{m:?}");
    assert_eq!(m[&canary].2, canary_token, "the canary was not asked again");
    // The logs are read without colours (NO_COLOR, and escapes stripped): `node=X desired=` is
    // the text of op-b's "applied NodeProxy spec" lines. The pattern matches for every node op-b
    // did write (the last wave's), so its absence for the canary means something.
    let log = b.log_text();
    assert!(log.contains("became leader"), "op-b log:\n{log}");
    for node in &s.waves[2].nodes {
        assert!(
            log.contains(&format!("node={node} desired=")),
            "op-b wrote {node} (wave rest) and logged it:\n{log}"
        );
    }
    assert!(
        !log.contains(&format!("node={canary} desired=")),
        "op-b never re-wrote the finished canary:\n{log}"
    );

    // 4. kubectl wait, printer columns, Events, /metrics.
    env.cp
        .kubectl_ok(
            &[
                "wait",
                "--for=condition=Ready",
                "--timeout=30s",
                "proxypolicy/pool-a",
            ],
            None,
        )
        .expect("kubectl wait Ready");
    let table = env.cp.kubectl_ok(&["get", "proxypolicies"], None).expect("get");
    println!("{table}");
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[..6],
        ["pool-a", "nftables", "6", "6", "6", "Ready"],
        "no current wave: {table}"
    );
    let evs = events_when(&admin, "pool-a", |e| {
        e.iter().filter(|(r, _)| r == "WaveCompleted").count() >= 3
    })
    .await;
    println!("{evs:#?}");
    let count = |reason: &str, text: &str| {
        evs.iter()
            .filter(|(r, n)| r == reason && n.contains(text))
            .count()
    };
    assert_eq!(count("WaveStarted", "wave canary"), 1, "{evs:?}");
    assert_eq!(count("WaveStarted", "wave half"), 1, "{evs:?}");
    assert_eq!(count("WaveStarted", "wave rest"), 1, "{evs:?}");
    assert_eq!(count("WaveCompleted", "wave "), 3, "{evs:?}");
    assert!(
        count("Paused", "") >= 2,
        "paused (dry run) and awaiting approval: {evs:?}"
    );
    let (code, metrics) = b.get("/metrics").expect("metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("switchyard_operator_leader 1")
            && metrics.contains("switchyard_operator_reconciles_total"),
        "{metrics}"
    );
    assert!(
        b.get("/healthz")
            .is_some_and(|(c, body)| c == 200 && body.contains("leader"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failures_conflicts_and_compatibility() {
    let env = TestEnv::start(5, 0).await.expect("control plane and 5 nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let n: Vec<String> = env.cluster.nodes.iter().map(|n| n.name.clone()).collect();
    setup_nodes(
        &admin,
        &[
            (&n[0], "b"),
            (&n[1], "b"),
            (&n[2], "b"),
            (&n[3], "c"),
            (&n[4], "c"),
        ],
        &["iptables", "nftables"],
    )
    .await;
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    let policies: Api<ProxyPolicy> = Api::all(admin.clone());
    let _op = Operator::start(&env.cp, "op-1", &[]).await.expect("operator");

    // Overlap: b-low (priority 0, iptables) and b-high (priority 10, nftables) both select pool b.
    // b-high is written first, so b-low is never planned without it (the operator plans a policy
    // only from a cache that holds the policy's own version, and so everything written before it).
    apply_policy(
        &env.cp,
        r#"apiVersion: switchyard.dev/v1alpha1
kind: ProxyPolicy
metadata: {name: b-high}
spec:
  nodeSelector: {matchLabels: {pool: b}}
  priority: 10
  mode: nftables
  rollout:
    paused: true
    failurePolicy: pause
    waves: [{name: canary, nodes: 1}, {name: rest, nodes: 100%}]
---
apiVersion: switchyard.dev/v1alpha1
kind: ProxyPolicy
metadata: {name: b-low}
spec:
  nodeSelector: {matchExpressions: [{key: pool, operator: In, values: [b]}]}
  mode: iptables
"#,
    );
    let low = wait_status(&policies, "b-low", "conflict on b-low", |s| {
        condition(s, "Conflict").is_some_and(|c| c.status == "True")
    })
    .await;
    let msg = &condition(&low, "Conflict").expect("Conflict").message;
    assert!(
        msg.contains(&format!(
            "node(s) {}, {}, {} are governed by proxypolicy b-high (priority 10 vs 0)",
            n[0], n[1], n[2]
        )),
        "{msg}"
    );
    assert_eq!(low.target_nodes, 0);
    let high = wait_status(&policies, "b-high", "b-high plan", |s| {
        s.waves.len() == 2 && s.target_nodes == 3
    })
    .await;
    assert_eq!(
        condition(&high, "Conflict").map(|c| c.status.as_str()),
        Some("False")
    );
    let evs = events_when(&admin, "b-low", |e| e.iter().any(|(r, _)| r == "Conflict")).await;
    assert!(evs.iter().any(|(r, _)| r == "Conflict"), "{evs:?}");
    let canary = high.waves[0].nodes[0].clone();

    // The canary fails its health gate: with failurePolicy pause the policy stops, the rest never starts.
    let failing: BTreeSet<String> = [canary.clone()].into();
    env.cp
        .kubectl_ok(
            &[
                "patch",
                "proxypolicy",
                "b-high",
                "--type",
                "merge",
                "-p",
                r#"{"spec":{"rollout":{"paused":false}}}"#,
            ],
            None,
        )
        .expect("unpause");
    let s = drive(&proxies, &policies, "b-high", &failing, "b-high degraded", |s| {
        s.phase == Some(PolicyPhase::Degraded)
    })
    .await;
    assert_eq!(s.failed_nodes, 1);
    assert_eq!(
        s.waves.iter().map(|w| w.state).collect::<Vec<_>>(),
        [WaveState::Failed, WaveState::Pending]
    );
    let degraded = condition(&s, "Degraded").expect("Degraded");
    assert!(
        degraded.status == "True"
            && degraded.message.contains(&canary)
            && degraded.message.contains("no endpoint answered"),
        "{degraded:?}"
    );
    for _ in 0..5 {
        play_agents(&proxies, &failing).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let m = modes(&proxies).await;
    for node in &n[..3] {
        assert_eq!(m[node].1, Some(ProxyMode::Iptables), "{node}: {m:?}");
        if *node != canary {
            assert_eq!(m[node].0, None, "later wave never started: {m:?}");
        }
    }
    assert!(
        m.values()
            .all(|v| v.0 != Some(ProxyMode::Iptables)
                || v.2.as_deref().is_some_and(|t| !t.starts_with("b-low"))),
        "b-low never applied its mode: {m:?}"
    );
    let evs = events_when(&admin, "b-high", |e| {
        e.iter()
            .any(|(r, n)| r == "NodeSwitchFailed" && n.contains(&canary))
            && e.iter().any(|(r, _)| r == "Paused")
    })
    .await;
    assert!(
        evs.iter()
            .any(|(r, note)| r == "NodeSwitchFailed" && note.contains(&canary)),
        "{evs:?}"
    );
    assert!(evs.iter().any(|(r, _)| r == "Paused"), "{evs:?}");

    // IPVS on nodes without IPVS: skip → Incompatible (left alone); IPVSDeprecated warns.
    apply_policy(
        &env.cp,
        r#"apiVersion: switchyard.dev/v1alpha1
kind: ProxyPolicy
metadata: {name: c-ipvs}
spec:
  nodeSelector: {matchLabels: {pool: c}}
  mode: ipvs
  fallback: skip
"#,
    );
    let s = wait_status(&policies, "c-ipvs", "c-ipvs incompatible", |s| {
        s.incompatible_nodes == 2
    })
    .await;
    assert_eq!(s.phase, Some(PolicyPhase::Ready), "{s:#?}");
    assert_eq!(
        condition(&s, "IPVSDeprecated").map(|c| c.status.as_str()),
        Some("True")
    );
    assert!(
        condition(&s, "Ready")
            .expect("Ready")
            .message
            .contains("incompatible")
    );
    let m = modes(&proxies).await;
    assert_eq!((m[&n[3]].0, m[&n[4]].0), (None, None), "{m:?}");

    // Fallback nftables with failurePolicy rollback: the second node fails, the first goes back.
    env.cp
        .kubectl_ok(
            &["patch", "proxypolicy", "c-ipvs", "--type", "merge", "-p", r#"{"spec":{"fallback":"nftables","rollout":{"failurePolicy":"rollback","waves":[{"name":"first","nodes":1},{"name":"second","nodes":1}]}}}"#],
            None,
        )
        .expect("patch c-ipvs");
    let s = wait_status(&policies, "c-ipvs", "c-ipvs replanned", |s| {
        s.observed_generation == Some(2) && s.waves.len() == 2
    })
    .await;
    let (first, second) = (s.waves[0].nodes[0].clone(), s.waves[1].nodes[0].clone());
    let failing: BTreeSet<String> = [second.clone()].into();
    let s = drive(
        &proxies,
        &policies,
        "c-ipvs",
        &failing,
        "c-ipvs rolled back",
        |s| {
            s.phase == Some(PolicyPhase::Degraded) && s.waves.iter().all(|w| w.state == WaveState::RolledBack)
        },
    )
    .await;
    assert_eq!(s.failed_nodes, 1);
    let m = modes(&proxies).await;
    assert_eq!(m[&first].0, Some(ProxyMode::Iptables), "rolled back: {m:?}");
    assert_eq!(m[&first].1, Some(ProxyMode::Iptables));
    assert_eq!(m[&first].2.as_deref(), Some("c-ipvs-g2-rollback-iptables"));
    let evs = events_when(&admin, "c-ipvs", |e| e.iter().any(|(r, _)| r == "RolledBack")).await;
    assert!(evs.iter().any(|(r, _)| r == "RolledBack"), "{evs:?}");
    println!(
        "{}",
        env.cp.kubectl_ok(&["get", "proxypolicies"], None).expect("get")
    );
    println!(
        "{}",
        env.cp
            .kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)
            .expect("get")
    );
}
