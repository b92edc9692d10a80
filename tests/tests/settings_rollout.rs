//! A change of a ProxyPolicy's `spec.proxy` alone rolls out like a mode change, on the real
//! apiserver, operator and agents in namespace nodes: in waves, held by a pause (the nodes that
//! wait keep the old settings, read in their kernel: the per-namespace conntrack UDP timeout in
//! `/proc/sys/net/netfilter`), each node's switch behind the health gate; a gate that cannot
//! pass on a node puts the old settings back there (its NodeProxy asks for the new ones, its
//! kernel holds the old ones, its last switch says RolledBack).

use std::time::{Duration, Instant};

use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{NodeProxy, ProxyMode, ProxyPolicy};
use switchyard_e2e::{
    agent::TestEnv,
    eventually,
    netns::Cluster,
    objects::{Ep, apply_service, apply_slice},
    operator::Operator,
    throughout,
    traffic::start_server,
};

const POLICY: &str = "settings-rollout";
/// Reachable only from node-1 (internalTrafficPolicy Local, node-1's endpoint): a probe of it
/// passes there and can never pass on node-2.
const LOCAL_ONLY: &str = "10.96.0.131";
const UDP_TIMEOUT: &str = "/proc/sys/net/netfilter/nf_conntrack_udp_timeout";
const LIMIT: Duration = Duration::from_secs(120);

/// The node's conntrack UDP timeout, read in its namespace.
fn udp_timeout(netns: &str) -> String {
    Cluster::exec(netns, &["cat", UDP_TIMEOUT])
        .expect("read the UDP timeout")
        .trim()
        .to_owned()
}

/// The policy's spec: nftables on the pool, waves "first" (node-1, soaking `soak` s) and "rest",
/// the UDP timeout `udp`, `paused`, and the gate's extra `probes`.
fn spec(udp: u32, soak: u32, paused: bool, probes: Value) -> Value {
    json!({
        "nodeSelector": {"matchLabels": {"pool": "sr"}},
        "mode": "nftables",
        "rollout": {
            "waves": [
                {"name": "first", "nodes": 1, "soakSeconds": soak,
                 "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "node-1"}}},
                {"name": "rest", "nodes": "100%"},
            ],
            "paused": paused,
        },
        "healthGate": {"minHealthySeconds": 2, "timeoutSeconds": 30, "failureThreshold": 2, "probes": probes},
        "proxy": {"conntrack": {"udpTimeoutSeconds": udp}},
    })
}

fn apply_policy(env: &TestEnv, spec: Value) {
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
        "metadata": {"name": POLICY}, "spec": spec});
    env.cp.apply_json(&body).expect("apply policy");
}

/// Every agent's log, for a failure message.
fn logs(env: &TestEnv) -> String {
    env.agents
        .iter()
        .zip(&env.cluster.nodes)
        .map(|(a, n)| format!("--- agent on {}:\n{}", n.name, a.log_text()))
        .collect()
}

/// Waits until `check` holds for the policy with its generation observed.
async fn until_policy(env: &TestEnv, what: &str, check: impl Fn(&ProxyPolicy) -> bool) -> ProxyPolicy {
    let policies: Api<ProxyPolicy> = Api::all(env.cp.admin_client().await.expect("admin"));
    let last = std::sync::Mutex::new(None);
    let found = eventually(LIMIT, what, || async {
        let p = policies.get(POLICY).await.ok()?;
        let fresh = p.status.as_ref().and_then(|s| s.observed_generation) == p.metadata.generation;
        let ok = fresh && check(&p);
        *last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = p.status.clone();
        ok.then_some(p)
    })
    .await;
    found.unwrap_or_else(|e| {
        let status = last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        panic!("{e}; status: {status:#?}\n{}", logs(env))
    })
}

/// Waits until node `i`'s kernel holds the UDP timeout `want`.
async fn until_kernel(env: &TestEnv, i: usize, want: u32, what: &str) {
    let netns = env.cluster.nodes[i].netns.clone();
    eventually(LIMIT, what, || async {
        (udp_timeout(&netns) == want.to_string()).then_some(())
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {} holds {}\n{}",
            env.cluster.nodes[i].name,
            udp_timeout(&netns),
            logs(env)
        )
    });
}

fn condition_true(p: &ProxyPolicy, kind: &str) -> bool {
    p.status
        .as_ref()
        .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == kind && c.status == "True"))
}

fn wave_state(p: &ProxyPolicy, wave: &str) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.waves.iter().find(|w| w.name == wave))
        .map(|w| format!("{:?}", w.state))
        .unwrap_or_default()
}

fn settings_updated(p: &ProxyPolicy) -> i32 {
    p.status.as_ref().map_or(-1, |s| s.settings_updated_nodes)
}

/// Two nodes in pool `sr` running nftables, an echo server on node-1's pod behind the
/// local-only Service, and an operator.
async fn setup() -> (TestEnv, switchyard_e2e::traffic::Server, Operator) {
    let mut env = TestEnv::start(2, 1).await.expect("control plane and two nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    for n in &env.cluster.nodes {
        let label = json!({"metadata": {"labels": {"pool": "sr"}}});
        nodes
            .patch(&n.name, &PatchParams::default(), &Patch::Merge(&label))
            .await
            .expect("label node");
    }
    let n1 = &env.cluster.nodes[0];
    assert_eq!(n1.name, "node-1", "the first wave selects node-1 by hostname");
    let server = start_server(&n1.pods[0], &[8080], &[]).expect("server");
    apply_service(
        &admin,
        "local-only",
        json!({"clusterIP": LOCAL_ONLY, "internalTrafficPolicy": "Local",
            "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        None,
    )
    .await
    .expect("service");
    apply_slice(
        &admin,
        "local-only",
        &[("http", 8080, "TCP")],
        &[Ep::ready(n1.pods[0].ip, &n1.name)],
    )
    .await
    .expect("slice");
    env.start_agents(&["--mode", "nftables", "--cluster-cidr", "10.244.0.0/16"])
        .await
        .expect("agents");
    let operator = Operator::start(&env.cp, "op-a", &[]).await.expect("operator");
    (env, server, operator)
}

/// The NodeProxies' last switches: (node, token, result).
async fn last_switches(env: &TestEnv) -> Vec<(String, Option<String>, String)> {
    let proxies: Api<NodeProxy> = Api::all(env.cp.admin_client().await.expect("admin"));
    let mut out = Vec::new();
    for n in &env.cluster.nodes {
        let last = proxies
            .get(&n.name)
            .await
            .ok()
            .and_then(|np| np.status?.last_switch);
        out.push((
            n.name.clone(),
            last.as_ref().and_then(|l| l.rollout_token.clone()),
            last.map(|l| l.result).unwrap_or_default(),
        ));
    }
    out
}

async fn active_modes(env: &TestEnv) -> Vec<Option<ProxyMode>> {
    let proxies: Api<NodeProxy> = Api::all(env.cp.admin_client().await.expect("admin"));
    let mut out = Vec::new();
    for n in &env.cluster.nodes {
        out.push(
            proxies
                .get(&n.name)
                .await
                .ok()
                .and_then(|np| np.status?.active_mode),
        );
    }
    out
}

/// Generation 2 changes only the settings; the first wave soaks, the rollout is paused during
/// the soak: node-2 keeps the old settings after the soak is over, until the pause is lifted.
async fn paused_nodes_keep_the_old_settings(env: &TestEnv) {
    let (n1, n2) = (
        env.cluster.nodes[0].netns.clone(),
        env.cluster.nodes[1].netns.clone(),
    );
    // Long enough for the pause to land while wave first soaks, on a loaded machine (the pause
    // is one apply and one reconcile), short enough to wait out.
    let soak = 20;
    apply_policy(env, spec(42, soak, false, json!([])));
    until_kernel(env, 0, 42, "node-1 (wave first) takes the new settings").await;
    until_policy(env, "wave first done, soaking", |p| {
        wave_state(p, "first") == "Soaking"
    })
    .await;
    let soaking_seen = Instant::now();
    assert_eq!(
        udp_timeout(&n2),
        "41",
        "node-2 waits for its wave with the old settings"
    );
    apply_policy(env, spec(42, soak, true, json!([])));
    let p = until_policy(env, "paused", |p| condition_true(p, "Paused")).await;
    assert_eq!(settings_updated(&p), 1, "{:#?}", p.status);
    // Past the soak (which alone would release wave rest), node-2 keeps generation 1's settings.
    let paused_at = Instant::now();
    let soak_over = soaking_seen + Duration::from_secs(u64::from(soak) + 4);
    let window = soak_over.saturating_duration_since(paused_at);
    assert!(
        window >= Duration::from_secs(4),
        "the pause landed {:?} after wave first began to soak ({soak} s): too late to show it holds node-2",
        paused_at - soaking_seen
    );
    throughout(window, || async {
        match (udp_timeout(&n1).as_str(), udp_timeout(&n2).as_str()) {
            ("42", "41") => Ok(()),
            other => Err(format!("paused: node-1 new, node-2 old settings, got {other:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(env)));
    println!(
        "node-2 kept the old settings for {:?} while paused",
        paused_at.elapsed()
    );

    apply_policy(env, spec(42, soak, false, json!([])));
    until_kernel(env, 1, 42, "node-2 takes the new settings once resumed").await;
    let p = until_policy(env, "ready on the new settings", |p| {
        condition_true(p, "Ready") && settings_updated(p) == 2
    })
    .await;
    println!(
        "after resume: {:?}",
        p.status.as_ref().map(|s| (s.phase, s.settings_updated_nodes))
    );
    let switches = last_switches(env).await;
    println!("last switches: {switches:?}");
    assert_eq!(
        switches[0].1.as_deref(),
        Some("settings-rollout-g2-settings-nftables"),
        "{switches:?}"
    );
    assert_eq!(
        switches[1].1.as_deref(),
        Some("settings-rollout-g4-settings-nftables"),
        "{switches:?}"
    );
    assert!(switches.iter().all(|s| s.2 == "Succeeded"), "{switches:?}");
    assert_eq!(
        active_modes(env).await,
        [Some(ProxyMode::Nftables); 2],
        "no mode switched"
    );
}

/// Generation 5 changes the settings with a gate that cannot pass on node-2: node-1 keeps the
/// new ones, node-2 rolls back to the old ones (in its kernel) while its spec asks for the new.
async fn a_failing_gate_restores_the_old_settings(env: &TestEnv) {
    let n2 = env.cluster.nodes[1].netns.clone();
    let probes = json!([{"namespace": "default", "name": "local-only"}]);
    apply_policy(env, spec(43, 0, false, probes));
    until_kernel(env, 0, 43, "node-1 passes its gate with the new settings").await;
    let p = until_policy(env, "degraded by node-2's gate", |p| {
        condition_true(p, "Degraded")
    })
    .await;
    println!(
        "degraded: {:?}",
        p.status
            .as_ref()
            .map(|s| (s.phase, s.failed_nodes, s.settings_updated_nodes))
    );
    let switches = last_switches(env).await;
    println!("last switches: {switches:?}");
    assert_eq!(
        (switches[1].1.as_deref(), switches[1].2.as_str()),
        (Some("settings-rollout-g5-settings-nftables"), "RolledBack"),
        "{switches:?}"
    );
    until_kernel(env, 1, 42, "node-2's old settings back after its failed gate").await;
    // The gate ran on the new settings: the agent had written them to node-2's kernel.
    let log = env.agents[1].log_text();
    assert!(
        log.contains("(UdpTimeout, 43)"),
        "node-2 never took the new settings:\n{log}"
    );
    let proxies: Api<NodeProxy> = Api::all(env.cp.admin_client().await.expect("admin"));
    let asked = proxies
        .get("node-2")
        .await
        .expect("node-2's NodeProxy")
        .spec
        .proxy;
    let asked = asked
        .and_then(|p| p.conntrack)
        .and_then(|c| c.udp_timeout_seconds);
    assert_eq!(asked, Some(43), "the spec still asks for the new settings");
    throughout(Duration::from_secs(3), || async {
        match udp_timeout(&n2).as_str() {
            "42" => Ok(()),
            other => Err(format!(
                "node-2 keeps the old settings after its failed gate, got {other}"
            )),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(env)));
    let p = until_policy(env, "still degraded", |p| condition_true(p, "Degraded")).await;
    assert_eq!(settings_updated(&p), 1, "{:#?}", p.status);
    assert_eq!(
        active_modes(env).await,
        [Some(ProxyMode::Nftables); 2],
        "no mode switched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settings_change_rolls_out_in_waves_and_a_failed_gate_restores_it() {
    let (env, _server, _operator) = setup().await;
    // Generation 1: the settings reach both nodes (each by a settings switch: they run nftables).
    apply_policy(&env, spec(41, 0, false, json!([])));
    until_kernel(&env, 0, 41, "node-1 on generation 1's settings").await;
    until_kernel(&env, 1, 41, "node-2 on generation 1's settings").await;
    until_policy(&env, "ready on generation 1", |p| {
        condition_true(p, "Ready") && settings_updated(p) == 2
    })
    .await;
    paused_nodes_keep_the_old_settings(&env).await;
    a_failing_gate_restores_the_old_settings(&env).await;
}
