//! The product as shipped, on real kubelet nodes with no kube-proxy: `helm install` of
//! `helm/switchyard` with the images of `scripts/build-images.sh`; the agents (a DaemonSet) and
//! the operator (a Deployment) run as Pods with the chart's security context and reach the
//! apiserver at the configured endpoint (no ClusterIP works before they program it); they serve a
//! Deployment's Service by ClusterIP and NodePort to client Pods on every node; a ProxyPolicy moves
//! the pool iptables → nftables in waves while the clients keep connecting, and an agent Pod
//! deleted mid-switch is restarted by the DaemonSet and its node converges; `helm uninstall`
//! leaves the rules serving, and the cleanup Job of `config/cleanup/` removes them.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::authentication::v1::{TokenReview, TokenReviewSpec},
    api::core::v1::{Pod, ServiceAccount},
    api::discovery::v1::EndpointSlice,
    jiff::Timestamp,
};
use kube::{
    Api,
    api::{ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use switchyard_crds::v1alpha1::{NodeProxy, ProxyMode, ProxyPolicy, SwitchPhase};
use switchyard_e2e::{
    Family,
    cluster::{KubeletCluster, pod_ready},
    eventually, images, kernel, logs, sweep, traffic,
};

const SY: &str = "switchyard-system";
const DEMO: &str = "demo";
const CLUSTER_IP: &str = "10.96.0.100";
const NODE_PORT: u16 = 30080;
const AGENTS: &str = "app.kubernetes.io/component=agent";
const OPERATORS: &str = "app.kubernetes.io/component=operator";
/// `swy-echo client` pauses this long between attempts in every client container.
const INTERVAL_MS: u64 = 100;
/// NET_ADMIN (12) and NET_RAW (13): the agent's whole capability set.
const AGENT_CAPS: u64 = (1 << 12) | (1 << 13);

fn chart() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../helm/switchyard")
        .display()
        .to_string()
}

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn node_of(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

fn name_of(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// The workload: echo servers (a Deployment spread over the nodes) behind a NodePort Service with
/// a fixed ClusterIP, and a client DaemonSet whose two containers connect all along, one to the
/// ClusterIP and one to the NodePort of the client's own node, and log one line per attempt.
fn workload(testbox: &str) -> String {
    let client = |name: &str, target: &str| {
        format!(
            r#"      - name: {name}
        image: {testbox}
        imagePullPolicy: Never
        command: ["swy-echo", "client", "--target", "{target}", "--proto", "tcp", "--count", "100000", "--interval-ms", "{INTERVAL_MS}", "--timeout-ms", "1000"]
        env:
        - name: HOST_IP
          valueFrom: {{fieldRef: {{fieldPath: status.hostIP}}}}
"#
        )
    };
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: echo, namespace: {DEMO}}}
spec:
  replicas: 3
  selector: {{matchLabels: {{app: echo}}}}
  template:
    metadata: {{labels: {{app: echo}}}}
    spec:
      terminationGracePeriodSeconds: 1
      topologySpreadConstraints:
      - maxSkew: 1
        topologyKey: kubernetes.io/hostname
        whenUnsatisfiable: DoNotSchedule
        labelSelector: {{matchLabels: {{app: echo}}}}
      containers:
      - name: echo
        image: {testbox}
        imagePullPolicy: Never
        command: ["swy-echo", "serve", "--name", "$(POD_NAME)", "--tcp", "8080"]
        env:
        - name: POD_NAME
          valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
        ports: [{{name: tcp, containerPort: 8080}}]
        readinessProbe:
          tcpSocket: {{port: 8080}}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: {DEMO}}}
spec:
  type: NodePort
  clusterIP: {CLUSTER_IP}
  selector: {{app: echo}}
  ports:
  - {{name: tcp, port: 80, targetPort: tcp, nodePort: {NODE_PORT}}}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {{name: client, namespace: {DEMO}}}
spec:
  selector: {{matchLabels: {{app: client}}}}
  template:
    metadata: {{labels: {{app: client}}}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
{}{}"#,
        client("clusterip", &format!("{CLUSTER_IP}:80")),
        client("nodeport", &format!("$(HOST_IP):{NODE_PORT}")),
    )
}

/// One attempt of a client container, as its log line says, with the time the runtime read it.
struct Attempt {
    at: Timestamp,
    ok: bool,
    line: String,
}

/// Every attempt a client container logged so far (`kubectl logs --timestamps`).
fn attempts(cluster: &KubeletCluster, pod: &str, container: &str) -> Vec<Attempt> {
    let text = cluster
        .kubectl_ok(&["logs", "-n", DEMO, pod, "-c", container, "--timestamps"], None)
        .unwrap_or_else(|e| panic!("kubectl logs {pod} -c {container}: {e}"));
    text.lines()
        .filter_map(|l| {
            let (at, rest) = l.split_once(' ')?;
            let at: Timestamp = at.parse().ok()?;
            let rest = rest.trim();
            (!rest.is_empty()).then(|| Attempt {
                at,
                ok: rest.starts_with("ok "),
                line: rest.to_owned(),
            })
        })
        .collect()
}

/// A phase of the test: the clients' attempts between `from` and `to` are its own.
struct Window {
    name: &'static str,
    from: Timestamp,
    to: Timestamp,
}

#[derive(Default, Clone)]
struct Tally {
    attempts: usize,
    failed: usize,
    first_failures: Vec<String>,
}

fn tally(list: &[Attempt], w: &Window) -> Tally {
    let mut t = Tally::default();
    for a in list.iter().filter(|a| a.at >= w.from && a.at < w.to) {
        t.attempts += 1;
        if !a.ok {
            t.failed += 1;
            if t.first_failures.len() < 5 {
                t.first_failures.push(format!("{} {}", a.at, a.line));
            }
        }
    }
    t
}

/// Waits until each client container's last `n` attempts, all made after `after`, answered.
async fn clients_answer(
    cluster: &KubeletCluster,
    clients: &BTreeMap<String, String>,
    after: Timestamp,
    n: usize,
    limit: Duration,
    what: &str,
) {
    let start = Instant::now();
    loop {
        let mut waiting = Vec::new();
        for (node, pod) in clients {
            for c in ["clusterip", "nodeport"] {
                let list = attempts(cluster, pod, c);
                let recent: Vec<&Attempt> = list.iter().filter(|a| a.at >= after).collect();
                let good = recent.len() >= n && recent[recent.len() - n..].iter().all(|a| a.ok);
                if !good {
                    let last = recent.last().map(|a| a.line.clone()).unwrap_or_default();
                    waiting.push(format!("{node}/{c} ({} since, last: {last})", recent.len()));
                }
            }
        }
        if waiting.is_empty() {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{what}: not every client's last {n} attempts answered in {limit:?}: {waiting:?}\n{}",
            cluster.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The process of a pod's first container (its PID on this host), through the node's runtime.
fn container_pid(cluster: &KubeletCluster, pod: &Pod) -> u32 {
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.container_id.clone())
        .unwrap_or_default();
    let id = id.trim_start_matches("containerd://");
    let node = cluster.node(&node_of(pod)).expect("the pod's node");
    let inspect = node
        .crictl(&["inspect", id])
        .unwrap_or_else(|e| panic!("crictl inspect {id}: {e}"));
    let parsed: serde_json::Value = serde_json::from_str(&inspect).expect("crictl inspect JSON");
    parsed["info"]["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("no pid in crictl inspect of {}", name_of(pod))) as u32
}

/// (effective capabilities, uid, root file system mounted read-only) of a host process.
fn process_confinement(pid: u32) -> (u64, u32, bool) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("{name} in /proc/{pid}/status"))
    };
    let caps = u64::from_str_radix(&field("CapEff:"), 16).expect("CapEff");
    let uid: u32 = field("Uid:")
        .split_whitespace()
        .next()
        .and_then(|u| u.parse().ok())
        .expect("Uid");
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    let root_ro = mountinfo
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.get(4) == Some(&"/"))
        .and_then(|f| f.get(5).map(|o| o.split(',').any(|x| x == "ro")))
        .unwrap_or(false);
    (caps, uid, root_ro)
}

/// The agents by node (their pods, Running and Ready).
async fn agents_by_node(cluster: &mut KubeletCluster) -> BTreeMap<String, Pod> {
    cluster
        .wait_pods_ready(SY, AGENTS, 3, Duration::from_secs(180))
        .await
        .expect("agent pods Running and Ready")
        .into_iter()
        .map(|p| (node_of(&p), p))
        .collect()
}

fn pod_log(cluster: &KubeletCluster, namespace: &str, pod: &str) -> String {
    logs::without_ansi(
        &cluster
            .kubectl_ok(&["logs", "-n", namespace, pod], None)
            .unwrap_or_else(|e| panic!("kubectl logs {pod}: {e}")),
    )
}

/// Both iptables variants of both families, and the nftables tables, of a node.
fn kernel_listing(netns: &str) -> (String, String) {
    let tables = kernel::nft_tables(netns).expect("nft list tables");
    let saves = kernel::iptables_saves(netns, &Family::BOTH).expect("iptables saves");
    (tables, saves)
}

/// (a `switchyard` nftables table, `SWY` objects in any iptables variant or family).
fn backends(netns: &str) -> (bool, bool) {
    let (tables, saves) = kernel_listing(netns);
    (tables.contains("switchyard"), saves.contains("SWY"))
}

/// A server-side dry run of the pod template of the chart's `component` workload in a fresh
/// namespace enforcing Pod Security `level`: (admitted, kubectl's stderr).
async fn pod_security_dry_run(cluster: &KubeletCluster, component: &str, level: &str) -> (bool, String) {
    let ns = format!("psa-{level}");
    cluster
        .kubectl_ok(&["create", "namespace", &ns], None)
        .expect("namespace");
    cluster
        .kubectl_ok(
            &[
                "label",
                "namespace",
                &ns,
                &format!("pod-security.kubernetes.io/enforce={level}"),
            ],
            None,
        )
        .expect("label");
    let kind = if component == "agent" {
        "daemonset"
    } else {
        "deployment"
    };
    let workload: serde_json::Value = serde_json::from_str(
        &cluster
            .kubectl_ok(
                &[
                    "get",
                    kind,
                    "-n",
                    SY,
                    &format!("switchyard-{component}"),
                    "-o",
                    "json",
                ],
                None,
            )
            .expect("get the workload"),
    )
    .expect("workload JSON");
    let mut spec = workload["spec"]["template"]["spec"].clone();
    // The namespace's own account (the chart's lives in the release namespace).
    spec["serviceAccountName"] = json!("default");
    spec["automountServiceAccountToken"] = json!(false);
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{component}-psa"), "namespace": ns}, "spec": spec});
    let sas: Api<ServiceAccount> = Api::namespaced(cluster.client().await.expect("admin"), &ns);
    eventually(Duration::from_secs(60), "default ServiceAccount", || {
        let sas = sas.clone();
        async move { sas.get_opt("default").await.ok().flatten() }
    })
    .await
    .expect("the serviceaccount controller creates `default`");
    let (ok, _, err) = cluster
        .kubectl(&["create", "--dry-run=server", "-f", "-"], Some(&pod.to_string()))
        .expect("kubectl");
    (ok, err)
}

fn mark(timings: &mut Vec<(String, String)>, what: &str, since: Instant) {
    timings.push((what.to_owned(), format!("{:.1} s", since.elapsed().as_secs_f64())));
}

fn policy_condition(p: &ProxyPolicy, kind: &str) -> Option<(String, String, String)> {
    p.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chart_serves_kubelet_nodes_without_kube_proxy_and_switches_them_in_waves() {
    let t_all = Instant::now();
    let mut timings: Vec<(String, String)> = Vec::new();
    let archives: BTreeMap<&str, PathBuf> = ["agent", "operator", "testbox"]
        .into_iter()
        .map(|n| (n, images::project_image(n).expect("image archive")))
        .collect();
    let testbox = images::archive_reference(&archives["testbox"]).expect("testbox reference");

    let t = Instant::now();
    let mut cluster = KubeletCluster::start(3)
        .await
        .expect("control plane and 3 kubelet nodes");
    mark(&mut timings, "control plane and 3 kubelet nodes Ready", t);
    let run_dir = cluster.dir().to_path_buf();
    let cgroups: Vec<String> = cluster.nodes.iter().map(|n| n.cgroup.clone()).collect();
    let mut all_netns: Vec<String> = cluster.nodes.iter().map(|n| n.netns.clone()).collect();
    all_netns.push(cluster.net.fabric.clone());
    let netns: BTreeMap<String, String> = cluster
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.netns.clone()))
        .collect();
    let node_ips: BTreeMap<String, String> = cluster
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.ip.to_string()))
        .collect();
    let names: Vec<String> = cluster.nodes.iter().map(|n| n.name.clone()).collect();

    let t = Instant::now();
    for archive in archives.values() {
        cluster
            .load_image(archive)
            .expect("load an image into every node");
    }
    mark(&mut timings, "3 image archives imported into 3 nodes", t);
    cluster
        .kubectl_ok(&["label", "nodes", "--all", "pool=general"], None)
        .expect("label the nodes");

    // No kube-proxy: before the chart, the `kubernetes` Service's ClusterIP answers nobody.
    let kubernetes_svc: SocketAddr = "10.96.0.1:443".parse().expect("addr");
    let (code, text) = traffic::http_get(&netns["node-1"], kubernetes_svc, "/readyz").expect("swy-echo http");
    assert_eq!(
        code, 0,
        "nothing serves the kubernetes ClusterIP before the chart:\n{text}"
    );

    // --- 1. helm install with the built images, the apiserver at the fabric's endpoint. ---
    let (host, port) = cluster.apiserver_endpoint();
    let values = cluster.dir().join("values.yaml");
    std::fs::write(
        &values,
        format!(
            "image:\n  pullPolicy: Never\napiServer:\n  host: \"{host}\"\n  port: {port}\n\
             operator:\n  replicas: 2\n\
             agent:\n  mode: iptables\n  clusterCIDR: \"{},{}\"\n",
            switchyard_e2e::netns::CLUSTER_CIDR,
            switchyard_e2e::netns::CLUSTER_CIDR6,
        ),
    )
    .expect("write values");
    // The release namespace at Pod Security level privileged, as the chart README says (the
    // agent needs the host network, hostPath volumes and NET_ADMIN).
    cluster
        .kubectl_ok(&["create", "namespace", SY], None)
        .expect("create the release namespace");
    cluster
        .kubectl_ok(
            &[
                "label",
                "namespace",
                SY,
                "pod-security.kubernetes.io/enforce=privileged",
            ],
            None,
        )
        .expect("label the release namespace");
    let t = Instant::now();
    let values_arg = values.display().to_string();
    let chart = chart();
    let (ok, out, err) = cluster
        .helm(&[
            "install",
            "switchyard",
            &chart,
            "--namespace",
            SY,
            "--values",
            &values_arg,
        ])
        .expect("helm");
    assert!(ok, "helm install:\n{out}\n{err}");
    let agents = agents_by_node(&mut cluster).await;
    let agents_ready = t.elapsed();
    let operators = cluster
        .wait_pods_ready(SY, OPERATORS, 2, Duration::from_secs(180))
        .await
        .expect("operator pods Running and Ready");
    timings.push((
        "helm install → 3 agent pods Ready".into(),
        format!("{:.1} s", agents_ready.as_secs_f64()),
    ));
    mark(&mut timings, "helm install → 2 operator pods Ready", t);
    assert_eq!(
        agents.keys().cloned().collect::<Vec<_>>(),
        names,
        "one agent pod on every node"
    );

    // The chart's security context, as the API has it and as the kernel enforces it.
    for (node, pod) in &agents {
        let sc = serde_json::to_value(&pod.spec.as_ref().expect("spec").containers[0].security_context)
            .expect("securityContext");
        assert_eq!(sc["readOnlyRootFilesystem"], json!(true), "{node}: {sc}");
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{node}: {sc}");
        assert_eq!(
            sc["capabilities"]["add"],
            json!(["NET_ADMIN", "NET_RAW"]),
            "{node}: {sc}"
        );
        assert_ne!(sc["privileged"], json!(true), "{node}: {sc}");
        assert_eq!(
            pod.spec.as_ref().and_then(|s| s.dns_policy.as_deref()),
            Some("Default"),
            "{node}: the agent resolves with the node's resolver, not the cluster DNS's ClusterIP"
        );
        let (caps, uid, root_ro) = process_confinement(container_pid(&cluster, pod));
        assert_eq!(
            (caps, uid, root_ro),
            (AGENT_CAPS, 0, true),
            "{node}: the agent process runs with exactly NET_ADMIN and NET_RAW, on a read-only root"
        );
    }
    for pod in &operators {
        let (caps, uid, root_ro) = process_confinement(container_pid(&cluster, pod));
        assert_eq!(
            (caps, uid, root_ro),
            (0, 65532, true),
            "{}: the operator runs as 65532 without capabilities, on a read-only root",
            name_of(pod)
        );
    }

    // Pod Security: level baseline rejects the agent's pod, restricted admits the operator's
    // (server-side dry runs of the chart's pod templates).
    let (ok, err) = pod_security_dry_run(&cluster, "agent", "baseline").await;
    assert!(
        !ok && err.contains("violates PodSecurity \"baseline:latest\"") && err.contains("hostNetwork=true"),
        "Pod Security baseline rejects the agent's pod: {err}"
    );
    println!("the agent's pod under Pod Security baseline: {}", err.trim());
    let (ok, err) = pod_security_dry_run(&cluster, "operator", "restricted").await;
    assert!(ok, "Pod Security restricted admits the operator's pod: {err}");

    // --- 2. NodeProxies registered by the Pod agents. ---
    let admin = cluster.client().await.expect("admin client");
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    let t = Instant::now();
    eventually(
        Duration::from_secs(120),
        "every NodeProxy Active in iptables",
        || {
            let proxies = proxies.clone();
            async move {
                let list = proxies.list(&ListParams::default()).await.ok()?;
                let active = list
                    .items
                    .iter()
                    .filter(|np| {
                        np.status.as_ref().is_some_and(|s| {
                            s.active_mode == Some(ProxyMode::Iptables) && s.phase == Some(SwitchPhase::Active)
                        })
                    })
                    .count();
                (active == 3).then_some(())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.diagnostics()));
    mark(
        &mut timings,
        "agent pods Ready → 3 NodeProxies Active (iptables; 0 = already)",
        t,
    );
    let wide_before = cluster
        .kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)
        .expect("get nodeproxies");
    println!("kubectl get nodeproxies -o wide (after helm install):\n{wide_before}");
    for name in &names {
        assert!(
            wide_before
                .lines()
                .any(|l| l.starts_with(name.as_str()) && l.contains("iptables") && l.contains("Active")),
            "{name} in the listing:\n{wide_before}"
        );
    }

    // Exactly one backend on every node: iptables (SWY chains), no nftables table.
    for name in &names {
        assert_eq!(
            backends(&netns[name]),
            (false, true),
            "{name}: the agent programs iptables only"
        );
    }
    let variants: Vec<String> = proxies
        .list(&ListParams::default())
        .await
        .expect("NodeProxies")
        .items
        .iter()
        .map(|np| {
            format!(
                "{} {:?}",
                np.metadata.name.clone().unwrap_or_default(),
                np.status
                    .as_ref()
                    .and_then(|s| s.capabilities.as_ref())
                    .and_then(|c| c.iptables_variant.clone())
            )
        })
        .collect();
    println!("iptables variant the agents chose: {variants:?}");
    // One operator replica leads (holds the Lease), the other stands by.
    let operator_names: Vec<String> = operators.iter().map(name_of).collect();
    let holder = eventually(
        Duration::from_secs(60),
        "the operator Lease held by a replica",
        || {
            let cluster = &cluster;
            let operator_names = operator_names.clone();
            async move {
                let out = cluster
                    .kubectl_ok(
                        &[
                            "get",
                            "lease",
                            "-n",
                            SY,
                            "switchyard-operator",
                            "-o",
                            "jsonpath={.spec.holderIdentity}",
                        ],
                        None,
                    )
                    .ok()?;
                let holder = out.trim().to_owned();
                operator_names.contains(&holder).then_some(holder)
            }
        },
    )
    .await
    .expect("an operator pod leads");
    println!("operator Lease holder: {holder} (replicas {operator_names:?})");

    // Their apiserver connection is the configured endpoint, never the kubernetes ClusterIP.
    let endpoint = format!("https://{host}:{port}");
    for (node, pod) in &agents {
        let log = pod_log(&cluster, SY, &name_of(pod));
        assert!(
            log.lines()
                .any(|l| l.contains("using the configured apiserver endpoint") && l.contains(&endpoint)),
            "{node}: the agent says it uses {endpoint}:\n{log}"
        );
    }
    // What the agent could not do in its unprivileged pod (a read-only /proc/sys): printed, for
    // the record (e.g. route_localnet for NodePorts on 127.0.0.1, on by default in iptables mode).
    let log1 = pod_log(&cluster, SY, &name_of(&agents["node-1"]));
    let warnings: Vec<&str> = log1.lines().filter(|l| l.contains(" WARN ")).collect();
    println!("node-1 agent warnings in iptables mode: {warnings:#?}");
    for pod in &operators {
        let env = serde_json::to_value(&pod.spec.as_ref().expect("spec").containers[0].env).expect("env");
        assert!(
            env.to_string().contains(&format!("\"{host}\"")),
            "{}: SWITCHYARD_APISERVER_HOST is set: {env}",
            name_of(pod)
        );
    }

    // The admission policy: node-1's agent, with its own kubelet-issued token, may write its own
    // NodeProxy's status but not node-2's (both dry runs: admission runs, nothing is stored).
    let token_path = format!(
        "/proc/{}/root/var/run/secrets/kubernetes.io/serviceaccount/token",
        container_pid(&cluster, &agents["node-1"])
    );
    let token = std::fs::read_to_string(&token_path).expect("the agent pod's token");
    // The token is the kubelet's, bound to the agent's pod on node-1.
    let reviews: Api<TokenReview> = Api::all(admin.clone());
    let review = reviews
        .create(
            &PostParams::default(),
            &TokenReview {
                spec: TokenReviewSpec {
                    token: Some(token.trim().to_owned()),
                    audiences: None,
                },
                ..Default::default()
            },
        )
        .await
        .expect("TokenReview");
    let user = review.status.and_then(|s| s.user).expect("reviewed user");
    let extra = user.extra.unwrap_or_default();
    assert_eq!(
        (
            user.username.as_deref(),
            extra.get("authentication.kubernetes.io/pod-name"),
            extra.get("authentication.kubernetes.io/node-name"),
        ),
        (
            Some("system:serviceaccount:switchyard-system:switchyard-agent"),
            Some(&vec![name_of(&agents["node-1"])]),
            Some(&vec!["node-1".to_owned()]),
        ),
        "the agent's token is pod-bound"
    );
    let as_agent = cluster
        .cp
        .token_client("agent-node-1", token.trim())
        .await
        .expect("client with the agent's token");
    let agent_proxies: Api<NodeProxy> = Api::all(as_agent);
    let dry = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let patch = json!({"status": {"agentVersion": "forged"}});
    agent_proxies
        .patch_status("node-1", &dry, &Patch::Merge(&patch))
        .await
        .expect("node-1's agent writes node-1's NodeProxy status");
    let denied = agent_proxies
        .patch_status("node-2", &dry, &Patch::Merge(&patch))
        .await
        .expect_err("node-1's agent must not write node-2's NodeProxy");
    let denied_text = denied.to_string();
    assert!(
        denied_text.contains("may only write NodeProxy node-1, not node-2"),
        "denied by the admission policy: {denied_text}"
    );

    // --- 3. No kube-proxy: echo servers behind a Service, clients on every node. ---
    let t = Instant::now();
    cluster
        .kubectl_ok(&["create", "namespace", DEMO], None)
        .expect("namespace");
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), DEMO);
    eventually(Duration::from_secs(60), "default ServiceAccount in demo", || {
        let sas = sas.clone();
        async move { sas.get_opt("default").await.ok().flatten() }
    })
    .await
    .expect("the serviceaccount controller creates `default`");
    cluster
        .kubectl_ok(&["apply", "-f", "-"], Some(&workload(&testbox)))
        .expect("apply the workload");
    let echo = cluster
        .wait_pods_ready(DEMO, "app=echo", 3, Duration::from_secs(120))
        .await
        .expect("echo servers Running and Ready");
    let echo_nodes: BTreeSet<String> = echo.iter().map(node_of).collect();
    let clients: BTreeMap<String, String> = cluster
        .wait_pods_ready(DEMO, "app=client", 3, Duration::from_secs(120))
        .await
        .expect("client pods Running")
        .iter()
        .map(|p| (node_of(p), name_of(p)))
        .collect();
    assert_eq!(clients.len(), 3, "a client on every node: {clients:?}");
    // The real EndpointSlice controller publishes the three servers.
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), DEMO);
    eventually(
        Duration::from_secs(60),
        "EndpointSlice of echo with 3 ready endpoints",
        || {
            let slices = slices.clone();
            async move {
                let list = slices
                    .list(&ListParams::default().labels("kubernetes.io/service-name=echo"))
                    .await
                    .ok()?;
                let ready = list
                    .items
                    .iter()
                    .filter(|s| {
                        s.metadata
                            .labels
                            .as_ref()
                            .and_then(|l| l.get("endpointslice.kubernetes.io/managed-by"))
                            .map(String::as_str)
                            == Some("endpointslice-controller.k8s.io")
                    })
                    .flat_map(|s| s.endpoints.iter())
                    .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                    .count();
                (ready == 3).then_some(())
            }
        },
    )
    .await
    .expect("the EndpointSlice controller lists the servers");
    let applied = Timestamp::now();
    clients_answer(
        &cluster,
        &clients,
        Timestamp::MIN,
        20,
        Duration::from_secs(120),
        "ClusterIP and NodePort served on every node",
    )
    .await;
    mark(
        &mut timings,
        "workload applied → every client served (ClusterIP, NodePort)",
        t,
    );
    let _ = applied;
    // Across nodes too: each client reaches the next node's NodePort, and the kubernetes Service.
    for (i, node) in names.iter().enumerate() {
        let next = &names[(i + 1) % names.len()];
        let target = format!("{}:{NODE_PORT}", node_ips[next]);
        let out = cluster
            .exec(
                DEMO,
                &clients[node],
                &[
                    "swy-echo", "client", "--target", &target, "--proto", "tcp", "--count", "5",
                ],
                Duration::from_secs(60),
            )
            .expect("swy-echo client");
        assert_eq!(
            out.lines().filter(|l| l.starts_with("ok ")).count(),
            5,
            "{node} → {next}'s NodePort {target}:\n{out}"
        );
    }
    let (code, text) = traffic::http_get(&netns["node-1"], kubernetes_svc, "/readyz").expect("swy-echo http");
    assert_eq!(
        code, 400,
        "the agents serve the kubernetes ClusterIP now (the apiserver's TLS port answers plain HTTP with 400):\n{text}"
    );

    let steady_from = Timestamp::now();
    // A steady window in iptables mode before the rollout: every client makes 20 more attempts.
    clients_answer(
        &cluster,
        &clients,
        steady_from,
        20,
        Duration::from_secs(60),
        "steady iptables window",
    )
    .await;
    let rollout_from = Timestamp::now();

    // --- 4. and 5. The pool moves iptables → nftables in waves under load; the agent Pod of the
    // first node of the second wave is deleted while that node verifies its switch. ---
    let t = Instant::now();
    let policy = json!({
        "apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": "general"},
        "spec": {
            "nodeSelector": {"matchLabels": {"pool": "general"}}, "mode": "nftables",
            "rollout": {"waves": [{"name": "canary", "nodes": 1, "soakSeconds": 5}, {"name": "rest", "nodes": "100%"}],
                        "maxUnavailable": 1, "failurePolicy": "pause"},
            "healthGate": {"minHealthySeconds": 10, "timeoutSeconds": 180, "failureThreshold": 3,
                           "probes": [{"namespace": DEMO, "name": "echo"}]},
        },
    });
    cluster
        .kubectl_ok(&["apply", "-f", "-"], Some(&policy.to_string()))
        .expect("apply the ProxyPolicy");
    let policies: Api<ProxyPolicy> = Api::all(admin.clone());
    let pods: Api<Pod> = Api::namespaced(admin.clone(), SY);
    // Wait for a node of wave "rest" in Verifying, then delete its agent pod.
    let (victim, victim_pod) = {
        let start = Instant::now();
        loop {
            let p = policies.get("general").await.expect("policy");
            let rest: Vec<String> = p
                .status
                .as_ref()
                .and_then(|s| s.waves.iter().find(|w| w.name == "rest"))
                .map(|w| w.nodes.clone())
                .unwrap_or_default();
            let mut found = None;
            for node in &rest {
                let phase = proxies
                    .get(node)
                    .await
                    .ok()
                    .and_then(|np| np.status)
                    .and_then(|s| s.phase);
                if phase == Some(SwitchPhase::Verifying) {
                    found = Some(node.clone());
                    break;
                }
            }
            if let Some(node) = found {
                break (node.clone(), name_of(&agents[&node]));
            }
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "no node of wave rest reached Verifying; policy status: {:#?}",
                p.status
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let to_verifying = t.elapsed();
    let t_delete = Instant::now();
    cluster
        .kubectl_ok(&["delete", "pod", "-n", SY, &victim_pod, "--wait=false"], None)
        .expect("delete the agent pod");
    let old_uid = agents[&victim].metadata.uid.clone();
    let replacement = eventually(
        Duration::from_secs(180),
        "the DaemonSet's replacement agent pod Ready",
        || {
            let pods = pods.clone();
            let victim = victim.clone();
            let old_uid = old_uid.clone();
            async move {
                let list = pods.list(&ListParams::default().labels(AGENTS)).await.ok()?;
                list.items
                    .into_iter()
                    .find(|p| node_of(p) == victim && p.metadata.uid != old_uid && pod_ready(p))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.diagnostics()));
    let replaced_in = t_delete.elapsed();

    let start = Instant::now();
    let done = loop {
        let p = policies.get("general").await.expect("policy");
        let fresh = p.status.as_ref().and_then(|s| s.observed_generation) == p.metadata.generation;
        if fresh && policy_condition(&p, "Ready").is_some_and(|c| c.0 == "True") {
            break p;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the policy never became Ready; status: {:#?}\n{}",
            p.status,
            cluster.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    mark(
        &mut timings,
        "ProxyPolicy applied → Ready (2 waves, one agent pod deleted)",
        t,
    );
    let rollout_to = Timestamp::now();
    let status = done.status.clone().expect("status");
    let waves: Vec<(String, String, usize)> = status
        .waves
        .iter()
        .map(|w| (w.name.clone(), format!("{:?}", w.state), w.nodes.len()))
        .collect();
    assert_eq!(
        waves,
        vec![
            ("canary".to_owned(), "Completed".to_owned(), 1),
            ("rest".to_owned(), "Completed".to_owned(), 2)
        ],
        "{status:#?}"
    );
    assert_eq!(
        (
            status.target_nodes,
            status.updated_nodes,
            status.healthy_nodes,
            status.failed_nodes
        ),
        (3, 3, 3, 0)
    );
    let ready = policy_condition(&done, "Ready").expect("Ready condition");
    let table = cluster
        .kubectl_ok(&["get", "proxypolicies"], None)
        .expect("get proxypolicies");
    let wide = cluster
        .kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)
        .expect("get nodeproxies");
    println!(
        "Ready condition: status={} reason={} message={}",
        ready.0, ready.1, ready.2
    );
    println!("kubectl get proxypolicies:\n{table}");
    println!("kubectl get nodeproxies -o wide:\n{wide}");
    for name in &names {
        assert!(
            wide.lines()
                .any(|l| l.starts_with(name.as_str()) && l.matches("nftables").count() >= 2),
            "{name} desired and active nftables:\n{wide}"
        );
        let (nft, ipt) = backends(&netns[name]);
        assert_eq!(
            (nft, ipt),
            (true, false),
            "{name}: exactly one backend, nftables (no SWY chain in any iptables variant)"
        );
    }
    // The replacement agent recovered the interrupted switch and then finished it.
    let replacement_log = pod_log(&cluster, SY, &name_of(&replacement));
    assert!(
        replacement_log.contains("recovered an interrupted switch")
            && replacement_log.contains("switch: done"),
        "{victim}: the new agent pod recovered the switch it was deleted in, then switched:\n{replacement_log}"
    );
    let restarts: Vec<String> = proxies
        .get(&victim)
        .await
        .ok()
        .and_then(|np| np.status?.last_switch)
        .map(|l| vec![format!("{} ({:?})", l.result, l.reason)])
        .unwrap_or_default();
    println!(
        "{victim}: agent pod deleted in Verifying ({:.1} s after the policy), replacement Ready in {:.1} s; last switch {restarts:?}",
        to_verifying.as_secs_f64(),
        replaced_in.as_secs_f64()
    );

    // No agent or operator container restarted but the deleted one (the chart's probes hold).
    let restarted: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .expect("switchyard pods")
        .items
        .iter()
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.restart_count > 0))
        })
        .map(name_of)
        .collect();
    assert!(restarted.is_empty(), "containers restarted: {restarted:?}");

    // --- 6. helm uninstall: the rules stay and serve; the cleanup Job removes them. ---
    let t = Instant::now();
    let (ok, out, err) = cluster
        .helm(&[
            "uninstall",
            "switchyard",
            "--namespace",
            SY,
            "--wait",
            "--timeout",
            "180s",
        ])
        .expect("helm");
    assert!(ok, "helm uninstall:\n{out}\n{err}");
    let all_pods: Api<Pod> = Api::namespaced(admin.clone(), SY);
    eventually(Duration::from_secs(120), "no switchyard pod left", || {
        let all_pods = all_pods.clone();
        async move {
            let list = all_pods.list(&ListParams::default()).await.ok()?;
            list.items.is_empty().then_some(())
        }
    })
    .await
    .expect("the agents and operators are gone");
    mark(&mut timings, "helm uninstall → no switchyard pod", t);
    let after_uninstall = Timestamp::now();
    for name in &names {
        assert_eq!(
            backends(&netns[name]),
            (true, false),
            "{name}: the nftables rules stay after helm uninstall (no flush)"
        );
    }
    clients_answer(
        &cluster,
        &clients,
        after_uninstall,
        20,
        Duration::from_secs(60),
        "served by the rules left after helm uninstall",
    )
    .await;
    let uninstalled_to = Timestamp::now();
    let (code, text) = traffic::http_get(&netns["node-2"], kubernetes_svc, "/readyz").expect("swy-echo http");
    assert_eq!(
        code, 400,
        "node-2's netns still reaches the kubernetes ClusterIP through the rules left behind:\n{text}"
    );

    let t = Instant::now();
    let job =
        std::fs::read_to_string(repo_file("config/cleanup/cleanup-job.yaml")).expect("cleanup Job manifest");
    for name in &names {
        cluster
            .kubectl_ok(&["apply", "-f", "-"], Some(&job.replace("NODE_NAME", name)))
            .expect("apply the cleanup Job");
    }
    eventually(Duration::from_secs(180), "3 cleanup Jobs complete", || {
        let cluster = &cluster;
        async move {
            let out = cluster
                .kubectl_ok(
                    &[
                        "get",
                        "jobs",
                        "-n",
                        "kube-system",
                        "-l",
                        "app.kubernetes.io/name=switchyard-cleanup",
                        "-o",
                        "jsonpath={range .items[*]}{.status.succeeded}{\"\\n\"}{end}",
                    ],
                    None,
                )
                .ok()?;
            (out.lines().filter(|l| l.trim() == "1").count() == 3).then_some(())
        }
    })
    .await
    .unwrap_or_else(|e| {
        let (_, described, _) = cluster
            .kubectl(&["describe", "pods", "-n", "kube-system"], None)
            .unwrap_or_default();
        panic!("{e}\n{described}\n{}", cluster.diagnostics())
    });
    mark(&mut timings, "cleanup Jobs applied → 3 complete", t);
    for name in &names {
        let (tables, saves) = kernel_listing(&netns[name]);
        assert!(
            !tables.contains("switchyard") && !saves.contains("SWY"),
            "{name}: nothing of Switchyard is left:\n{tables}\n{saves}"
        );
    }
    // And so the ClusterIP answers no more (what it did before the chart).
    for (node, pod) in &clients {
        let out = cluster
            .exec(
                DEMO,
                pod,
                &[
                    "swy-echo",
                    "client",
                    "--target",
                    &format!("{CLUSTER_IP}:80"),
                    "--proto",
                    "tcp",
                    "--count",
                    "3",
                    "--timeout-ms",
                    "500",
                ],
                Duration::from_secs(60),
            )
            .expect("swy-echo client");
        assert!(
            out.lines().count() == 3 && !out.lines().any(|l| l.starts_with("ok ")),
            "{node}: no answer from the ClusterIP after the cleanup:\n{out}"
        );
    }

    // The clients' attempts, per phase, node and target.
    let windows = [
        Window {
            name: "iptables, steady",
            from: steady_from,
            to: rollout_from,
        },
        Window {
            name: "rollout to nftables (agent pod deleted)",
            from: rollout_from,
            to: rollout_to,
        },
        // From the end of the rollout: the uninstall itself (agents stopping) is in it.
        Window {
            name: "helm uninstall and after",
            from: rollout_to,
            to: uninstalled_to,
        },
    ];
    let client_pods: Api<Pod> = Api::namespaced(admin.clone(), DEMO);
    let mut report = String::new();
    let mut failures = Vec::new();
    writeln!(report, "| phase | node | target | attempts | failed |").ok();
    writeln!(report, "| --- | --- | --- | --- | --- |").ok();
    for (node, pod) in &clients {
        let p = client_pods.get(pod).await.expect("client pod");
        let restarts: i32 = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .map(|cs| cs.iter().map(|c| c.restart_count).sum())
            .unwrap_or(-1);
        assert_eq!(
            restarts, 0,
            "{pod}: the client containers never restarted (their logs are whole)"
        );
        for c in ["clusterip", "nodeport"] {
            let list = attempts(&cluster, pod, c);
            for w in &windows {
                let t = tally(&list, w);
                writeln!(
                    report,
                    "| {} | {node} | {c} | {} | {} |",
                    w.name, t.attempts, t.failed
                )
                .ok();
                assert!(t.attempts > 0, "{node}/{c}: attempts in {}", w.name);
                if t.failed > 0 {
                    failures.push(format!("{node}/{c} in {}: {:?}", w.name, t.first_failures));
                }
            }
        }
    }
    writeln!(report, "\n| step | time |\n| --- | --- |").ok();
    for (what, took) in &timings {
        writeln!(report, "| {what} | {took} |").ok();
    }
    writeln!(
        report,
        "| echo servers on nodes | {} |\n| agent pod deleted mid-switch | {victim} |",
        echo_nodes.iter().cloned().collect::<Vec<_>>().join(", ")
    )
    .ok();
    println!("{report}");
    assert!(
        failures.is_empty(),
        "connections failed:\n{}",
        failures.join("\n")
    );

    // Teardown leaves nothing: no processes of the run, no namespaces, cgroups or mounts.
    let t = Instant::now();
    drop(cluster);
    println!(
        "teardown: {:.1} s; whole test: {:.1} s",
        t.elapsed().as_secs_f64(),
        t_all.elapsed().as_secs_f64()
    );
    let marker = format!("{}/", run_dir.display());
    let own = std::process::id();
    let left: Vec<u32> = sweep::all_pids()
        .into_iter()
        .filter(|p| *p != own)
        .filter(|p| {
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default())
                .contains(&marker)
        })
        .collect();
    assert!(left.is_empty(), "processes of the run are left: {left:?}");
    let listed = switchyard_e2e::run("ip", &["netns", "list"]).expect("ip netns list");
    for ns in &all_netns {
        assert!(
            !listed
                .lines()
                .any(|l| l.split_whitespace().next() == Some(ns.as_str())),
            "network namespace {ns} is left:\n{listed}"
        );
    }
    for mount in sweep::cgroup_mounts() {
        for cg in &cgroups {
            assert!(
                !mount.join(cg).exists(),
                "cgroup {} is left",
                mount.join(cg).display()
            );
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    assert!(
        !mounts.contains(&run_dir.display().to_string()),
        "mounts under {} are left",
        run_dir.display()
    );
    assert!(!run_dir.exists(), "{} is left", run_dir.display());
}
