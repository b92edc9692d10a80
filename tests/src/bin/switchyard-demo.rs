//! The local demo: a real etcd + kube-apiserver, Switchyard's CRDs and RBAC, five
//! network-namespace nodes (pools `general` ×4 and `edge` ×1) each running `switchyard-agent` in
//! iptables mode, the operator, a `web` Service with an echo server on every node, steady client
//! traffic from every node, and `config/samples/demo-rollout.yaml` applied: a live view shows the
//! waves progressing, each node's mode and switch phase, and the traffic counters until the
//! rollout is done. Keeps running until Ctrl-C, then removes everything it created.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::json;
use switchyard_crds::v1alpha1::{NodeProxy, ProxyPolicy};
use switchyard_e2e::{
    Error, Result,
    agent::TestEnv,
    binaries,
    objects::{Ep, apply_service, apply_slice},
    operator::Operator,
    traffic::start_server,
};

const POOLS: [&str; 5] = ["general", "general", "general", "general", "edge"];
const POLICY: &str = "demo-general-to-nftables";

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("switchyard-demo: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Counts answered and failed connections of one background client.
struct Counter {
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    child: std::process::Child,
}

impl Drop for Counter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client(netns: &str) -> Result<Counter> {
    let bin = binaries::workspace_bin("swy-echo")?;
    let mut child = Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(bin)
        .args([
            "client",
            "--target",
            "10.96.0.100:80",
            "--proto",
            "tcp",
            "--count",
            "100000",
            "--timeout-ms",
            "1000",
            "--interval-ms",
            "50",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| Error::Prerequisite(format!("start client: {e}")))?;
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    if let Some(out) = child.stdout.take() {
        let (ok, failed) = (ok.clone(), failed.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(std::result::Result::ok) {
                let counter = if line.starts_with("ok ") { &ok } else { &failed };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    Ok(Counter { ok, failed, child })
}

async fn run() -> Result<()> {
    println!(
        "starting etcd + kube-apiserver, installing CRDs and RBAC, creating {} namespace nodes ...",
        POOLS.len()
    );
    let mut env = TestEnv::start(POOLS.len(), 2).await?;
    let admin = env.cp.admin_client().await?;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    for (node, pool) in env.cluster.nodes.iter().zip(POOLS) {
        nodes
            .patch(
                &node.name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"labels": {"pool": pool}}})),
            )
            .await?;
    }
    let _servers: Vec<_> = env
        .cluster
        .nodes
        .iter()
        .map(|n| start_server(&n.pods[0], &[8080], &[]))
        .collect::<Result<_>>()?;
    apply_service(
        &admin,
        "web",
        json!({"clusterIP": "10.96.0.100", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        None,
    )
    .await?;
    let eps: Vec<Ep> = env
        .cluster
        .nodes
        .iter()
        .map(|n| Ep::ready(n.pods[0].ip, &n.name))
        .collect();
    apply_slice(&admin, "web", &[("http", 8080, "TCP")], &eps).await?;
    env.start_agents(&[
        "--mode",
        "iptables",
        "--cluster-cidr",
        "10.244.0.0/16",
        "--min-sync-period",
        "0.2",
    ])
    .await?;
    let _operator = Operator::start(&env.cp, "demo", &[]).await?;
    // Let the agents program iptables before the traffic starts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let counters: Vec<Counter> = env
        .cluster
        .nodes
        .iter()
        .map(|n| client(&n.pods[1].netns))
        .collect::<Result<_>>()?;
    let sample = binaries::workspace_root().join("config/samples/demo-rollout.yaml");
    env.cp
        .kubectl_ok(&["apply", "-f", &sample.display().to_string()], None)?;
    println!("applied {}", sample.display());

    let policies: Api<ProxyPolicy> = Api::all(admin.clone());
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    let started = Instant::now();
    let mut done_at: Option<Instant> = None;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::Prerequisite(e.to_string()))?;
    loop {
        let p = policies.get(POLICY).await?;
        let status = p.status.clone().unwrap_or_default();
        let waves: Vec<String> = status
            .waves
            .iter()
            .map(|w| format!("{}[{}]={:?}", w.name, w.nodes.join(","), w.state))
            .collect();
        let mut lines = vec![format!(
            "t={:>4.0}s  policy {POLICY}: {:?}  nodes {} updated {} healthy {}  waves: {}",
            started.elapsed().as_secs_f64(),
            status.phase,
            status.target_nodes,
            status.updated_nodes,
            status.healthy_nodes,
            waves.join("  ")
        )];
        for (n, c) in env.cluster.nodes.iter().zip(&counters) {
            let np = proxies.get(&n.name).await.ok();
            let st = np.as_ref().and_then(|np| np.status.clone()).unwrap_or_default();
            let desired = np.and_then(|np| np.spec.desired_mode);
            lines.push(format!(
                "    {:<7} {:<8} desired {:<9} active {:<9} phase {:<12} traffic ok {:>5} failed {}",
                n.name,
                POOLS[lines.len() - 1],
                desired.map(|m| m.to_string()).unwrap_or_else(|| "-".into()),
                st.active_mode
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "-".into()),
                st.phase.map(|p| format!("{p:?}")).unwrap_or_else(|| "-".into()),
                c.ok.load(Ordering::Relaxed),
                c.failed.load(Ordering::Relaxed),
            ));
        }
        println!("{}\n", lines.join("\n"));
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            && status.observed_generation == p.metadata.generation;
        if ready && done_at.is_none() {
            done_at = Some(Instant::now());
            println!("rollout complete in {:.0}s.", started.elapsed().as_secs_f64());
            println!("{}", env.cp.kubectl_ok(&["get", "proxypolicies"], None)?);
            println!(
                "{}",
                env.cp.kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)?
            );
            println!("Traffic keeps running. In another shell:");
            let (k, kc) = (env.cp.bin.join("kubectl"), env.cp.admin_kubeconfig());
            println!(
                "  {} --kubeconfig {} get proxypolicies,nodeproxies -o wide",
                k.display(),
                kc.display()
            );
            println!(
                "  {} --kubeconfig {} describe proxypolicy {POLICY}",
                k.display(),
                kc.display()
            );
            println!("Press Ctrl-C to stop and clean up.");
        }
        let pause = if done_at.is_some() {
            Duration::from_secs(30)
        } else {
            Duration::from_secs(2)
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = tokio::signal::ctrl_c() => break,
            _ = terminate.recv() => break,
        }
    }
    println!("stopping clients, agents and operator, deleting namespaces, stopping the control plane ...");
    drop(counters);
    drop(env);
    Ok(())
}
