//! The local demo of Switchyard as it ships: a real control plane (etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler) and five kubelet nodes (containerd + kubelet in network
//! namespaces; pools `general` ×4 and `edge` ×1) with no kube-proxy; the Helm chart installed with
//! the images `scripts/build-images.sh` built (the agent DaemonSet in iptables mode, the operator
//! Deployment), a `web` Deployment of echo servers behind a Service, a client Pod on every node
//! connecting to it through its ClusterIP, and `config/samples/demo-rollout.yaml` applied: a live
//! view shows the waves moving the pool to nftables, each node's mode and switch phase, and the
//! traffic counters. Keeps running until Ctrl-C, then removes everything it created.
//!
//! `--processes`: the faster development variant — the agents and the operator as processes in
//! namespace nodes, no kubelets or images.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

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
    let processes = std::env::args().any(|a| a == "--processes");
    let result = if processes {
        run().await
    } else {
        kubelets::run().await
    };
    match result {
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
    let child = Command::new("ip")
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
    Ok(Counter::of(child))
}

impl Counter {
    /// Counts the `ok` and other lines `child` prints (one per attempt of `swy-echo client`).
    fn of(mut child: std::process::Child) -> Self {
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
        Self { ok, failed, child }
    }
}

/// One node's line in the live view.
struct NodeRow<'a> {
    name: &'a str,
    pool: &'a str,
    ok: usize,
    failed: usize,
}

/// Prints the policy's progress and one line per node; returns whether the rollout is complete.
async fn show(
    policies: &Api<ProxyPolicy>,
    proxies: &Api<NodeProxy>,
    started: Instant,
    rows: &[NodeRow<'_>],
) -> Result<bool> {
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
    for row in rows {
        let np = proxies.get(row.name).await.ok();
        let st = np.as_ref().and_then(|np| np.status.clone()).unwrap_or_default();
        let desired = np.and_then(|np| np.spec.desired_mode);
        lines.push(format!(
            "    {:<7} {:<8} desired {:<9} active {:<9} phase {:<12} traffic ok {:>5} failed {}",
            row.name,
            row.pool,
            desired.map(|m| m.to_string()).unwrap_or_else(|| "-".into()),
            st.active_mode
                .map(|m| m.to_string())
                .unwrap_or_else(|| "-".into()),
            st.phase.map(|p| format!("{p:?}")).unwrap_or_else(|| "-".into()),
            row.ok,
            row.failed,
        ));
    }
    println!("{}\n", lines.join("\n"));
    Ok(status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
        && status.observed_generation == p.metadata.generation)
}

/// The live view until Ctrl-C (or SIGTERM): every 2 s while the rollout runs, then every 30 s,
/// with the printer columns and some commands to try once it is Ready.
async fn live_view<'a>(
    admin: &kube::Client,
    cp: &switchyard_e2e::controlplane::ControlPlane,
    rows: impl Fn() -> Vec<NodeRow<'a>>,
) -> Result<()> {
    let policies: Api<ProxyPolicy> = Api::all(admin.clone());
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    let started = Instant::now();
    let mut done_at: Option<Instant> = None;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::Prerequisite(e.to_string()))?;
    loop {
        let ready = show(&policies, &proxies, started, &rows()).await?;
        if ready && done_at.is_none() {
            done_at = Some(Instant::now());
            println!("rollout complete in {:.0}s.", started.elapsed().as_secs_f64());
            println!("{}", cp.kubectl_ok(&["get", "proxypolicies"], None)?);
            println!("{}", cp.kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)?);
            print_hints(cp);
        }
        let pause = if done_at.is_some() {
            Duration::from_secs(30)
        } else {
            Duration::from_secs(2)
        };
        if pause_or_stop(pause, &mut terminate).await {
            return Ok(());
        }
    }
}

/// Waits `pause` or a stop signal; returns whether to stop.
async fn pause_or_stop(pause: Duration, terminate: &mut tokio::signal::unix::Signal) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(pause) => false,
        _ = tokio::signal::ctrl_c() => true,
        _ = terminate.recv() => true,
    }
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

    live_view(&admin, &env.cp, || {
        env.cluster
            .nodes
            .iter()
            .zip(&counters)
            .zip(POOLS)
            .map(|((n, c), pool)| NodeRow {
                name: &n.name,
                pool,
                ok: c.ok.load(Ordering::Relaxed),
                failed: c.failed.load(Ordering::Relaxed),
            })
            .collect()
    })
    .await?;
    println!("stopping clients, agents and operator, deleting namespaces, stopping the control plane ...");
    drop(counters);
    drop(env);
    Ok(())
}

fn print_hints(cp: &switchyard_e2e::controlplane::ControlPlane) {
    println!("Traffic keeps running. In another shell:");
    let (k, kc) = (cp.bin.join("kubectl"), cp.admin_kubeconfig());
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
    println!(
        "  {} --kubeconfig {} get pods -A -o wide",
        k.display(),
        kc.display()
    );
    println!("Press Ctrl-C to stop and clean up.");
}

/// The demo on kubelet nodes with the chart and the built images.
mod kubelets {
    use super::*;
    use switchyard_e2e::{cluster::KubeletCluster, images};

    const WEB_IP: &str = "10.96.0.100";

    fn workloads(testbox: &str) -> String {
        format!(
            r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: default}}
spec:
  replicas: 5
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      terminationGracePeriodSeconds: 1
      topologySpreadConstraints:
      - {{maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: ScheduleAnyway, labelSelector: {{matchLabels: {{app: web}}}}}}
      containers:
      - name: echo
        image: {testbox}
        imagePullPolicy: IfNotPresent
        command: ["swy-echo", "serve", "--name", "$(POD_NAME)", "--tcp", "8080"]
        env:
        - name: POD_NAME
          valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
        ports: [{{name: http, containerPort: 8080}}]
        readinessProbe:
          tcpSocket: {{port: 8080}}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  clusterIP: {WEB_IP}
  selector: {{app: web}}
  ports: [{{name: http, port: 80, targetPort: 8080}}]
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {{name: demo-client, namespace: default}}
spec:
  selector: {{matchLabels: {{app: demo-client}}}}
  template:
    metadata: {{labels: {{app: demo-client}}}}
    spec:
      terminationGracePeriodSeconds: 1
      initContainers:
      # Count from the moment the node's agent serves the Service.
      - name: wait-for-web
        image: {testbox}
        imagePullPolicy: IfNotPresent
        command: ["sh", "-c", "until swy-echo client --target {WEB_IP}:80 --proto tcp --count 1 | grep -q '^ok'; do sleep 0.5; done"]
      containers:
      - name: client
        image: {testbox}
        imagePullPolicy: IfNotPresent
        command: ["swy-echo", "client", "--target", "{WEB_IP}:80", "--proto", "tcp", "--count", "10000000", "--timeout-ms", "1000", "--interval-ms", "50"]
"#
        )
    }

    /// Counts the `ok` and failed lines of one client Pod's log stream (`kubectl logs -f`).
    fn follow(cluster: &KubeletCluster, pod: &str) -> Result<Counter> {
        let child = Command::new(cluster.cp.bin.join("kubectl"))
            .arg(format!(
                "--kubeconfig={}",
                cluster.cp.admin_kubeconfig().display()
            ))
            .args(["logs", "-f", "-n", "default", pod, "-c", "client"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::Prerequisite(format!("kubectl logs: {e}")))?;
        Ok(Counter::of(child))
    }

    async fn install(cluster: &mut KubeletCluster) -> Result<()> {
        let (host, port) = cluster.apiserver_endpoint();
        let chart = binaries::workspace_root().join("helm/switchyard");
        println!("helm install switchyard (agent DaemonSet in iptables mode, operator Deployment) ...");
        let out = cluster.helm(&[
            "install",
            "switchyard",
            &chart.display().to_string(),
            "--namespace",
            "switchyard-system",
            "--create-namespace",
            "--set",
            &format!("apiServer.host={host}"),
            "--set",
            &format!("apiServer.port={port}"),
            "--set",
            "agent.mode=iptables",
            "--set",
            "agent.clusterCIDR=10.244.0.0/16",
        ])?;
        if !out.0 {
            return Err(Error::Prerequisite(format!("helm install: {}\n{}", out.1, out.2)));
        }
        let n = cluster.nodes.len();
        let limit = Duration::from_secs(300);
        cluster
            .wait_pods_ready("switchyard-system", "app.kubernetes.io/component=agent", n, limit)
            .await?;
        cluster
            .wait_pods_ready(
                "switchyard-system",
                "app.kubernetes.io/component=operator",
                1,
                limit,
            )
            .await?;
        Ok(())
    }

    pub(super) async fn run() -> Result<()> {
        let archives: Vec<std::path::PathBuf> = ["agent", "operator", "testbox"]
            .into_iter()
            .map(images::project_image)
            .collect::<Result<_>>()?;
        println!(
            "starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler and {} kubelet nodes (no kube-proxy) ...",
            POOLS.len()
        );
        let mut cluster = KubeletCluster::start(POOLS.len()).await?;
        let admin = cluster.client().await?;
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
        for (node, pool) in cluster.nodes.iter().zip(POOLS) {
            nodes
                .patch(
                    &node.name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"metadata": {"labels": {"pool": pool}}})),
                )
                .await?;
        }
        println!("loading the images into every node's containerd ...");
        for archive in &archives {
            cluster.load_image(archive)?;
        }
        install(&mut cluster).await?;
        println!(
            "{}",
            cluster.kubectl_ok(&["get", "pods", "-n", "switchyard-system", "-o", "wide"], None)?
        );
        let testbox = images::archive_reference(&archives[2])?;
        cluster.kubectl_ok(&["apply", "-f", "-"], Some(&workloads(&testbox)))?;
        let n = cluster.nodes.len();
        let clients = cluster
            .wait_pods_ready("default", "app=demo-client", n, Duration::from_secs(300))
            .await?;
        println!(
            "{}",
            cluster.kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)?
        );
        let mut counters: Vec<(String, Counter)> = Vec::new();
        for pod in &clients {
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            let name = pod.metadata.name.clone().unwrap_or_default();
            counters.push((node, follow(&cluster, &name)?));
        }
        let sample = binaries::workspace_root().join("config/samples/demo-rollout.yaml");
        cluster.kubectl_ok(&["apply", "-f", &sample.display().to_string()], None)?;
        println!("applied {}", sample.display());

        live_view(&admin, &cluster.cp, || {
            cluster
                .nodes
                .iter()
                .zip(POOLS)
                .map(|(n, pool)| {
                    let c = counters.iter().find(|(node, _)| *node == n.name).map(|(_, c)| c);
                    NodeRow {
                        name: &n.name,
                        pool,
                        ok: c.map_or(0, |c| c.ok.load(Ordering::Relaxed)),
                        failed: c.map_or(0, |c| c.failed.load(Ordering::Relaxed)),
                    }
                })
                .collect()
        })
        .await?;
        println!("stopping the clients, uninstalling, stopping the kubelets, runtimes and control plane ...");
        drop(counters);
        drop(cluster);
        Ok(())
    }
}
