//! The operator at fleet scale (issue 16 item 5): thousands of Nodes and NodeProxies in the real
//! apiserver, the agents played by a task that answers every NodeProxy spec change with the status
//! an agent writes after a successful switch (as `tests/bad_input.rs` plays them, but from a
//! watch), and a ProxyPolicy rolled out in waves of 10 %. The apiserver's audit log records the
//! operator's own requests only (a policy naming its service account), so requests per wave are
//! the operator's, not the played agents' or the benchmark's.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::PostParams,
    runtime::{WatchStreamExt, watcher},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{NodeProxy, ProxyPolicy, WaveState};

use super::sys;
use crate::{
    Error, Result,
    agent::{install_switchyard, register_node_proxy, write_agent_status},
    controlplane::ControlPlane,
    io_err,
    operator::Operator,
};

/// The operator's service account, the one user the audit policy logs.
const OPERATOR_USER: &str = "system:serviceaccount:switchyard-system:switchyard-operator";
const POLICY: &str = "fleet";

/// Options of the fleet run.
#[derive(Debug, Clone)]
pub struct FleetOpts {
    /// Nodes (each with its NodeProxy).
    pub nodes: usize,
    /// Waves (each takes 100 / waves percent of the pool).
    pub waves: usize,
    /// Requests in flight while loading and while playing agents.
    pub concurrency: usize,
    /// Idle window after the rollout in which the operator's CPU is measured (0: none).
    pub idle: Duration,
}

/// One wave as seen from outside.
#[derive(Debug, Clone, Default)]
pub struct WaveRun {
    /// Wave name.
    pub name: String,
    /// Nodes the plan put in it.
    pub nodes: usize,
    /// First to last NodeProxy spec write of the wave seen by the played agents.
    pub writes_span: Duration,
    /// Previous wave's completion (or the policy's creation) → this wave completed.
    pub duration: Duration,
    /// The operator's requests in that time, by `verb resource[/subresource]`.
    pub requests: BTreeMap<String, usize>,
}

/// What the fleet run measured.
#[derive(Debug, Clone, Default)]
pub struct FleetRun {
    /// Nodes.
    pub nodes: usize,
    /// Loading Nodes, NodeProxies and their first statuses.
    pub load: Duration,
    /// The waves.
    pub waves: Vec<WaveRun>,
    /// Policy created → phase Ready.
    pub rollout: Duration,
    /// Operator usage once its caches were filled (before the policy).
    pub before: sys::Usage,
    /// Operator usage when the rollout was Ready.
    pub after: sys::Usage,
    /// A new replica: start → leader, caches listed, policy reconciled, CPU flat again.
    pub resync_wall: Duration,
    /// That replica's CPU seconds for it.
    pub resync_cpu_s: f64,
    /// Its RSS then.
    pub resync_rss_mib: f64,
    /// Its requests during the resync.
    pub resync_requests: BTreeMap<String, usize>,
    /// Its CPU seconds over the idle window.
    pub idle_cpu_s: Option<f64>,
}

fn audit_policy(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("audit-policy.yaml");
    let text = format!(
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
         - level: Metadata\n  users: [\"{OPERATOR_USER}\"]\n- level: None\n"
    );
    std::fs::write(&path, text).map_err(io_err("audit policy"))?;
    Ok(path)
}

/// The operator's completed requests in the audit log so far, by `verb resource[/sub]`.
fn audit_counts(log: &Path) -> BTreeMap<String, usize> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut counts = BTreeMap::new();
    for event in text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()) {
        let stage = event["stage"].as_str().unwrap_or_default();
        let verb = event["verb"].as_str().unwrap_or_default();
        // A watch is counted once, when it starts.
        let counted =
            stage == "ResponseComplete" && verb != "watch" || stage == "ResponseStarted" && verb == "watch";
        if !counted {
            continue;
        }
        let r = &event["objectRef"];
        let mut key = format!("{verb} {}", r["resource"].as_str().unwrap_or("-"));
        if let Some(sub) = r["subresource"].as_str() {
            key = format!("{key}/{sub}");
        }
        *counts.entry(key).or_insert(0) += 1;
    }
    counts
}

fn minus(a: &BTreeMap<String, usize>, b: &BTreeMap<String, usize>) -> BTreeMap<String, usize> {
    a.iter()
        .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0).min(*v)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// The status an agent writes: running `active`, healthy, and (after a switch) its record.
fn agent_status(active: &str, last: Option<Value>) -> Value {
    let mut s = json!({
        "agentVersion": "bench",
        "capabilities": {
            "kernelVersion": "6.18.0-bench", "supportedModes": ["iptables", "nftables"],
            "nftables": {"usable": true}, "iptablesLegacy": {"usable": true}, "iptablesNft": {"usable": true},
            "ipvs": {"usable": false, "detail": "no module"}, "ipset": {"usable": true},
        },
        "activeMode": active,
        "phase": "Active",
        "sync": {"lastSyncMillis": 3, "services": 2, "endpoints": 4, "rules": 40},
        "probes": [{"target": "default/kubernetes:443", "ok": true, "detail": "10.0.0.1:6443"}],
        "conditions": [{"type": "Healthy", "status": "True", "reason": "GatePassed", "message": "ok", "lastTransitionTime": "2025-01-01T00:00:00Z"}],
    });
    if let Some(l) = last {
        s["lastSwitch"] = l;
    }
    s
}

/// Creates `nodes` Nodes `fleet-<i>` (label `pool=fleet`), their NodeProxies, and an agent
/// status running iptables.
async fn load_fleet(client: &Client, nodes: usize, concurrency: usize) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    futures::stream::iter(0..nodes)
        .map(|i| {
            let api = api.clone();
            async move {
                let name = format!("fleet-{i}");
                let node: Node =
                    serde_json::from_value(json!({"metadata": {"name": name, "labels": {"pool": "fleet"}}}))
                        .map_err(|e| Error::Prerequisite(e.to_string()))?;
                let node = api.create(&PostParams::default(), &node).await?;
                register_node_proxy(client, &name, &node.metadata.uid.unwrap_or_default()).await?;
                write_agent_status(client, &name, agent_status("iptables", None)).await
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// When the played agents first saw each node's spec ask for a switch.
type Seen = Arc<Mutex<HashMap<String, Instant>>>;

/// Plays every agent: a NodeProxy whose spec asks for a mode under a rollout token it has not
/// answered gets the status of a successful switch. Runs until aborted.
fn play_agents(client: Client, concurrency: usize, seen: Seen) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<NodeProxy> = Api::all(client.clone());
        let answered: Arc<Mutex<HashSet<(String, String)>>> = Arc::default();
        let stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .filter_map(|np| async move { np.ok() })
            .filter_map(|np: NodeProxy| {
                let answered = answered.clone();
                let seen = seen.clone();
                async move {
                    let name = np.metadata.name.clone()?;
                    let desired = np.spec.desired_mode?;
                    let token = np.spec.rollout_token.clone()?;
                    let status = np.status.as_ref()?;
                    let done = status.last_switch.as_ref().and_then(|l| l.rollout_token.clone())
                        == Some(token.clone());
                    if done || !lock(&answered).insert((name.clone(), token.clone())) {
                        return None;
                    }
                    lock(&seen).entry(name.clone()).or_insert_with(Instant::now);
                    Some((name, desired.as_str().to_owned(), token))
                }
            });
        stream
            .for_each_concurrent(concurrency, |(name, desired, token)| {
                let client = client.clone();
                async move {
                    let last = json!({
                        "from": "iptables", "to": desired, "result": "Succeeded", "reason": "switched",
                        "rolloutToken": token, "startedAt": "2025-01-01T00:00:00Z", "finishedAt": "2025-01-01T00:00:01Z",
                    });
                    // A failed write is retried by the next event of the object (the operator's).
                    let _ = write_agent_status(&client, &name, agent_status(&desired, Some(last))).await;
                }
            })
            .await;
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn policy(waves: usize) -> Value {
    let pct = (100 / waves.max(1)).max(1);
    let waves: Vec<Value> = (1..=waves)
        .map(|i| json!({"name": format!("w{i}"), "nodes": format!("{pct}%")}))
        .collect();
    json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": POLICY},
        "spec": {"nodeSelector": {"matchLabels": {"pool": "fleet"}}, "mode": "nftables",
                 "rollout": {"waves": waves, "maxUnavailable": format!("{pct}%")},
                 "healthGate": {"minHealthySeconds": 0, "timeoutSeconds": 900}}})
}

/// Waits until `pid`'s CPU time stops growing (less than 20 ms over 2 s); returns the usage.
async fn cpu_settled(pid: u32, limit: Duration) -> Result<sys::Usage> {
    let start = Instant::now();
    let mut last = sys::usage(pid)?;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = sys::usage(pid)?;
        if now.cpu_s - last.cpu_s < 0.02 || start.elapsed() > limit {
            return Ok(now);
        }
        last = now;
    }
}

async fn operator_pid(identity: &str) -> Result<u32> {
    let needle = format!("--identity {identity} ");
    crate::eventually(Duration::from_secs(30), "operator pid", || async {
        sys::pid_with_arg(&needle)
    })
    .await
}

/// A metric of the operator replica (sum over label sets), if it answers.
fn op_metric(op: &Operator, name: &str) -> Option<f64> {
    let (code, body) = op.get("/metrics")?;
    (code == 200).then(|| sys::counter(&body, &format!("switchyard_operator_{name}")))
}

/// Waits until `op` leads and has reconciled at least once more than `reconciles`.
async fn wait_reconciled(op: &Operator, reconciles: f64) -> Result<()> {
    crate::eventually(
        Duration::from_secs(300),
        "operator leads and reconciles",
        || async {
            let leads = op_metric(op, "leader")? >= 1.0;
            (leads && op_metric(op, "reconciles")? > reconciles).then_some(())
        },
    )
    .await
}

/// A wave seen completed: (name, its nodes, since the policy's creation, the audit counts then).
type Mark = (String, Vec<String>, Duration, BTreeMap<String, usize>);

/// Polls the policy every 250 ms until it is Ready, marking each wave when it is seen completed.
async fn follow_rollout(
    client: &Client,
    audit: &Path,
    t0: Instant,
    limit: Duration,
) -> Result<(Duration, Vec<Mark>)> {
    let api: Api<ProxyPolicy> = Api::all(client.clone());
    let mut marks: Vec<Mark> = Vec::new();
    loop {
        let status = api.get(POLICY).await?.status.unwrap_or_default();
        for w in &status.waves {
            if w.state == WaveState::Completed && !marks.iter().any(|m| m.0 == w.name) {
                marks.push((w.name.clone(), w.nodes.clone(), t0.elapsed(), audit_counts(audit)));
            }
        }
        let ready = status.phase == Some(switchyard_crds::v1alpha1::PolicyPhase::Ready);
        if ready && marks.len() == status.waves.len() {
            return Ok((t0.elapsed(), marks));
        }
        if t0.elapsed() > limit {
            return Err(Error::Timeout(
                limit,
                format!(
                    "rollout Ready: {} waves completed; phase {:?}",
                    marks.len(),
                    status.phase
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Per wave: duration and requests since the previous mark, and the span of its spec writes.
fn wave_runs(marks: &[Mark], base: &BTreeMap<String, usize>, seen: &Seen) -> Vec<WaveRun> {
    let seen = lock(seen);
    let mut prev = (Duration::ZERO, base.clone());
    let mut out = Vec::new();
    for (name, nodes, at, counts) in marks {
        let times: Vec<Instant> = nodes.iter().filter_map(|n| seen.get(n).copied()).collect();
        let span = match (times.iter().min(), times.iter().max()) {
            (Some(a), Some(b)) => b.duration_since(*a),
            _ => Duration::ZERO,
        };
        out.push(WaveRun {
            name: name.clone(),
            nodes: nodes.len(),
            writes_span: span,
            duration: at.saturating_sub(prev.0),
            requests: minus(counts, &prev.1),
        });
        prev = (*at, counts.clone());
    }
    out
}

/// Rolls a policy over `opts.nodes` played nodes in waves, then measures a new replica's resync.
pub async fn run_fleet(opts: &FleetOpts) -> Result<FleetRun> {
    let dir = tempfile::Builder::new()
        .prefix("swyt-fleet-audit")
        .tempdir()
        .map_err(io_err("audit dir"))?;
    let audit_log = dir.path().join("audit.log");
    let cp = ControlPlane::start_with(&[
        format!("--audit-policy-file={}", audit_policy(dir.path())?.display()),
        format!("--audit-log-path={}", audit_log.display()),
    ])
    .await?;
    install_switchyard(&cp)?;
    let client = cp.admin_client().await?;
    let t = Instant::now();
    load_fleet(&client, opts.nodes, opts.concurrency).await?;
    let load = t.elapsed();
    let seen: Seen = Arc::default();
    let agents = play_agents(client.clone(), opts.concurrency, seen.clone());
    let op = Operator::start(&cp, "bench-op-1", &[]).await?;
    let pid = operator_pid("bench-op-1").await?;
    wait_reconciled(&op, -1.0).await?;
    let before = cpu_settled(pid, Duration::from_secs(300)).await?;
    let base = audit_counts(&audit_log);
    let t0 = Instant::now();
    cp.kubectl_ok(&["create", "-f", "-"], Some(&policy(opts.waves).to_string()))?;
    let followed = follow_rollout(&client, &audit_log, t0, Duration::from_secs(3600)).await;
    agents.abort();
    let (rollout, marks) = followed?;
    let after = sys::usage(pid)?;
    let waves = wave_runs(&marks, &base, &seen);
    drop(op);
    let (mut run, op2) = resync(&cp, &audit_log).await?;
    if !opts.idle.is_zero() {
        let pid2 = operator_pid("bench-op-2").await?;
        let u0 = sys::usage(pid2)?;
        tokio::time::sleep(opts.idle).await;
        run.idle_cpu_s = Some(sys::usage(pid2)?.cpu_s - u0.cpu_s);
    }
    drop(op2);
    Ok(FleetRun {
        nodes: opts.nodes,
        load,
        waves,
        rollout,
        before,
        after,
        ..run
    })
}

/// A new replica takes over: start → leader, caches listed, the policy reconciled, CPU flat.
async fn resync(cp: &ControlPlane, audit_log: &Path) -> Result<(FleetRun, Operator)> {
    let base = audit_counts(audit_log);
    let t = Instant::now();
    let op = Operator::start(cp, "bench-op-2", &[]).await?;
    let pid = operator_pid("bench-op-2").await?;
    wait_reconciled(&op, 0.0).await?;
    let settled = cpu_settled(pid, Duration::from_secs(300)).await?;
    // The last 2 s window had (almost) no CPU: the resync ended before it.
    let wall = t.elapsed().saturating_sub(Duration::from_secs(2));
    let run = FleetRun {
        resync_wall: wall,
        resync_cpu_s: settled.cpu_s,
        resync_rss_mib: settled.rss_mib,
        resync_requests: minus(&audit_counts(audit_log), &base),
        ..FleetRun::default()
    };
    Ok((run, op))
}
