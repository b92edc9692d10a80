//! The agent against faults of the control plane and of its own persisted state, on the real
//! apiserver and kernel, with client load from every node counted per phase:
//! - etcd and kube-apiserver SIGKILLed for [`OUTAGE`]: the agents stay up, `/healthz` says the
//!   apiserver is unreachable and since when, the data path keeps serving, an agent started during
//!   the outage comes up without touching the kernel, and a Service created after the return is
//!   served promptly;
//! - empty, truncated, garbage and stale (valid, but contradicted by the kernel) state files: no
//!   switch, the kernel unchanged, a `StateConsistent=False` condition with the reason and a
//!   Warning Event.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Event;
use kube::{Api, api::ListParams};
use serde_json::json;
use switchyard_crds::v1alpha1::{NodeProxy, ProxyMode};
use switchyard_e2e::{
    agent::{Agent, TestEnv, node_token},
    kernel,
    netns::Node,
    objects::{Ep, apply_service, apply_slice},
    traffic::{Outcome, http_get, probe, start_load, start_server},
};

const WEB: &str = "10.96.0.100";
/// A Service whose only endpoint refuses connections: a health-gate probe through it fails.
const BROKEN: &str = "10.96.0.110";
const LATE: &str = "10.96.0.120";
/// How long the control plane stays down (the figure).
const OUTAGE: Duration = Duration::from_secs(60);
const AGENT_ARGS: [&str; 6] = [
    "--mode",
    "nftables",
    "--cluster-cidr",
    "10.244.0.0/16",
    "--min-sync-period",
    "0.1",
];

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("ip"), port)
}

/// The agent's `/healthz` body, parsed.
fn healthz(node: &Node) -> Option<serde_json::Value> {
    let (code, text) = http_get(&node.netns, addr("127.0.0.1", 10256), "/healthz").ok()?;
    if code == 0 {
        return None;
    }
    let body = text.split("\r\n\r\n").nth(1).or_else(|| text.lines().last())?;
    serde_json::from_str(body.trim()).ok()
}

/// Polls `check` every 200 ms until it holds; panics with `what` after `limit`.
async fn eventually(limit: Duration, what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    start.elapsed()
}

fn serves(node: &Node, ip: &str) -> bool {
    probe(&node.pods[1].netns, addr(ip, 80), false, 1, 500)
        .map(|o| o.iter().all(|o| o.server().is_some()))
        .unwrap_or(false)
}

/// The node's nftables ruleset as a sorted list of lines (trailing commas dropped): a full
/// re-sync of the same state may list map elements in another order.
fn nft_listing(node: &Node) -> Vec<String> {
    let text = kernel::nft_ruleset(&node.netns).unwrap_or_else(|e| panic!("{}: nft listing: {e}", node.name));
    let mut lines: Vec<String> = text
        .lines()
        .map(|l| l.trim().trim_end_matches(',').to_owned())
        .filter(|l| !l.is_empty())
        .collect();
    lines.sort();
    assert!(
        lines.iter().any(|l| l.starts_with("table ip switchyard")),
        "{}: no switchyard table in\n{text}",
        node.name
    );
    lines
}

fn iptables_has_ours(node: &Node) -> bool {
    kernel::ours(&node.netns)
        .unwrap_or_else(|e| panic!("{}: kernel listing: {e}", node.name))
        .1
}

fn failed(outcomes: &[Outcome]) -> usize {
    outcomes.iter().filter(|o| o.server().is_none()).count()
}

/// Kills the node's agent and starts it again with `token` (minted beforehand: minting needs the
/// apiserver).
fn restart_agent(env: &mut TestEnv, node: &Node, token: &str) {
    let idx = env
        .agents
        .iter()
        .position(|a| a.node == node.name)
        .expect("agent of the node");
    env.agents.remove(idx).kill();
    env.agents
        .push(Agent::start(&env.cp, node, token, &AGENT_ARGS).expect("agent"));
}

fn agent_of<'a>(env: &'a mut TestEnv, node: &Node) -> &'a mut Agent {
    env.agents
        .iter_mut()
        .find(|a| a.node == node.name)
        .expect("agent of the node")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_outlive_a_control_plane_outage_and_distrust_bad_state_files() {
    let mut env = TestEnv::start(2, 2)
        .await
        .expect("control plane and 2 namespace nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let nodes = env.cluster.nodes.clone();
    let _servers: Vec<_> = nodes
        .iter()
        .map(|n| start_server(&n.pods[0], &[8080], &[]).expect("server"))
        .collect();
    let endpoints: Vec<Ep> = nodes.iter().map(|n| Ep::ready(n.pods[0].ip, &n.name)).collect();
    for (name, ip, port, eps) in [
        ("web", WEB, 8080, endpoints.clone()),
        (
            "broken",
            BROKEN,
            9,
            vec![Ep::ready(nodes[1].pods[1].ip, &nodes[1].name)],
        ),
    ] {
        apply_service(
            &admin,
            name,
            json!({"clusterIP": ip, "ports": [{"name": "http", "port": 80, "targetPort": port}]}),
            None,
        )
        .await
        .expect("service");
        apply_slice(&admin, name, &[("http", port, "TCP")], &eps)
            .await
            .expect("slice");
    }
    env.start_agents(&AGENT_ARGS).await.expect("agents");
    for n in &nodes {
        eventually(Duration::from_secs(60), &format!("{} serves web", n.name), || {
            serves(n, WEB)
        })
        .await;
    }

    // --- The control plane SIGKILLed for OUTAGE, under load from every node. ---
    let attempts = (OUTAGE.as_millis() / 100) as u32 + 200;
    let loads: Vec<_> = nodes
        .iter()
        .map(|n| start_load(&n.pods[1].netns, addr(WEB, 80), attempts, 100).expect("load"))
        .collect();
    let before: Vec<Vec<String>> = nodes.iter().map(nft_listing).collect();
    let outage_token = node_token(&env.cp, &nodes[0].name).await.expect("token");
    let killed = env.cp.kill_processes().expect("kill the control plane");
    for n in &nodes {
        let took = eventually(
            Duration::from_secs(30),
            &format!("{}: /healthz reports the apiserver unreachable", n.name),
            || healthz(n).is_some_and(|b| b["apiServer"]["reachable"] == json!(false)),
        )
        .await;
        let body = healthz(n).expect("healthz");
        assert!(
            body["apiServer"]["unreachableSince"].is_string(),
            "{}: no outage start in {body}",
            n.name
        );
        eprintln!("{}: outage seen by /healthz after {took:.1?}: {body}", n.name);
    }
    // An agent started while the apiserver is down comes up and leaves the kernel as it is.
    restart_agent(&mut env, &nodes[0], &outage_token);
    eventually(
        Duration::from_secs(30),
        "the agent started during the outage answers /healthz",
        || healthz(&nodes[0]).is_some_and(|b| b["apiServer"]["reachable"] == json!(false)),
    )
    .await;
    while killed.at.elapsed() < OUTAGE {
        for n in &nodes {
            assert_eq!(
                agent_of(&mut env, n).exit_status(),
                None,
                "{}: the agent exited during the outage:\n{}",
                n.name,
                agent_of(&mut env, n).log_text()
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for (n, before) in nodes.iter().zip(&before) {
        assert_eq!(
            &nft_listing(n),
            before,
            "{}: the kernel changed during the outage",
            n.name
        );
    }
    let back = env
        .cp
        .restart_processes(killed)
        .await
        .expect("restart the control plane");
    // A Service created once the API is back is programmed promptly on every node.
    let created = Instant::now();
    apply_service(
        &admin,
        "late",
        json!({"clusterIP": LATE, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        None,
    )
    .await
    .expect("late service");
    apply_slice(&admin, "late", &[("http", 8080, "TCP")], &endpoints)
        .await
        .expect("late slice");
    for n in &nodes {
        eventually(
            Duration::from_secs(30),
            &format!("{} serves the Service created after the outage", n.name),
            || serves(n, LATE),
        )
        .await;
        eprintln!(
            "{}: new Service served {:.2?} after its creation, {:.2?} after the apiserver was ready again",
            n.name,
            created.elapsed(),
            back.elapsed()
        );
    }
    for n in &nodes {
        eventually(
            Duration::from_secs(30),
            &format!("{}: /healthz reports the apiserver reachable again", n.name),
            || healthz(n).is_some_and(|b| b["apiServer"]["reachable"] == json!(true)),
        )
        .await;
        assert_eq!(
            agent_of(&mut env, n).exit_status(),
            None,
            "{}: agent exited",
            n.name
        );
    }
    for (n, load) in nodes.iter().zip(loads) {
        let outcomes = load.finish().expect("load");
        eprintln!(
            "outage load {}: {} attempts, {} failed",
            n.name,
            outcomes.len(),
            failed(&outcomes)
        );
        assert!(outcomes.len() as u32 >= attempts, "{}: load cut short", n.name);
        assert_eq!(
            failed(&outcomes),
            0,
            "{}: connections failed across the outage",
            n.name
        );
    }

    // --- Bad state files on node 0: no switch, the kernel unchanged, a clear status. ---
    let node = &nodes[0];
    let state_file = env.cp.dir().join(format!("state-{}/state.json", node.name));
    let good = std::fs::read(&state_file).expect("the agent wrote its state file");
    let stale = json!({"phase": "Active", "active": "iptables", "target": null, "token": null, "answered": null, "restarts": 0});
    // (case, file content, condition reason, a part of its message only this case produces — the
    // previous case's condition is still in the status until the new agent reports).
    let cases: [(&str, Vec<u8>, &str, &str); 4] = [
        ("empty", Vec::new(), "StateFileCorrupt", "is empty"),
        (
            "truncated",
            good[..good.len() / 2].to_vec(),
            "StateFileCorrupt",
            "EOF",
        ),
        (
            "garbage",
            b"\x00\x7fnot json".to_vec(),
            "StateFileCorrupt",
            "expected value",
        ),
        // A valid file of an older agent (bare state) that says iptables serves.
        (
            "stale",
            serde_json::to_vec(&stale).expect("json"),
            "StateFileStale",
            "says iptables",
        ),
    ];
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    for (case, bytes, reason, message) in cases {
        let load = start_load(&node.pods[1].netns, addr(WEB, 80), 60, 100).expect("load");
        let idx = env
            .agents
            .iter()
            .position(|a| a.node == node.name)
            .expect("agent");
        env.agents.remove(idx).kill();
        let before = nft_listing(node);
        std::fs::write(&state_file, &bytes).expect("write the bad state file");
        let token = node_token(&env.cp, &node.name).await.expect("token");
        env.agents
            .push(Agent::start(&env.cp, node, &token, &AGENT_ARGS).expect("agent"));
        let limit = Duration::from_secs(60);
        let start = Instant::now();
        let condition = loop {
            let status = proxies
                .get(&node.name)
                .await
                .ok()
                .and_then(|np| np.status)
                .unwrap_or_default();
            let found = status
                .conditions
                .iter()
                .find(|c| {
                    c.type_ == "StateConsistent"
                        && c.status == "False"
                        && c.reason == reason
                        && c.message.contains(message)
                })
                .cloned();
            if let Some(c) = found {
                assert_eq!(
                    status.active_mode,
                    Some(ProxyMode::Nftables),
                    "{case}: active mode"
                );
                break c;
            }
            assert!(
                start.elapsed() < limit,
                "{case}: no StateConsistent=False {reason} within {limit:?}: {:?}\n{}",
                status.conditions,
                agent_of(&mut env, node).log_text()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        eprintln!("{case}: {}: {}", condition.reason, condition.message);
        assert!(
            condition.message.contains("nftables"),
            "{case}: {}",
            condition.message
        );
        assert_eq!(nft_listing(node), before, "{case}: the nftables ruleset changed");
        assert!(
            !iptables_has_ours(node),
            "{case}: iptables rules appeared (a switch)"
        );
        let log = agent_of(&mut env, node).log_text();
        assert!(
            !log.contains("switch: preparing"),
            "{case}: a switch started:\n{log}"
        );
        let listed = events.list(&ListParams::default()).await.expect("events");
        assert!(
            listed.items.iter().any(|e| e.reason.as_deref() == Some(reason)
                && e.involved_object.name.as_deref() == Some(node.name.as_str())),
            "{case}: no {reason} Event for {}",
            node.name
        );
        // The agent writes a good file again.
        eventually(
            Duration::from_secs(30),
            &format!("{case}: state file rewritten"),
            || std::fs::read_to_string(&state_file).is_ok_and(|t| t.contains("\"sha256\"")),
        )
        .await;
        let outcomes = load.finish().expect("load");
        eprintln!(
            "state file {case}: {} attempts, {} failed",
            outcomes.len(),
            failed(&outcomes)
        );
        assert_eq!(failed(&outcomes), 0, "{case}: connections failed");
    }

    // --- The NodeProxy deleted mid-switch: re-created with an empty spec, the switch keeps its
    // own health gate (a failing probe, 8 rounds) instead of the defaults, and rolls back. ---
    let node = &nodes[1];
    let spec = json!({
        "apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "metadata": {"name": node.name},
        "spec": {"desiredMode": "iptables", "rolloutToken": "gated",
                 "healthGate": {"minHealthySeconds": 30, "timeoutSeconds": 90, "failureThreshold": 8,
                                "probes": [{"namespace": "default", "name": "broken"}]}},
    });
    proxies
        .patch(
            &node.name,
            &kube::api::PatchParams::apply("switchyard-operator").force(),
            &kube::api::Patch::Apply(&spec),
        )
        .await
        .expect("NodeProxy spec");
    let limit = Duration::from_secs(60);
    let start = Instant::now();
    loop {
        let phase = proxies
            .get(&node.name)
            .await
            .ok()
            .and_then(|np| np.status)
            .and_then(|s| s.phase);
        if phase == Some(switchyard_crds::v1alpha1::SwitchPhase::Verifying) {
            break;
        }
        assert!(start.elapsed() < limit, "{}: never reached Verifying", node.name);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxies
        .delete(&node.name, &Default::default())
        .await
        .expect("delete the NodeProxy mid-switch");
    let start = Instant::now();
    let last = loop {
        let last = proxies
            .get(&node.name)
            .await
            .ok()
            .and_then(|np| np.status)
            .and_then(|s| s.last_switch)
            .filter(|l| l.rollout_token.as_deref() == Some("gated"));
        if let Some(l) = last {
            break l;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{}: the switch never ended after the NodeProxy was re-created:\n{}",
            node.name,
            agent_of(&mut env, node).log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "NodeProxy deleted mid-switch: {} ({:?})",
        last.result, last.reason
    );
    assert_eq!(
        last.result,
        "RolledBack",
        "{}: {:?}\n{}",
        node.name,
        last.reason,
        agent_of(&mut env, node).log_text()
    );
    assert!(
        last.reason
            .as_deref()
            .is_some_and(|r| r.contains("8 consecutive")),
        "the switch's own gate decided: {:?}",
        last.reason
    );
    assert_eq!(
        kernel::ours(&node.netns).expect("listing"),
        (true, false),
        "one backend: nftables"
    );
}
