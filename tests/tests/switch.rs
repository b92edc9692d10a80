//! Live mode switching by the agent, on the real apiserver and kernel: the test writes NodeProxy
//! spec the way the operator does (server-side apply, field manager `switchyard-operator`) and
//! watches the agents switch iptables ⇄ nftables under steady client load, roll back when the
//! health gate fails, and converge to one coherent ruleset when killed at every switch step.

use std::{
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::json;
use switchyard_crds::v1alpha1::{NodeProxy, ProxyMode, SwitchPhase};
use switchyard_e2e::{
    agent::{Agent, TestEnv, node_token},
    eventually, kernel,
    netns::{Cluster, Node},
    objects::{Ep, apply_service, apply_slice},
    traffic::{Outcome, probe, start_load, start_server},
};

const WEB: &str = "10.96.0.100";
const BROKEN: &str = "10.96.0.110";
const AGENT_ARGS: [&str; 6] = [
    "--mode",
    "iptables",
    "--cluster-cidr",
    "10.244.0.0/16",
    "--min-sync-period",
    "0.1",
];

fn web() -> SocketAddr {
    SocketAddr::new(WEB.parse().expect("ip"), 80)
}

async fn want(proxies: &Api<NodeProxy>, node: &str, mode: &str, token: &str, probes: serde_json::Value) {
    let body = json!({
        "apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "metadata": {"name": node},
        "spec": {"desiredMode": mode, "rolloutToken": token, "proxy": {"clusterCIDR": "10.244.0.0/16", "masqueradeAll": true},
                 "healthGate": {"minHealthySeconds": 2, "timeoutSeconds": 20, "failureThreshold": 2, "probes": probes}},
    });
    proxies
        .patch(
            node,
            &PatchParams::apply("switchyard-operator").force(),
            &Patch::Apply(&body),
        )
        .await
        .expect("apply NodeProxy spec");
}

/// Waits until the node answered `token` and returns (result, active mode, switch seconds as the
/// agent measured them from start to end of the switch).
/// On a timeout the failure shows the last status seen and the end of the node's agent log (in
/// `run_dir`, the control plane's run directory).
async fn answered(
    proxies: &Api<NodeProxy>,
    run_dir: &Path,
    node: &str,
    token: &str,
    limit: Duration,
) -> (String, Option<ProxyMode>, f64) {
    let start = Instant::now();
    let mut seen = None;
    loop {
        if let Ok(np) = proxies.get(node).await {
            seen = np.status.clone();
            let status = np.status.unwrap_or_default();
            if let Some(last) = status
                .last_switch
                .filter(|l| l.rollout_token.as_deref() == Some(token))
                && status.phase == Some(SwitchPhase::Active)
            {
                let took = match (&last.started_at, &last.finished_at) {
                    (Some(s), Some(f)) => (f.0.as_millisecond() - s.0.as_millisecond()) as f64 / 1000.0,
                    _ => f64::NAN,
                };
                return (last.result, status.active_mode, took);
            }
        }
        if start.elapsed() > limit {
            let log = switchyard_e2e::logs::read(&run_dir.join(format!("agent-{node}.log")));
            let tail: Vec<&str> = log
                .lines()
                .rev()
                .take(80)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            panic!(
                "{node} did not answer {token} within {limit:?}; last status: {seen:#?}\nagent log (last 80 lines):\n{}",
                tail.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What of ours is in a node's kernel: (nft table present, SWY iptables objects present). A
/// failed listing fails the test: `(false, _)` is only ever a listing that lacks the table.
fn ours(node: &Node) -> (bool, bool) {
    kernel::ours(&node.netns).unwrap_or_else(|e| panic!("{}: kernel listing: {e}", node.name))
}

fn failures(outcomes: &[Outcome]) -> usize {
    outcomes.iter().filter(|o| o.server().is_none()).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_switch_live_roll_back_and_survive_crashes() {
    let mut env = TestEnv::start(3, 2)
        .await
        .expect("control plane and 3 namespace nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    let nodes = env.cluster.nodes.clone();
    let _servers: Vec<_> = nodes
        .iter()
        .map(|n| start_server(&n.pods[0], &[8080], &[]).expect("server"))
        .collect();
    apply_service(
        &admin,
        "web",
        json!({"clusterIP": WEB, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        None,
    )
    .await
    .expect("web");
    apply_slice(
        &admin,
        "web",
        &[("http", 8080, "TCP")],
        &nodes
            .iter()
            .map(|n| Ep::ready(n.pods[0].ip, &n.name))
            .collect::<Vec<_>>(),
    )
    .await
    .expect("slice");
    // A Service whose only endpoint refuses connections: a health-gate probe through it fails.
    apply_service(
        &admin,
        "broken",
        json!({"clusterIP": BROKEN, "ports": [{"name": "http", "port": 80, "targetPort": 9}]}),
        None,
    )
    .await
    .expect("broken");
    apply_slice(
        &admin,
        "broken",
        &[("http", 9, "TCP")],
        &[Ep::ready(nodes[1].pods[1].ip, &nodes[1].name)],
    )
    .await
    .expect("slice");
    env.start_agents(&AGENT_ARGS).await.expect("agents");
    for n in &nodes {
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
        assert_eq!(ours(n), (false, true), "{}: iptables mode only", n.name);
    }

    // iptables → nftables and back, under steady load from a pod on every node.
    for (round, (mode, token)) in [("nftables", "to-nft"), ("iptables", "to-ipt")]
        .into_iter()
        .enumerate()
    {
        let loads: Vec<_> = nodes
            .iter()
            .map(|n| start_load(&n.pods[1].netns, web(), 300, 20).expect("load"))
            .collect();
        // A head start for the load, not synchronisation: every connection of the load must be
        // answered whenever it started (each load runs 300 attempts, 20 ms apart, past the switch).
        tokio::time::sleep(Duration::from_millis(500)).await;
        for n in &nodes {
            want(
                &proxies,
                &n.name,
                mode,
                token,
                json!([{"namespace": "default", "name": "web"}]),
            )
            .await;
        }
        let mut times = Vec::new();
        for n in &nodes {
            let (result, active, secs) =
                answered(&proxies, env.cp.dir(), &n.name, token, Duration::from_secs(60)).await;
            let detail = proxies
                .get(&n.name)
                .await
                .ok()
                .and_then(|np| np.status)
                .map(|s| format!("{:?} probes {:?}", s.last_switch, s.probes));
            assert_eq!(result, "Succeeded", "{}: {token}: {detail:?}", n.name);
            assert_eq!(active.map(|m| m.to_string()).as_deref(), Some(mode));
            times.push(format!("{} {secs:.1}s", n.name));
        }
        let mut failed = 0;
        let mut total = 0;
        for l in loads {
            let o = l.finish().expect("load");
            failed += failures(&o);
            total += o.len();
        }
        println!(
            "switch round {round} to {mode}: {total} connections, {failed} failed; per-node switch time (incl. 2 s gate): {times:?}"
        );
        assert_eq!(failed, 0, "connections failed during the switch to {mode}");
        for n in &nodes {
            assert_eq!(
                ours(n),
                (mode == "nftables", mode == "iptables"),
                "{}: leftovers after switching to {mode}",
                n.name
            );
        }
        if mode == "nftables" {
            // The policy's proxy settings (NodeProxy spec.proxy) reach the rules: masqueradeAll.
            let listing = Cluster::exec(
                &nodes[0].netns,
                &["nft", "list", "chain", "ip", "switchyard", "services"],
            )
            .expect("nft list chain ip switchyard services");
            assert!(listing.contains("masquerade all ClusterIP traffic"), "{listing}");
        }
    }

    // A plain agent restart keeps the reported result of the last switch (status is applied whole).
    // The check must look at a status the restarted agent wrote: with the old agent stopped, the
    // test removes `status.sync` (only an agent writes it), and waits until it is back.
    let n2 = &nodes[2];
    let idx = env.agents.iter().position(|a| a.node == n2.name).expect("agent");
    drop(env.agents.remove(idx));
    proxies
        .patch_status(
            &n2.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"sync": null}})),
        )
        .await
        .expect("clear status.sync");
    let token = node_token(&env.cp, &n2.name).await.expect("token");
    env.agents
        .push(Agent::start(&env.cp, n2, &token, &AGENT_ARGS).expect("agent"));
    eventually(
        Duration::from_secs(60),
        "the restarted agent reports status",
        || async {
            proxies
                .get(&n2.name)
                .await
                .ok()
                .and_then(|np| np.status?.sync)
                .map(|_| ())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let (result, _, _) = answered(
        &proxies,
        env.cp.dir(),
        &n2.name,
        "to-ipt",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(result, "Succeeded", "lastSwitch survives an agent restart");

    // A failing health gate rolls the node back, and nothing of the target is left.
    let n0 = &nodes[0];
    want(
        &proxies,
        &n0.name,
        "nftables",
        "gate-fails",
        json!([{"namespace": "default", "name": "broken"}]),
    )
    .await;
    let (result, active, _) = answered(
        &proxies,
        env.cp.dir(),
        &n0.name,
        "gate-fails",
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        (result.as_str(), active),
        ("RolledBack", Some(ProxyMode::Iptables))
    );
    let np = proxies.get(&n0.name).await.expect("np");
    let reason = np
        .status
        .and_then(|s| s.last_switch)
        .and_then(|l| l.reason)
        .unwrap_or_default();
    assert!(reason.contains("health gate failed"), "{reason}");
    assert_eq!(ours(n0), (false, true), "leftovers after rollback");

    // Killed at every step: the agent restarts and converges to one coherent ruleset.
    for (i, phase) in ["Preparing", "CutOver", "Verifying", "Cleaning"]
        .into_iter()
        .enumerate()
    {
        let node = &nodes[i % nodes.len()];
        let idx = env
            .agents
            .iter()
            .position(|a| a.node == node.name)
            .expect("agent");
        let old = env.agents.remove(idx);
        drop(old);
        let token = node_token(&env.cp, &node.name).await.expect("token");
        // The hidden fault-injection flag: the agent stalls right after persisting `phase`.
        let args: Vec<&str> = AGENT_ARGS
            .iter()
            .copied()
            .chain(["--test-pause-at", phase])
            .collect();
        env.agents
            .push(Agent::start(&env.cp, node, &token, &args).expect("agent"));
        let current = proxies
            .get(&node.name)
            .await
            .ok()
            .and_then(|np| np.status)
            .and_then(|s| s.active_mode)
            .unwrap_or(ProxyMode::Iptables);
        let target = if current == ProxyMode::Iptables {
            "nftables"
        } else {
            "iptables"
        };
        let crash_token = format!("crash-{phase}");
        want(&proxies, &node.name, target, &crash_token, json!([])).await;
        // The agent persists each phase before acting on it; the fault hook stalls it right there.
        let state_file = env.cp.dir().join(format!("state-{}/state.json", node.name));
        let start = Instant::now();
        while !std::fs::read_to_string(&state_file)
            .unwrap_or_default()
            .contains(&format!("\"phase\":\"{phase}\""))
        {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{}: never reached {phase}",
                node.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let idx = env
            .agents
            .iter()
            .position(|a| a.node == node.name)
            .expect("agent");
        env.agents.remove(idx).kill();
        let token = node_token(&env.cp, &node.name).await.expect("token");
        env.agents
            .push(Agent::start(&env.cp, node, &token, &AGENT_ARGS).expect("agent"));
        let (result, active, _) = answered(
            &proxies,
            env.cp.dir(),
            &node.name,
            &crash_token,
            Duration::from_secs(90),
        )
        .await;
        assert_eq!(result, "Succeeded", "{}: killed in {phase}", node.name);
        assert_eq!(active.map(|m| m.to_string()).as_deref(), Some(target));
        assert_eq!(
            ours(node),
            (target == "nftables", target == "iptables"),
            "{}: killed in {phase}: not one coherent ruleset",
            node.name
        );
        let o = probe(&node.pods[1].netns, web(), false, 10, 1000).expect("probe");
        assert_eq!(
            failures(&o),
            0,
            "{}: traffic after recovery from {phase}: {o:?}",
            node.name
        );
        println!("killed in {phase}: recovered to {target}, traffic restored");
    }
}
