//! What a ProxyPolicy leaves behind, on the real apiserver, operator and agents in namespace
//! nodes (agents started in iptables mode, a `web` Service with an echo server on every node):
//!
//! - **Keep** (the default): two nodes relabelled out of the pool mid-rollout (one already on
//!   nftables, one not yet switched) are released: the policy's counts drop, their NodeProxy
//!   specs stop naming it (annotation, `Released` Event), and each keeps serving in its mode —
//!   its kernel holds the `switchyard` nft table or the `SWY-*` chains, not both, and `web`
//!   answers from it — while the rest of the pool finishes the rollout;
//! - **Revert**: the schema refuses a Revert without a mode to return to; a policy with
//!   `onRelease: Revert` gets its finalizer, and when deleted mid-rollout (two waves switched,
//!   the third waiting for approval) its switched nodes return to iptables through the
//!   rollout, one at a time (maxUnavailable 1: their revert switches do not overlap) under the
//!   health gate, the status saying `Reverting`; then the kernel holds the `SWY-*` chains and
//!   no `switchyard` table on every node, `web` answers, and the policy object is gone;
//! - **Revert, a node leaving the pool**: it returns to iptables under the policy's gate (Event
//!   `Reverting`), then is released (`Released`); the rest of the pool stays on nftables.
//!
//! The tests run one at a time (a shared lock): each starts its own control plane and agents.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Node, events::v1::Event};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::{
    consts::POLICY_LABEL,
    v1alpha1::{NodeProxy, ProxyMode, ProxyPolicy},
};
use switchyard_e2e::{
    agent::TestEnv,
    eventually, kernel,
    objects::{Ep, apply_service, apply_slice},
    operator::Operator,
    throughout,
    traffic::{Server, probe, start_server},
};

const WEB: &str = "10.96.0.140";
const LIMIT: Duration = Duration::from_secs(120);
const RELEASED: &str = "switchyard.dev/released-from";
const FINALIZER: &str = "switchyard.dev/revert-on-release";

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn web() -> SocketAddr {
    SocketAddr::new(WEB.parse().expect("ip"), 80)
}

/// Three nodes in pool `lc`, echo servers behind `web`, iptables agents serving it, an operator.
async fn setup() -> (TestEnv, Vec<Server>, Operator) {
    let mut env = TestEnv::start(3, 2).await.expect("control plane and 3 nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    for n in &env.cluster.nodes {
        relabel(&admin, &n.name, "lc").await;
    }
    let servers: Vec<Server> = env
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
    for i in 0..env.cluster.nodes.len() {
        until_serving(&env, i, "web served in iptables mode").await;
    }
    let operator = Operator::start(&env.cp, "op-a", &[]).await.expect("operator");
    (env, servers, operator)
}

async fn relabel(admin: &Client, node: &str, pool: &str) {
    Api::<Node>::all(admin.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"pool": pool}}})),
        )
        .await
        .expect("label node");
}

fn policy_body(name: &str, spec: &Value) -> Value {
    json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": name}, "spec": spec})
}

fn gate() -> Value {
    json!({"minHealthySeconds": 2, "timeoutSeconds": 30, "failureThreshold": 2,
           "probes": [{"namespace": "default", "name": "web"}]})
}

fn logs(env: &TestEnv, op: &Operator) -> String {
    let agents: String = env
        .agents
        .iter()
        .zip(&env.cluster.nodes)
        .map(|(a, n)| format!("--- agent on {}:\n{}", n.name, a.log_text()))
        .collect();
    format!("{agents}--- operator:\n{}", op.log_text())
}

async fn get_policy(admin: &Client, name: &str) -> Option<ProxyPolicy> {
    Api::<ProxyPolicy>::all(admin.clone())
        .get_opt(name)
        .await
        .ok()
        .flatten()
}

async fn nodeproxy(admin: &Client, name: &str) -> NodeProxy {
    Api::<NodeProxy>::all(admin.clone())
        .get(name)
        .await
        .expect("NodeProxy")
}

/// Waits until the policy (its generation observed) satisfies `check`.
async fn until_policy(
    env: &TestEnv,
    op: &Operator,
    name: &str,
    what: &str,
    check: impl Fn(&ProxyPolicy) -> bool,
) -> ProxyPolicy {
    let admin = env.cp.admin_client().await.expect("admin");
    let check = &check;
    let found = eventually(LIMIT, what, || {
        let admin = admin.clone();
        async move {
            let p = get_policy(&admin, name).await?;
            let fresh = p.status.as_ref().and_then(|s| s.observed_generation) == p.metadata.generation;
            (fresh && check(&p)).then_some(p)
        }
    })
    .await;
    found.unwrap_or_else(|e| {
        let p = futures::executor::block_on(get_policy(&admin, name));
        panic!(
            "{e}; policy: {:#?}\n{}",
            p.map(|p| (p.metadata, p.status)),
            logs(env, op)
        )
    })
}

/// Waits until node `i`'s NodeProxy satisfies `check`.
async fn until_np(
    env: &TestEnv,
    op: &Operator,
    i: usize,
    what: &str,
    check: impl Fn(&NodeProxy) -> bool,
) -> NodeProxy {
    let admin = env.cp.admin_client().await.expect("admin");
    let name = env.cluster.nodes[i].name.clone();
    let check = &check;
    let found = eventually(LIMIT, what, || {
        let (admin, name) = (admin.clone(), name.clone());
        async move {
            let np = Api::<NodeProxy>::all(admin).get(&name).await.ok()?;
            check(&np).then_some(np)
        }
    })
    .await;
    found.unwrap_or_else(|e| {
        let np = futures::executor::block_on(nodeproxy(&admin, &name));
        panic!(
            "{e}; {name}: {:#?}\n{}",
            (np.metadata, np.spec, np.status),
            logs(env, op)
        )
    })
}

fn active(np: &NodeProxy) -> Option<ProxyMode> {
    np.status.as_ref().and_then(|s| s.active_mode)
}

fn serving(np: &NodeProxy, mode: ProxyMode) -> bool {
    np.status
        .as_ref()
        .is_some_and(|s| s.active_mode == Some(mode) && format!("{:?}", s.phase) == "Some(Active)")
}

fn wave_state(p: &ProxyPolicy, wave: &str) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.waves.iter().find(|w| w.name == wave))
        .map(|w| format!("{:?}", w.state))
        .unwrap_or_default()
}

fn condition(p: &ProxyPolicy, kind: &str) -> Option<(String, String, String)> {
    p.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// (switchyard nft table present, SWY iptables objects present) in node `i`'s kernel.
fn ours(env: &TestEnv, i: usize) -> (bool, bool) {
    let n = &env.cluster.nodes[i];
    kernel::ours(&n.netns).unwrap_or_else(|e| panic!("{}: kernel listing: {e}", n.name))
}

/// Whether `web` answers every one of 5 attempts from node `i`'s second pod.
fn answers(env: &TestEnv, i: usize) -> bool {
    probe(&env.cluster.nodes[i].pods[1].netns, web(), false, 5, 1000)
        .expect("probe")
        .iter()
        .all(|o| o.server().is_some())
}

async fn until_serving(env: &TestEnv, i: usize, what: &str) {
    eventually(LIMIT, what, || async { answers(env, i).then_some(()) })
        .await
        .unwrap_or_else(|e| panic!("{e}: {}", env.cluster.nodes[i].name));
}

/// Events regarding `name`: (reason, note); a failed list is an error (not an empty list).
async fn events_of(admin: &Client, name: &str) -> Result<Vec<(String, String)>, String> {
    let list = Api::<Event>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| format!("list events: {e}"))?;
    Ok(list
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect())
}

async fn until_event(admin: &Client, op: &Operator, name: &str, reason: &str) -> Vec<(String, String)> {
    let last = std::sync::Mutex::new(Ok(Vec::new()));
    let found = eventually(Duration::from_secs(30), reason, || async {
        let e = events_of(admin, name).await;
        let hit = e.as_ref().is_ok_and(|e| e.iter().any(|(r, _)| r == reason));
        let out = hit.then(|| e.clone().unwrap_or_default());
        *last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = e;
        out
    })
    .await;
    found.unwrap_or_else(|e| {
        let log: Vec<String> = op
            .log_text()
            .lines()
            .filter(|l| l.contains("event") || l.contains("released"))
            .map(str::to_owned)
            .collect();
        panic!(
            "{e}: {name}: {:?}\noperator:\n{}",
            last.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            log.join("\n")
        )
    })
}

/// Keep: nodes relabelled out of the pool mid-rollout keep serving in their modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_relabelled_out_mid_rollout_keep_serving_in_their_mode() {
    let _serial = SERIAL.lock().await;
    let (env, _servers, op) = setup().await;
    let admin = env.cp.admin_client().await.expect("admin");
    let name = "lc-keep";
    let spec = json!({
        "nodeSelector": {"matchLabels": {"pool": "lc"}}, "mode": "nftables",
        "rollout": {"waves": [
            {"name": "one", "nodes": 1, "soakSeconds": 20,
             "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "node-1"}}},
            {"name": "rest", "nodes": "100%"}], "maxUnavailable": 1},
        "healthGate": gate(),
    });
    env.cp
        .apply_json(&policy_body(name, &spec))
        .expect("apply policy");
    let p = until_policy(&env, &op, name, "wave one soaking", |p| {
        wave_state(p, "one") == "Soaking"
    })
    .await;
    let no_finalizer = p.finalizers().is_empty();
    assert!(no_finalizer, "Keep needs no finalizer: {:?}", p.finalizers());
    // Mid-rollout: node-1 switched, node-2 and node-3 wait for wave rest. node-1 and node-2 leave.
    assert!(serving(&nodeproxy(&admin, "node-1").await, ProxyMode::Nftables));
    assert!(serving(&nodeproxy(&admin, "node-2").await, ProxyMode::Iptables));
    relabel(&admin, "node-1", "elsewhere").await;
    relabel(&admin, "node-2", "elsewhere").await;
    let released_at = Instant::now();
    let p = until_policy(&env, &op, name, "the pool shrinks to node-3", |p| {
        p.status.as_ref().is_some_and(|s| s.target_nodes == 1)
    })
    .await;
    println!(
        "after the relabel: {:?}",
        p.status
            .as_ref()
            .map(|s| (s.target_nodes, s.updated_nodes, s.healthy_nodes, s.phase))
    );
    for (i, keeps) in [(0, ProxyMode::Nftables), (1, ProxyMode::Iptables)] {
        let np = until_np(&env, &op, i, "released", |np| {
            np.spec.policy.is_none() && np.annotations().contains_key(RELEASED)
        })
        .await;
        let node = &env.cluster.nodes[i].name;
        assert!(
            !np.labels().contains_key(POLICY_LABEL),
            "{node}: {:?}",
            np.labels()
        );
        assert_eq!(
            np.spec.desired_mode,
            Some(keeps),
            "{node} keeps {keeps}: {:?}",
            np.spec
        );
        let note = &np.annotations()[RELEASED];
        assert!(
            note.contains("proxypolicy lc-keep")
                && note.contains("no longer selects")
                && note.contains(keeps.as_str()),
            "{node}: {note}"
        );
        let evs = until_event(&admin, &op, node, "Released").await;
        assert!(evs.iter().any(|(_, n)| n.contains("lc-keep")), "{evs:?}");
    }
    println!(
        "node-1 and node-2 released {:.1}s after the relabel",
        released_at.elapsed().as_secs_f64()
    );
    // The kernel: each keeps exactly its mode's objects, and serves.
    let expect = [(0, (true, false)), (1, (false, true))];
    throughout(Duration::from_secs(5), || async {
        for (i, want) in expect {
            let got = ours(&env, i);
            let np = nodeproxy(&admin, &env.cluster.nodes[i].name).await;
            if got != want
                || !answers(&env, i)
                || active(&np)
                    != Some(if want.0 {
                        ProxyMode::Nftables
                    } else {
                        ProxyMode::Iptables
                    })
            {
                return Err(format!(
                    "{}: kernel {got:?}, want {want:?}, active {:?}",
                    env.cluster.nodes[i].name,
                    active(&np)
                ));
            }
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&env, &op)));
    // The rest of the pool finishes the rollout without them.
    let p = until_policy(&env, &op, name, "ready on node-3", |p| {
        condition(p, "Ready").is_some_and(|c| c.0 == "True")
    })
    .await;
    let s = p.status.clone().unwrap_or_default();
    assert_eq!(
        (s.target_nodes, s.updated_nodes, s.healthy_nodes),
        (1, 1, 1),
        "{s:#?}"
    );
    assert!(serving(&nodeproxy(&admin, "node-3").await, ProxyMode::Nftables));
    assert_eq!(ours(&env, 2), (true, false), "node-3 on nftables");
    assert_eq!(
        ours(&env, 1),
        (false, true),
        "node-2 still on iptables after the rollout ended"
    );
    assert!(
        answers(&env, 1) && answers(&env, 0),
        "the released nodes still serve"
    );
    let table = env
        .cp
        .kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)
        .expect("get");
    println!("{table}");
}

/// The (start, end) of a NodeProxy's last switch, in milliseconds.
fn switch_span(np: &NodeProxy) -> Option<(i64, i64)> {
    let l = np.status.as_ref()?.last_switch.as_ref()?;
    Some((
        l.started_at.as_ref()?.0.as_millisecond(),
        l.finished_at.as_ref()?.0.as_millisecond(),
    ))
}

/// The last switch went from nftables to iptables with a token of `policy`, and it serves.
fn reverted(np: &NodeProxy, policy: &str) -> bool {
    np.status
        .as_ref()
        .and_then(|s| s.last_switch.as_ref())
        .is_some_and(|l| {
            l.result == "Succeeded"
                && l.to == ProxyMode::Iptables
                && l.from == Some(ProxyMode::Nftables)
                && l.rollout_token
                    .as_deref()
                    .is_some_and(|t| t.starts_with(policy) && t.ends_with("-iptables"))
        })
        && serving(np, ProxyMode::Iptables)
}

/// The schema refuses Revert without a mode, or to the policy's own mode.
fn invalid_reverts_are_refused(env: &TestEnv) {
    let base = json!({"nodeSelector": {"matchLabels": {"pool": "lc"}}, "mode": "nftables"});
    let cases = [
        (
            json!({"onRelease": "Revert"}),
            "spec.onRelease Revert needs spec.revertMode",
        ),
        (
            json!({"onRelease": "Revert", "revertMode": "nftables"}),
            "spec.revertMode must differ from spec.mode",
        ),
        (
            json!({"revertMode": "iptables"}),
            "apply only with spec.onRelease Revert",
        ),
        (
            json!({"onRelease": "Revert", "revertMode": "external"}),
            "Unsupported value: \"external\"",
        ),
    ];
    for (extra, message) in cases {
        let mut spec = base.clone();
        for (k, v) in extra.as_object().expect("object") {
            spec[k] = v.clone();
        }
        let body = policy_body("lc-invalid", &spec).to_string();
        let (ok, _, err) = env
            .cp
            .kubectl(&["apply", "--server-side", "-f", "-"], Some(&body))
            .expect("kubectl");
        assert!(!ok && err.contains(message), "{extra}: {err}");
    }
}

/// Revert: a policy deleted mid-rollout returns its switched nodes to iptables, then goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revert_policy_deleted_mid_rollout_returns_its_nodes_then_goes() {
    let _serial = SERIAL.lock().await;
    let (env, _servers, op) = setup().await;
    let admin = env.cp.admin_client().await.expect("admin");
    invalid_reverts_are_refused(&env);
    let explain = env
        .cp
        .kubectl_ok(&["explain", "proxypolicy.spec.onRelease"], None)
        .expect("explain");
    assert!(
        explain.contains("Revert") && explain.contains("revertMode"),
        "{explain}"
    );
    let name = "lc-revert";
    let hostname = |n: &str| json!({"matchLabels": {"kubernetes.io/hostname": n}});
    let spec = json!({
        "nodeSelector": {"matchLabels": {"pool": "lc"}}, "mode": "nftables",
        "onRelease": "Revert", "revertMode": "iptables", "revertTimeoutSeconds": 300,
        "rollout": {"waves": [
            {"name": "one", "nodes": 1, "nodeSelector": hostname("node-1")},
            {"name": "two", "nodes": 1, "nodeSelector": hostname("node-2")},
            {"name": "rest", "nodes": "100%", "requireApproval": true}], "maxUnavailable": 1},
        "healthGate": gate(),
    });
    env.cp
        .apply_json(&policy_body(name, &spec))
        .expect("apply policy");
    let p = until_policy(&env, &op, name, "two waves switched, rest awaits approval", |p| {
        wave_state(p, "two") == "Completed" && wave_state(p, "rest") == "AwaitingApproval"
    })
    .await;
    assert_eq!(p.finalizers(), [FINALIZER], "Revert gets the finalizer");
    for i in 0..2 {
        assert_eq!(
            ours(&env, i),
            (true, false),
            "node-{} on nftables before the delete",
            i + 1
        );
    }
    assert_eq!(ours(&env, 2), (false, true), "node-3 not switched yet");
    let generation = p.metadata.generation;
    Api::<ProxyPolicy>::all(admin.clone())
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete policy");
    let deleted = Instant::now();
    let p = until_policy(&env, &op, name, "Reverting", |p| {
        condition(p, "Reverting").is_some_and(|c| c.0 == "True")
    })
    .await;
    println!(
        "deleting (generation {generation:?} -> {:?}): {:?}",
        p.metadata.generation,
        condition(&p, "Reverting")
    );
    assert!(
        p.metadata.deletion_timestamp.is_some(),
        "the finalizer holds the object"
    );
    let mut spans = Vec::new();
    for i in 0..2 {
        let np = until_np(&env, &op, i, "back on iptables through the revert", |np| {
            reverted(np, name)
        })
        .await;
        spans.push(switch_span(&np).expect("switch times"));
        assert!(
            np.spec.health_gate.as_ref().is_some_and(|g| !g.probes.is_empty()),
            "under the policy's gate: {:?}",
            np.spec
        );
    }
    spans.sort();
    println!("revert switches (ms since epoch): {spans:?}");
    assert!(
        spans[0].1 <= spans[1].0,
        "one at a time (maxUnavailable 1): {spans:?}"
    );
    eventually(LIMIT, "the policy object is gone", || async {
        get_policy(&admin, name).await.is_none().then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&env, &op)));
    println!(
        "policy gone {:.1}s after the delete",
        deleted.elapsed().as_secs_f64()
    );
    for i in 0..3 {
        let np = until_np(&env, &op, i, "released", |np| {
            np.spec.policy.is_none() && np.annotations().contains_key(RELEASED)
        })
        .await;
        assert_eq!(np.spec.desired_mode, Some(ProxyMode::Iptables), "{:?}", np.spec);
        assert!(serving(&np, ProxyMode::Iptables), "{:?}", np.status);
    }
    throughout(Duration::from_secs(3), || async {
        for i in 0..3 {
            let got = ours(&env, i);
            if got != (false, true) || !answers(&env, i) {
                return Err(format!(
                    "{}: kernel {got:?}: want the SWY chains and no switchyard table, serving",
                    env.cluster.nodes[i].name
                ));
            }
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&env, &op)));
    let evs = until_event(&admin, &op, name, "Reverted").await;
    assert!(evs.iter().any(|(r, _)| r == "Reverting"), "{evs:?}");
    assert!(!evs.iter().any(|(r, _)| r == "RevertTimedOut"), "{evs:?}");
    println!(
        "policy events: {:?}",
        evs.iter().map(|e| &e.0).collect::<Vec<_>>()
    );
}

/// Revert, a node leaving the pool: node-1, relabelled out of a Ready pool on nftables, returns
/// to iptables under the policy's gate, then is released; the pool keeps nftables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_relabelled_out_of_a_revert_pool_returns_to_iptables_then_is_released() {
    let _serial = SERIAL.lock().await;
    let (env, _servers, op) = setup().await;
    let admin = env.cp.admin_client().await.expect("admin");
    let name = "lc-depart";
    let spec = json!({
        "nodeSelector": {"matchLabels": {"pool": "lc"}}, "mode": "nftables",
        "onRelease": "Revert", "revertMode": "iptables",
        "rollout": {"maxUnavailable": 3},
        "healthGate": gate(),
    });
    env.cp
        .apply_json(&policy_body(name, &spec))
        .expect("apply policy");
    until_policy(&env, &op, name, "ready on nftables", |p| {
        condition(p, "Ready").is_some_and(|c| c.0 == "True")
            && p.status.as_ref().is_some_and(|s| s.healthy_nodes == 3)
    })
    .await;
    relabel(&admin, "node-1", "elsewhere").await;
    let np = until_np(&env, &op, 0, "reverted, then released", |np| {
        reverted(np, name) && np.spec.policy.is_none() && np.annotations().contains_key(RELEASED)
    })
    .await;
    assert_eq!(np.spec.desired_mode, Some(ProxyMode::Iptables), "{:?}", np.spec);
    assert!(!np.labels().contains_key(POLICY_LABEL), "{:?}", np.labels());
    let evs = until_event(&admin, &op, "node-1", "Released").await;
    assert!(
        evs.iter().any(|(r, n)| r == "Reverting" && n.contains(name)),
        "{evs:?}"
    );
    let p = until_policy(&env, &op, name, "the pool is node-2 and node-3", |p| {
        p.status
            .as_ref()
            .is_some_and(|s| s.target_nodes == 2 && s.healthy_nodes == 2)
    })
    .await;
    assert_eq!(p.finalizers(), [FINALIZER]);
    throughout(Duration::from_secs(3), || async {
        let want = [(false, true), (true, false), (true, false)];
        for (i, w) in want.iter().enumerate() {
            let got = ours(&env, i);
            if got != *w || !answers(&env, i) {
                return Err(format!(
                    "{}: kernel {got:?}, want {w:?}, serving",
                    env.cluster.nodes[i].name
                ));
            }
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&env, &op)));
}
