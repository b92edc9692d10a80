//! The operator under control-plane faults, on a real kube-apiserver and etcd, with its real RBAC
//! identity. The test plays the node agents (it writes NodeProxy status exactly as the agent
//! protocol says, with real timestamps), so the operator's own reaction is what is measured:
//!
//! - etcd and kube-apiserver SIGKILLed for 60 s while a wave is switching: both operator replicas
//!   stay up and report the outage on `/healthz` (so does a third one started during the outage);
//!   after the restart the wave's node reports
//!   success and the next wave must start within soak + 5 s of the API's return;
//! - etcd and kube-apiserver SIGSTOPped for 60 s while a wave soaks (requests hang instead of
//!   failing): the same, from SIGCONT;
//! - a ProxyPolicy deleted mid-rollout: its NodeProxies are released in their current modes, with an
//!   annotation, an Event each and a metric (see `switchyard_operator::planner::lifecycle`);
//! - a NodeProxy deleted mid-switch and re-created with an empty spec gets its spec back, health
//!   gate included.
//!
//! The tests run one at a time (a shared lock): the outage test measures time on a 2-core machine.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use k8s_openapi::api::{coordination::v1::Lease, core::v1::Node, events::v1::Event};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::{
    consts::POLICY_LABEL,
    v1alpha1::{NodeProxy, NodeProxySpec, PolicyPhase, ProxyMode, ProxyPolicy, ProxyPolicyStatus},
};
use switchyard_e2e::{
    agent::{SYSTEM_NAMESPACE, TestEnv, register_node_proxy, write_agent_status},
    eventually,
    operator::Operator,
};

/// Length of the control-plane outage (the issue's number).
const OUTAGE: Duration = Duration::from_secs(60);
/// Length of the hung (SIGSTOPped) control plane: long enough for the 6 s Lease to lapse.
const HANG: Duration = Duration::from_secs(60);
/// Soak of the wave that is switching when the control plane dies.
const SOAK_SECONDS: u64 = 3;
/// Generous bound for conditions that need no outage.
const LIMIT: Duration = Duration::from_secs(60);

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// An agent's status: `active` mode, `phase`, optional last switch.
fn agent_status(active: &str, phase: &str, last: Option<Value>) -> Value {
    let healthy = if phase == "Active" { "True" } else { "False" };
    let mut s = json!({
        "capabilities": {
            "kernelVersion": "6.18.0-test", "supportedModes": ["iptables", "nftables"],
            "nftables": {"usable": true}, "iptablesLegacy": {"usable": true}, "iptablesNft": {"usable": true},
            "ipvs": {"usable": false}, "ipset": {"usable": true},
        },
        "activeMode": active,
        "phase": phase,
        "conditions": [{"type": "Healthy", "status": healthy, "reason": if healthy == "True" { "GatePassed" } else { "Switching" },
                        "message": "test agent", "lastTransitionTime": now()}],
    });
    if let Some(l) = last {
        s["lastSwitch"] = l;
    }
    s
}

fn switched(from: &str, to: &str, result: &str, token: &str) -> Value {
    json!({"from": from, "to": to, "result": result, "reason": "test agent", "rolloutToken": token,
           "startedAt": now(), "finishedAt": now()})
}

/// Labels the nodes `pool=a` and registers an iptables agent status on each, as the agent would.
async fn setup_nodes(admin: &Client, names: &[String]) {
    let nodes: Api<Node> = Api::all(admin.clone());
    for node in names {
        nodes
            .patch(
                node,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"pool": "a"}}})),
            )
            .await
            .expect("label node");
        let uid = nodes.get(node).await.expect("node").uid().expect("uid");
        register_node_proxy(admin, node, &uid)
            .await
            .expect("register NodeProxy");
        write_agent_status(admin, node, agent_status("iptables", "Active", None))
            .await
            .expect("status");
    }
}

fn apply_policy(env: &TestEnv, name: &str, spec: Value) {
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": name}, "spec": spec});
    env.cp
        .kubectl_ok(
            &["apply", "--server-side", "--force-conflicts", "-f", "-"],
            Some(&body.to_string()),
        )
        .expect("apply policy");
}

async fn status(admin: &Client, name: &str) -> Option<ProxyPolicyStatus> {
    Api::<ProxyPolicy>::all(admin.clone())
        .get(name)
        .await
        .ok()
        .and_then(|p| p.status)
}

async fn nodeproxy(admin: &Client, name: &str) -> Option<NodeProxy> {
    Api::<NodeProxy>::all(admin.clone()).get(name).await.ok()
}

/// Waits until the NodeProxy `name` satisfies `ok`.
async fn wait_np(
    admin: &Client,
    name: &str,
    limit: Duration,
    what: &str,
    ok: impl Fn(&NodeProxy) -> bool,
) -> NodeProxy {
    let ok = &ok;
    eventually(limit, what, || async move {
        nodeproxy(admin, name).await.filter(|np| ok(np))
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}; NodeProxy {name}: {:#?}",
            futures::executor::block_on(nodeproxy(admin, name))
        )
    })
}

async fn wait_status(
    admin: &Client,
    name: &str,
    what: &str,
    ok: impl Fn(&ProxyPolicyStatus) -> bool,
) -> ProxyPolicyStatus {
    let ok = &ok;
    eventually(LIMIT, what, || async move {
        status(admin, name).await.filter(|s| ok(s))
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}; status: {:#?}",
            futures::executor::block_on(status(admin, name))
        )
    })
}

async fn lease_holder(admin: &Client) -> Option<String> {
    Api::<Lease>::namespaced(admin.clone(), SYSTEM_NAMESPACE)
        .get("switchyard-operator")
        .await
        .ok()?
        .spec?
        .holder_identity
        .filter(|h| !h.is_empty())
}

/// Events regarding `name` (a NodeProxy or a policy): (reason, note).
async fn events_of(admin: &Client, name: &str) -> Vec<(String, String)> {
    Api::<Event>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

/// Answers a switch request as a successful agent: the node runs the desired mode from now.
async fn answer(admin: &Client, np: &NodeProxy, result: &str) {
    let desired = np.spec.desired_mode.expect("desired mode");
    let token = np.spec.rollout_token.clone().expect("token");
    let from = np
        .status
        .as_ref()
        .and_then(|s| s.active_mode)
        .unwrap_or(ProxyMode::Iptables);
    let active = if result == "Succeeded" { desired } else { from };
    write_agent_status(
        admin,
        &np.name_any(),
        agent_status(
            active.as_str(),
            "Active",
            Some(switched(from.as_str(), desired.as_str(), result, &token)),
        ),
    )
    .await
    .expect("answer switch");
}

fn asked(np: &NodeProxy, mode: ProxyMode) -> bool {
    np.spec.desired_mode == Some(mode) && np.spec.rollout_token.is_some()
}

/// An operator replica started while the API is down, from a kubeconfig written before; killed on
/// drop.
struct LateOperator {
    child: std::process::Child,
    port: u16,
    log: std::path::PathBuf,
}

impl LateOperator {
    fn spawn(kubeconfig: &std::path::Path, log: std::path::PathBuf) -> Self {
        let port = switchyard_e2e::ports::free_loopback_port().expect("free port");
        let out = std::fs::File::create(&log).expect("log");
        let child = std::process::Command::new(
            switchyard_e2e::binaries::workspace_bin("switchyard-operator").expect("operator binary"),
        )
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--namespace", SYSTEM_NAMESPACE, "--identity", "op-late"])
        .args(["--lease-duration-seconds", "6", "--lease-grace-seconds", "2"])
        .args(["--healthz-bind-address", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "info")
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .spawn()
        .expect("start operator");
        Self { child, port, log }
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn healthz(&self) -> Option<String> {
        use std::io::{Read, Write};
        let mut s =
            std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], self.port).into(), Duration::from_secs(2))
                .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(s, "GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        Some(text)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LateOperator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn gate() -> Value {
    json!({"minHealthySeconds": 7, "timeoutSeconds": 45, "failureThreshold": 4, "probes": [{"namespace": "default", "name": "web"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_plane_killed_mid_wave_next_wave_within_soak_plus_5s() {
    let _serial = SERIAL.lock().await;
    let mut env = TestEnv::start(3, 0).await.expect("control plane and 3 nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let names: Vec<String> = env.cluster.nodes.iter().map(|n| n.name.clone()).collect();
    setup_nodes(&admin, &names).await;
    let mut ops = [
        Operator::start(&env.cp, "op-a", &[]).await.expect("operator a"),
        Operator::start(&env.cp, "op-b", &[]).await.expect("operator b"),
    ];
    eventually(LIMIT, "a leader", || lease_holder(&admin))
        .await
        .expect("leader");
    apply_policy(
        &env,
        "pool-a",
        json!({"nodeSelector": {"matchLabels": {"pool": "a"}}, "mode": "nftables",
               "rollout": {"waves": [{"name": "one", "nodes": 1, "soakSeconds": SOAK_SECONDS},
                                     {"name": "two", "nodes": 1, "soakSeconds": SOAK_SECONDS},
                                     {"name": "rest", "nodes": "100%"}], "maxUnavailable": 1},
               "healthGate": gate()}),
    );
    let s = wait_status(&admin, "pool-a", "wave one progressing", |s| {
        s.current_wave.as_deref() == Some("one") && s.waves.len() == 3
    })
    .await;
    let (first, second) = (s.waves[0].nodes[0].clone(), s.waves[1].nodes[0].clone());
    let np = wait_np(&admin, &first, LIMIT, "wave one's node asked to switch", |np| {
        asked(np, ProxyMode::Nftables)
    })
    .await;
    // The agent is verifying its switch when the control plane dies.
    write_agent_status(&admin, &first, agent_status("nftables", "Verifying", None))
        .await
        .expect("verifying");

    // A third replica will start in the middle of the outage (its credentials are issued now).
    let token = env
        .cp
        .service_account_token(SYSTEM_NAMESPACE, "switchyard-operator", None)
        .await
        .expect("token");
    let late_kubeconfig = env
        .cp
        .write_kubeconfig(
            "operator-late",
            &format!("https://127.0.0.1:{}", env.cp.port),
            switchyard_e2e::controlplane::Credential::Token(token),
        )
        .expect("kubeconfig");
    let mut late: Option<LateOperator> = None;
    let mut late_reported = false;

    let killed = env.cp.kill_processes().expect("kill etcd and kube-apiserver");
    println!("control plane SIGKILLed; outage of {OUTAGE:?}");
    // Observed during the outage, asserted after the measurement (which comes first).
    let mut reported = [false, false];
    let mut exited: Vec<String> = Vec::new();
    let mut bad_codes: Vec<String> = Vec::new();
    while killed.at.elapsed() < OUTAGE {
        if late.is_none() && killed.at.elapsed() > Duration::from_secs(10) {
            late = Some(LateOperator::spawn(
                &late_kubeconfig,
                env.cp.dir().join("operator-late.log"),
            ));
        }
        if let Some(l) = late.as_mut() {
            if !l.running() && !exited.iter().any(|e| e == "op-late") {
                exited.push("op-late".into());
            }
            late_reported |= l
                .healthz()
                .is_some_and(|t| t.contains("200 OK") && t.contains("unreachable"));
        }
        for (i, op) in ops.iter_mut().enumerate() {
            if !op.running() && !exited.contains(&op.identity) {
                exited.push(op.identity.clone());
            }
            if let Some((code, body)) = op.get("/healthz") {
                if code != 200 {
                    bad_codes.push(format!("{}: {code} {body}", op.identity));
                }
                reported[i] |= body.contains("unreachable");
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let metrics = ops[0].get("/metrics").map(|m| m.1).unwrap_or_default();
    let back = env
        .cp
        .restart_processes(killed)
        .await
        .expect("restart the control plane");
    println!("control plane back (readyz ok)");

    // The switch finished; the agent reports as soon as the API answers.
    let admin = env.cp.admin_client().await.expect("admin");
    answer(&admin, &np, "Succeeded").await;
    let reported_at = back.elapsed();
    // Waits long (the assertion below is the bound), so a slow resume is measured, not cut off.
    let next = wait_np(
        &admin,
        &second,
        Duration::from_secs(120),
        "wave two starts",
        |np| asked(np, ProxyMode::Nftables),
    )
    .await;
    let took = back.elapsed();
    println!(
        "next wave started {:.1}s after the API returned (agent report at {:.1}s, soak {SOAK_SECONDS}s, bound {}s)",
        took.as_secs_f64(),
        reported_at.as_secs_f64(),
        SOAK_SECONDS + 5
    );
    let late_log = late.as_ref().map(LateOperator::log_text).unwrap_or_default();
    assert!(
        exited.is_empty(),
        "exited during the outage: {exited:?}; the late replica's log:\n{late_log}"
    );
    assert!(
        late_reported,
        "a replica started during the outage reports it: {late_log}"
    );
    assert!(bad_codes.is_empty(), "/healthz during the outage: {bad_codes:?}");
    assert_eq!(
        reported,
        [true, true],
        "both replicas report the outage on /healthz"
    );
    assert!(
        metrics.contains("switchyard_operator_api_reachable 0"),
        "{metrics}"
    );
    let logs: Vec<String> = ops.iter().map(|o| o.log_text()).collect();
    assert!(
        took <= Duration::from_secs(SOAK_SECONDS + 5),
        "the next wave started {took:?} after the API returned; soak {SOAK_SECONDS}s; logs:\n{}",
        logs.join("\n----\n")
    );
    for op in ops.iter_mut() {
        assert!(op.running(), "{} exited:\n{}", op.identity, op.log_text());
    }
    let mut late = late.expect("late replica");
    assert!(late.running(), "the late replica exited:\n{}", late.log_text());
    eventually(LIMIT, "late replica sees the API", || async {
        late.healthz()
            .filter(|t| t.contains("200 OK") && !t.contains("unreachable"))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", late.log_text()));
    let holder = eventually(LIMIT, "a leader again", || lease_holder(&admin))
        .await
        .expect("leader");
    println!("leader after the outage: {holder}");
    eventually(LIMIT, "healthz recovered", || async {
        ops.iter()
            .all(|op| {
                op.get("/healthz")
                    .is_some_and(|(c, b)| c == 200 && !b.contains("unreachable"))
            })
            .then_some(())
    })
    .await
    .expect("both replicas healthy again");

    // The rest of the rollout completes.
    answer(&admin, &next, "Succeeded").await;
    let rest = &names
        .iter()
        .find(|n| **n != first && **n != second)
        .expect("third node")
        .clone();
    let np = wait_np(&admin, rest, LIMIT, "wave rest starts", |np| {
        asked(np, ProxyMode::Nftables)
    })
    .await;
    answer(&admin, &np, "Succeeded").await;
    let s = wait_status(&admin, "pool-a", "Ready", |s| s.phase == Some(PolicyPhase::Ready)).await;
    assert_eq!((s.target_nodes, s.updated_nodes, s.healthy_nodes), (3, 3, 3));
    let lead = ops.iter().find(|o| o.identity == holder).expect("leader replica");
    assert!(
        lead.log_text().contains("acquired the Lease"),
        "{}",
        lead.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn policy_deleted_mid_rollout_releases_nodes_in_their_current_mode() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::start(4, 0).await.expect("control plane and 4 nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let names: Vec<String> = env.cluster.nodes.iter().map(|n| n.name.clone()).collect();
    setup_nodes(&admin, &names).await;
    let op = Operator::start(&env.cp, "op-a", &[]).await.expect("operator");
    apply_policy(
        &env,
        "pool-a",
        json!({"nodeSelector": {"matchLabels": {"pool": "a"}}, "mode": "nftables",
               "rollout": {"waves": [{"name": "one", "nodes": 1}, {"name": "rest", "nodes": "100%"}], "maxUnavailable": 1},
               "healthGate": gate()}),
    );
    let s = wait_status(&admin, "pool-a", "plan", |s| s.waves.len() == 2).await;
    let done = s.waves[0].nodes[0].clone();
    let np = wait_np(&admin, &done, LIMIT, "wave one asked", |np| {
        asked(np, ProxyMode::Nftables)
    })
    .await;
    answer(&admin, &np, "Succeeded").await;
    // Wave rest: one node at a time (maxUnavailable 1); that one is mid-switch when the policy goes.
    let busy = eventually(LIMIT, "a wave-rest node asked", || async {
        for n in &s.waves[1].nodes {
            if nodeproxy(&admin, n)
                .await
                .is_some_and(|np| asked(&np, ProxyMode::Nftables))
            {
                return Some(n.clone());
            }
        }
        None
    })
    .await
    .expect("wave rest started");
    write_agent_status(&admin, &busy, agent_status("iptables", "Verifying", None))
        .await
        .expect("verifying");
    let before: BTreeMap<String, NodeProxySpec> = {
        let mut m = BTreeMap::new();
        for n in &names {
            m.insert(n.clone(), nodeproxy(&admin, n).await.expect("np").spec);
        }
        m
    };
    Api::<ProxyPolicy>::all(admin.clone())
        .delete("pool-a", &DeleteParams::default())
        .await
        .expect("delete policy");
    let deleted = Instant::now();

    for n in &names {
        wait_np(&admin, n, LIMIT, "released", |np| {
            np.spec.policy.is_none()
                && !np.labels().contains_key(POLICY_LABEL)
                && np.annotations().contains_key("switchyard.dev/released-from")
        })
        .await;
    }
    println!(
        "all 4 NodeProxies released {:.1}s after the delete",
        deleted.elapsed().as_secs_f64()
    );
    let mut after = BTreeMap::new();
    for n in &names {
        after.insert(n.clone(), nodeproxy(&admin, n).await.expect("np"));
    }
    for (n, np) in &after {
        let active = np.status.as_ref().and_then(|s| s.active_mode);
        if *n == busy {
            // In flight: the running switch keeps its own spec and gate.
            assert_eq!(np.spec.desired_mode, before[n].desired_mode, "{n}");
            assert_eq!(np.spec.rollout_token, before[n].rollout_token, "{n}");
            assert_eq!(
                np.spec.health_gate, before[n].health_gate,
                "{n}: the running switch keeps its gate"
            );
        } else {
            assert_eq!(
                np.spec.desired_mode, active,
                "{n}: desired is what it runs: {:?}",
                np.spec
            );
            if before[n].rollout_token.is_none() {
                assert_eq!(np.spec.rollout_token, None, "{n}: no new switch");
            }
        }
        let note = &np.annotations()["switchyard.dev/released-from"];
        assert!(
            note.contains("proxypolicy pool-a") && note.contains("was deleted"),
            "{note}"
        );
    }
    assert_eq!(
        after[&done].spec.desired_mode,
        Some(ProxyMode::Nftables),
        "the switched node keeps nftables"
    );
    // The in-flight switch rolls back on its own; the node then settles on what it runs.
    let np = after[&busy].clone();
    answer(&admin, &np, "RolledBack").await;
    wait_np(&admin, &busy, LIMIT, "settled on iptables", |np| {
        np.spec.desired_mode == Some(ProxyMode::Iptables) && np.spec.policy.is_none()
    })
    .await;
    for n in &names {
        let evs = eventually(LIMIT, "Released event", || async {
            let e = events_of(&admin, n).await;
            e.iter().any(|(r, _)| r == "Released").then_some(e)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}: {n}"));
        assert!(evs.iter().any(|(_, note)| note.contains("pool-a")), "{evs:?}");
    }
    let metrics = op.get("/metrics").map(|m| m.1).unwrap_or_default();
    assert!(
        metrics.contains("switchyard_operator_ungoverned_nodes 4"),
        "{metrics}"
    );
    assert!(
        !metrics.contains(r#"policy="pool-a""#),
        "no counts for a deleted policy: {metrics}"
    );
    let table = env
        .cp
        .kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)
        .expect("get");
    println!("{table}");
    // Nothing more is written once settled: the fleet stays as it is.
    let settled: Vec<Option<String>> = {
        let mut v = Vec::new();
        for n in &names {
            v.push(
                nodeproxy(&admin, n)
                    .await
                    .and_then(|np| np.metadata.resource_version),
            );
        }
        v
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (n, rv) in names.iter().zip(settled) {
        assert_eq!(
            nodeproxy(&admin, n)
                .await
                .and_then(|np| np.metadata.resource_version),
            rv,
            "{n} rewritten"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodeproxy_deleted_mid_switch_gets_its_spec_back() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::start(2, 0).await.expect("control plane and 2 nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let names: Vec<String> = env.cluster.nodes.iter().map(|n| n.name.clone()).collect();
    setup_nodes(&admin, &names).await;
    let op = Operator::start(&env.cp, "op-a", &[]).await.expect("operator");
    apply_policy(
        &env,
        "pool-a",
        json!({"nodeSelector": {"matchLabels": {"pool": "a"}}, "mode": "nftables",
               "rollout": {"waves": [{"name": "all", "nodes": "100%"}], "maxUnavailable": 1},
               "healthGate": gate()}),
    );
    let s = wait_status(&admin, "pool-a", "plan", |s| s.waves.len() == 1).await;
    let node = eventually(LIMIT, "a node asked", || async {
        for n in &s.waves[0].nodes {
            if let Some(np) = nodeproxy(&admin, n)
                .await
                .filter(|np| asked(np, ProxyMode::Nftables))
            {
                return Some(np);
            }
        }
        None
    })
    .await
    .expect("a node asked to switch");
    let name = node.name_any();
    write_agent_status(&admin, &name, agent_status("iptables", "Verifying", None))
        .await
        .expect("verifying");
    assert!(
        node.spec
            .health_gate
            .as_ref()
            .is_some_and(|g| g.min_healthy_seconds == 7)
    );

    // Deleted under the agent, which registers it again with an empty spec and reports its switch.
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    proxies
        .delete(&name, &DeleteParams::default())
        .await
        .expect("delete NodeProxy");
    eventually(LIMIT, "gone", || async {
        nodeproxy(&admin, &name).await.is_none().then_some(())
    })
    .await
    .expect("deleted");
    let node_uid = Api::<Node>::all(admin.clone())
        .get(&name)
        .await
        .expect("node")
        .uid()
        .expect("uid");
    register_node_proxy(&admin, &name, &node_uid)
        .await
        .expect("re-create as the agent does");
    let recreated = Instant::now();
    write_agent_status(&admin, &name, agent_status("iptables", "Verifying", None))
        .await
        .expect("status");
    let restored = wait_np(&admin, &name, LIMIT, "spec restored", |np| {
        np.uid() != node.uid() && np.spec == node.spec
    })
    .await;
    println!(
        "re-created NodeProxy got its spec back {:.1}s after the re-create",
        recreated.elapsed().as_secs_f64()
    );
    assert_eq!(
        restored.labels().get(POLICY_LABEL).map(String::as_str),
        Some("pool-a")
    );
    let evs = eventually(LIMIT, "SpecRestored event", || async {
        let e = events_of(&admin, &name).await;
        e.iter().any(|(r, _)| r == "SpecRestored").then_some(e)
    })
    .await
    .expect("event");
    assert!(
        evs.iter().any(|(_, n)| n.contains("minHealthySeconds")),
        "{evs:?}"
    );

    // The switch completes; the rollout goes on to the other node and finishes.
    answer(&admin, &restored, "Succeeded").await;
    let other = names.iter().find(|n| **n != name).expect("other").clone();
    let np = wait_np(&admin, &other, LIMIT, "other node asked", |np| {
        asked(np, ProxyMode::Nftables)
    })
    .await;
    answer(&admin, &np, "Succeeded").await;
    let s = wait_status(&admin, "pool-a", "Ready", |s| s.phase == Some(PolicyPhase::Ready)).await;
    assert_eq!((s.updated_nodes, s.healthy_nodes), (2, 2));
    assert!(op.log_text().contains("restored its spec"), "{}", op.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_plane_hung_mid_soak_next_wave_within_soak_plus_5s() {
    let _serial = SERIAL.lock().await;
    let mut env = TestEnv::start(2, 0).await.expect("control plane and 2 nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let names: Vec<String> = env.cluster.nodes.iter().map(|n| n.name.clone()).collect();
    setup_nodes(&admin, &names).await;
    let mut ops = [
        Operator::start(&env.cp, "op-a", &[]).await.expect("operator a"),
        Operator::start(&env.cp, "op-b", &[]).await.expect("operator b"),
    ];
    apply_policy(
        &env,
        "pool-a",
        json!({"nodeSelector": {"matchLabels": {"pool": "a"}}, "mode": "nftables",
               "rollout": {"waves": [{"name": "one", "nodes": 1, "soakSeconds": SOAK_SECONDS},
                                     {"name": "two", "nodes": "100%"}], "maxUnavailable": 1},
               "healthGate": gate()}),
    );
    let s = wait_status(&admin, "pool-a", "plan", |s| s.waves.len() == 2).await;
    let (first, second) = (s.waves[0].nodes[0].clone(), s.waves[1].nodes[0].clone());
    let np = wait_np(&admin, &first, LIMIT, "wave one asked", |np| {
        asked(np, ProxyMode::Nftables)
    })
    .await;
    answer(&admin, &np, "Succeeded").await;
    wait_status(&admin, "pool-a", "wave one soaking", |s| {
        s.waves[0].state == switchyard_crds::v1alpha1::WaveState::Soaking
    })
    .await;

    env.cp.stop_processes();
    let stopped = Instant::now();
    println!("control plane SIGSTOPped for {HANG:?}");
    let mut reported = [false, false];
    while stopped.elapsed() < HANG {
        for (i, op) in ops.iter_mut().enumerate() {
            assert!(
                op.running(),
                "{} exited while the API hung:\n{}",
                op.identity,
                op.log_text()
            );
            if let Some((code, body)) = op.get("/healthz") {
                assert_eq!(code, 200, "{}: {body}", op.identity);
                reported[i] |= body.contains("unreachable");
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        reported,
        [true, true],
        "both replicas report the hung API on /healthz"
    );
    let back = env
        .cp
        .continue_processes()
        .await
        .expect("SIGCONT the control plane");
    let admin = env.cp.admin_client().await.expect("admin");
    wait_np(
        &admin,
        &second,
        Duration::from_secs(SOAK_SECONDS + 60),
        "wave two starts",
        |np| asked(np, ProxyMode::Nftables),
    )
    .await;
    let took = back.elapsed();
    println!(
        "next wave started {:.1}s after the hung API resumed (soak {SOAK_SECONDS}s, ended while it hung; bound {}s)",
        took.as_secs_f64(),
        SOAK_SECONDS + 5
    );
    let logs: Vec<String> = ops.iter().map(|o| o.log_text()).collect();
    assert!(
        took <= Duration::from_secs(SOAK_SECONDS + 5),
        "the next wave started {took:?} after the API resumed; logs:\n{}",
        logs.join("\n----\n")
    );
    for op in ops.iter_mut() {
        assert!(op.running(), "{} exited:\n{}", op.identity, op.log_text());
    }
}
