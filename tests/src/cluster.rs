//! A real cluster for tests: the control plane of [`crate::controlplane`] plus kube-controller-manager
//! and kube-scheduler, and network-namespace nodes ([`crate::netns`]) each running a real containerd
//! and kubelet ([`crate::kubelet`]). DaemonSets, Deployments, EndpointSlices, ServiceAccount tokens,
//! node lifecycle and garbage collection are the real controllers'.
//!
//! ```text
//!   root ns:   etcd, kube-apiserver (127.0.0.1), kube-controller-manager, kube-scheduler
//!              apiserver → kubelets (logs, exec, port-forward): an egress selector sends them over a
//!              unix socket to this harness, which dials the node from inside the fabric namespace
//!   fabric:    10.250.0.1:<port> → apiserver (netns.rs); routes to every node's pod CIDRs
//!   node-i:    containerd + kubelet (own mount namespace, cgroup, directories); pods on cbr0
//! ```
//! Nothing addresses a private range from the root namespace: kubelets reach the apiserver through
//! the fabric's forwarder, the apiserver reaches kubelets through the egress proxy.
//!
//! Usage (see `tests/tests/kubelet_nodes.rs`):
//! ```no_run
//! # async fn f() -> switchyard_e2e::Result<()> {
//! use std::time::Duration;
//! use switchyard_e2e::{cluster::KubeletCluster, images};
//! let mut cluster = KubeletCluster::start(3).await?; // Nodes Ready, ~10 s here
//! cluster.load_image(&images::project_image("agent")?)?; // ctr import on every node
//! let (host, port) = cluster.apiserver_endpoint(); // for the chart's apiServer.host/port
//! cluster.helm(&["install", "switchyard", "helm/switchyard", "--set", &format!("apiServer.host={host}")])?;
//! cluster.kubectl_ok(&["apply", "-f", "-"], Some("..."))?;
//! let pods = cluster.wait_pods_ready("default", "app=x", 3, Duration::from_secs(120)).await?;
//! let out = cluster.exec("default", "some-pod", &["sh", "-c", "..."], Duration::from_secs(60))?;
//! let node = &cluster.nodes[0]; // KubeletNode: name, netns, ip, dir, crictl(), ctr(), log_tail()
//! # Ok(()) }
//! ```
//! Dropping the cluster tears everything down (in about a second); while panicking it first
//! copies every log to `$TMPDIR/switchyard-e2e-logs/<run>/`.

use std::{
    fs::File,
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    os::{
        fd::AsFd,
        unix::net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client, api::PostParams};
use nix::sched::{CloneFlags, setns};
use serde_json::json;

use crate::{
    Error, Result,
    controlplane::{ControlPlane, Credential},
    images, io_err,
    kubelet::KubeletNode,
    netns, sweep, tools,
};

/// A control plane with controllers and scheduler, and kubelet nodes. Dropping it stops the nodes
/// (in parallel), the controllers, the egress proxy, the namespaces and the control plane.
pub struct KubeletCluster {
    /// The kubelet nodes, `node-1`...
    pub nodes: Vec<KubeletNode>,
    controllers: Vec<(&'static str, Child)>,
    egress: Option<EgressProxy>,
    /// The network namespaces (fabric and nodes; no harness pods).
    pub net: netns::Cluster,
    /// The control plane (admin kubeconfig, kubectl, clients).
    pub cp: ControlPlane,
    dir: PathBuf,
    /// How long each start-up phase took.
    pub timings: Vec<(&'static str, Duration)>,
}

impl KubeletCluster {
    /// Starts everything for `nodes` nodes and waits until every Node is Ready and untainted.
    pub async fn start(nodes: usize) -> Result<Self> {
        let t0 = Instant::now();
        sweep::sweep_leftovers();
        let (pid, seq) = sweep::next_id();
        let dir = std::env::temp_dir().join(format!("{}-{pid}-{seq}", sweep::PREFIX));
        std::fs::create_dir_all(&dir).map_err(io_err("create cluster dir"))?;
        let egress_socket = dir.join("egress.sock");
        let egress_config = dir.join("egress.yaml");
        std::fs::write(
            &egress_config,
            format!(
                "apiVersion: apiserver.k8s.io/v1beta1\nkind: EgressSelectorConfiguration\negressSelections:\n- name: cluster\n  connection:\n    proxyProtocol: HTTPConnect\n    transport:\n      uds:\n        udsName: {}\n",
                egress_socket.display()
            ),
        )
        .map_err(io_err("write egress config"))?;
        // The apiserver dials kubelets by InternalIP (the default prefers the Hostname address,
        // which the egress proxy would have to resolve).
        let cp = match ControlPlane::start_with(&[
            format!("--egress-selector-config-file={}", egress_config.display()),
            "--kubelet-preferred-address-types=InternalIP".to_owned(),
        ])
        .await
        {
            Ok(cp) => cp,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let net = match netns::Cluster::create(nodes, 0, cp.port) {
            Ok(net) => net,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let mut cluster = Self {
            nodes: Vec::new(),
            controllers: Vec::new(),
            egress: None,
            net,
            cp,
            dir,
            timings: Vec::new(),
        };
        cluster
            .timings
            .push(("control plane and namespaces", t0.elapsed()));
        if let Err(e) = cluster.bring_up(&egress_socket, pid, seq, t0).await {
            cluster.keep_logs();
            return Err(e);
        }
        Ok(cluster)
    }

    /// Everything after the control plane and the namespaces: egress proxy, controllers, Nodes,
    /// runtimes and kubelets, and the wait for Ready.
    async fn bring_up(&mut self, egress_socket: &Path, pid: u32, seq: u32, t0: Instant) -> Result<()> {
        let t1 = Instant::now();
        self.egress = Some(EgressProxy::start(egress_socket, &self.net.fabric)?);
        self.start_controllers()?;
        let client = self.cp.admin_client().await?;
        for node in &self.net.nodes {
            create_node(&client, node).await?;
        }
        let pause = images::pause_image(&self.dir)?;
        let specs: Vec<(netns::Node, PathBuf, String)> = self
            .net
            .nodes
            .iter()
            .map(|n| {
                (
                    n.clone(),
                    self.dir.join(&n.name),
                    format!("{}{pid}x{seq}-{}", sweep::PREFIX, n.name),
                )
            })
            .collect();
        // Runtimes in parallel: each waits for its containerd.
        let started: Vec<Result<KubeletNode>> = std::thread::scope(|s| {
            let handles: Vec<_> = specs
                .into_iter()
                .map(|(node, dir, cgroup)| {
                    let cp = &self.cp;
                    let pause = &pause;
                    s.spawn(move || -> Result<KubeletNode> {
                        let mut k = KubeletNode::start_runtime(cp, &node, dir, cgroup)?;
                        k.import_image(pause)?;
                        k.start_kubelet()?;
                        Ok(k)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Prerequisite("node start panicked".into())))
                })
                .collect()
        });
        let mut first_error = None;
        for r in started {
            match r {
                Ok(node) => self.nodes.push(node),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        self.timings
            .push(("containerd up, sandbox image in, kubelets started", t1.elapsed()));
        let t2 = Instant::now();
        self.wait_nodes_ready(Duration::from_secs(120)).await?;
        self.timings.push(("nodes Ready and untainted", t2.elapsed()));
        self.timings.push(("total", t0.elapsed()));
        for (phase, took) in &self.timings {
            eprintln!("[kubelet cluster] {phase}: {:.1} s", took.as_secs_f64());
        }
        Ok(())
    }

    fn start_controllers(&mut self) -> Result<()> {
        let server = format!("https://127.0.0.1:{}", self.cp.port);
        let cpd = self.cp.dir().display().to_string();
        for (name, user) in [
            ("kube-controller-manager", "system:kube-controller-manager"),
            ("kube-scheduler", "system:kube-scheduler"),
        ] {
            let (cert, key) = self.cp.pki().client_cert(user, None)?;
            let (cert_path, key_path) = (
                self.dir.join(format!("{name}.crt")),
                self.dir.join(format!("{name}.key")),
            );
            std::fs::write(&cert_path, cert).map_err(io_err("write cert"))?;
            std::fs::write(&key_path, key).map_err(io_err("write key"))?;
            let kubeconfig = self.cp.write_kubeconfig(
                name,
                &server,
                Credential::Certificate {
                    cert: cert_path,
                    key: key_path,
                },
            )?;
            let k = kubeconfig.display().to_string();
            let mut args = vec![
                format!("--kubeconfig={k}"),
                format!("--authentication-kubeconfig={k}"),
                format!("--authorization-kubeconfig={k}"),
                "--secure-port=0".to_owned(),
                "--leader-elect=false".to_owned(),
                "--v=1".to_owned(),
            ];
            if name == "kube-controller-manager" {
                args.extend([
                    "--use-service-account-credentials=true".to_owned(),
                    format!("--service-account-private-key-file={cpd}/sa.key"),
                    format!("--root-ca-file={cpd}/ca.crt"),
                    "--controllers=*".to_owned(),
                    "--node-monitor-period=1s".to_owned(),
                    "--cluster-name=switchyard-test".to_owned(),
                    // Its default is created on the host (/usr/libexec/kubernetes/...).
                    format!(
                        "--flex-volume-plugin-dir={}/kcm-volume-plugins",
                        self.dir.display()
                    ),
                ]);
            }
            let log = File::create(self.dir.join(format!("{name}.log"))).map_err(io_err("create log"))?;
            let err = log.try_clone().map_err(io_err("clone log"))?;
            let child = Command::new(self.cp.bin.join(name))
                .args(&args)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(err)
                .spawn()
                .map_err(io_err(format!("start {name}")))?;
            sweep::record_pid(&self.dir, child.id());
            self.controllers.push((name, child));
        }
        Ok(())
    }

    /// Fails (with logs) if a controller, containerd or kubelet has exited.
    pub fn check_running(&mut self) -> Result<()> {
        for (name, child) in &mut self.controllers {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(Error::Prerequisite(format!(
                    "{name} exited ({status}); its log ends:\n{}",
                    tail(&self.dir.join(format!("{name}.log")))
                )));
            }
        }
        for node in &mut self.nodes {
            node.check_running()?;
        }
        Ok(())
    }

    /// Waits until every node's Node is Ready, with no `node.kubernetes.io/not-ready` taint.
    pub async fn wait_nodes_ready(&mut self, limit: Duration) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.cp.admin_client().await?);
        let names: Vec<String> = self.nodes.iter().map(|n| n.name.clone()).collect();
        let start = Instant::now();
        loop {
            self.check_running()?;
            let mut waiting = Vec::new();
            for name in &names {
                let ready = match nodes.get_opt(name).await {
                    Ok(Some(node)) => node_ready(&node),
                    _ => false,
                };
                if !ready {
                    waiting.push(name.clone());
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            if start.elapsed() > limit {
                let logs: Vec<String> = self
                    .nodes
                    .iter()
                    .filter(|n| waiting.contains(&n.name))
                    .map(|n| format!("--- {} kubelet:\n{}", n.name, n.log_tail("kubelet")))
                    .collect();
                return Err(Error::Timeout(
                    limit,
                    format!("Nodes Ready: still waiting for {waiting:?}\n{}", logs.join("\n")),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Imports an image archive into every node's containerd (in parallel).
    pub fn load_image(&self, archive: &Path) -> Result<()> {
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .nodes
                .iter()
                .map(|n| s.spawn(move || n.import_image(archive)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Prerequisite("image import panicked".into())))
                })
                .collect::<Result<Vec<()>>>()
        })?;
        Ok(())
    }

    /// The apiserver as nodes and pods reach it without a Service proxy: the fabric's forwarder
    /// ([`crate::controlplane::ADVERTISE_ADDRESS`], the port of `default/kubernetes`). What a
    /// hostNetwork component needs as `KUBERNETES_SERVICE_HOST`/`_PORT` before any proxy runs.
    pub fn apiserver_endpoint(&self) -> (std::net::Ipv4Addr, u16) {
        (crate::controlplane::ADVERTISE_ADDRESS, self.cp.port)
    }

    /// Waits until at least `count` pods in `namespace` matching `selector` are Running and Ready
    /// and returns them; fails early when a component exits, and on timeout with the pods'
    /// description and the components' logs.
    pub async fn wait_pods_ready(
        &mut self,
        namespace: &str,
        selector: &str,
        count: usize,
        limit: Duration,
    ) -> Result<Vec<k8s_openapi::api::core::v1::Pod>> {
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(self.client().await?, namespace);
        let start = Instant::now();
        loop {
            self.check_running()?;
            let list = pods
                .list(&kube::api::ListParams::default().labels(selector))
                .await?;
            let ready: Vec<_> = list.items.into_iter().filter(pod_ready).collect();
            if ready.len() >= count {
                return Ok(ready);
            }
            if start.elapsed() > limit {
                let (_, described, _) = self
                    .kubectl(&["describe", "pods", "-n", namespace, "-l", selector], None)
                    .unwrap_or_default();
                return Err(Error::Timeout(
                    limit,
                    format!(
                        "{count} pods {selector} in {namespace} Running and Ready ({} are):\n{described}\n{}",
                        ready.len(),
                        self.diagnostics()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The cluster's working directory (controller logs, images built for it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A node by name.
    pub fn node(&self, name: &str) -> Option<&KubeletNode> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// An admin client.
    pub async fn client(&self) -> Result<Client> {
        self.cp.admin_client().await
    }

    /// kubectl as admin: (success, stdout, stderr).
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Result<(bool, String, String)> {
        self.cp.kubectl(args, stdin)
    }

    /// kubectl as admin that must succeed; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        self.cp.kubectl_ok(args, stdin)
    }

    /// `kubectl exec` of `command` in `pod` (namespace `namespace`, its first container), bounded
    /// by `limit` (kubectl is stopped then): stdout, or the failure with stderr.
    pub fn exec(&self, namespace: &str, pod: &str, command: &[&str], limit: Duration) -> Result<String> {
        let kubectl = self.cp.bin.join("kubectl").display().to_string();
        let kubeconfig = format!("--kubeconfig={}", self.cp.admin_kubeconfig().display());
        let secs = format!("{}", limit.as_secs().max(1));
        let mut args = vec![
            "--kill-after=5",
            secs.as_str(),
            kubectl.as_str(),
            kubeconfig.as_str(),
            "exec",
            "-n",
            namespace,
            pod,
            "--",
        ];
        args.extend_from_slice(command);
        crate::run("timeout", &args)
    }

    /// helm against this cluster (admin kubeconfig): (success, stdout, stderr).
    pub fn helm(&self, args: &[&str]) -> Result<tools::Output> {
        let kubeconfig = self.cp.admin_kubeconfig().display().to_string();
        let mut full = vec!["--kubeconfig", kubeconfig.as_str()];
        full.extend_from_slice(args);
        tools::helm_run(&full)
    }

    /// The end of every component's log (controllers, and each node's kubelet and containerd),
    /// for failure messages.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for name in ["kube-controller-manager", "kube-scheduler"] {
            out.push_str(&format!("--- {name}:\n{}\n", self.controller_log_tail(name)));
        }
        for node in &self.nodes {
            for name in ["kubelet", "containerd"] {
                out.push_str(&format!("--- {} {name}:\n{}\n", node.name, node.log_tail(name)));
            }
        }
        out
    }

    /// Copies every log (apiserver, etcd, controllers, kubelets, containerds) to
    /// `$TMPDIR/switchyard-e2e-logs/<run>/` (outside the swept run directories) and says where.
    /// Done on drop while panicking, so a failed run's logs survive the teardown.
    pub fn keep_logs(&self) {
        let run = self
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let to = std::env::temp_dir().join("switchyard-e2e-logs").join(run);
        let _ = std::fs::create_dir_all(&to);
        let mut sources: Vec<(String, PathBuf)> = Vec::new();
        for dir in [self.dir.clone(), self.cp.dir().to_path_buf()] {
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if name.ends_with(".log") {
                        sources.push((name, e.path()));
                    }
                }
            }
        }
        for node in &self.nodes {
            for name in ["kubelet", "containerd", "holder"] {
                sources.push((format!("{}-{name}.log", node.name), node.log_path(name)));
            }
        }
        for (name, path) in sources {
            let _ = std::fs::copy(&path, to.join(name));
        }
        eprintln!("[kubelet cluster] logs kept in {}", to.display());
    }

    /// Last lines of a controller's log (`kube-controller-manager`, `kube-scheduler`).
    pub fn controller_log_tail(&self, name: &str) -> String {
        tail(&self.dir.join(format!("{name}.log")))
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Whether a Pod is Running with its Ready condition true.
pub fn pod_ready(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether a Node is Ready and carries no not-ready/unreachable taint.
pub fn node_ready(node: &Node) -> bool {
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| {
            ts.iter()
                .any(|t| t.key == "node.kubernetes.io/not-ready" || t.key == "node.kubernetes.io/unreachable")
        });
    ready && !tainted
}

/// Creates the Node before its kubelet registers, so its pod CIDRs (which nothing allocates here:
/// the CNI configuration has them) are the fabric's from the start; the kubelet then adopts it.
async fn create_node(client: &Client, node: &netns::Node) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let object: Node = serde_json::from_value(json!({
        "metadata": {"name": node.name, "labels": {"kubernetes.io/hostname": node.name}},
        "spec": {"podCIDR": node.pod_cidr, "podCIDRs": [node.pod_cidr, node.pod_cidr6]},
    }))
    .map_err(|e| Error::Prerequisite(e.to_string()))?;
    nodes.create(&PostParams::default(), &object).await?;
    Ok(())
}

impl Drop for KubeletCluster {
    fn drop(&mut self) {
        let start = Instant::now();
        if std::thread::panicking() {
            self.keep_logs();
        }
        std::thread::scope(|s| {
            for node in self.nodes.iter_mut() {
                s.spawn(move || node.stop());
            }
        });
        self.nodes.clear();
        for (_, child) in self.controllers.iter_mut() {
            sweep::stop_child(child, Duration::from_secs(5));
        }
        self.egress.take();
        let _ = std::fs::remove_dir_all(&self.dir);
        eprintln!(
            "[kubelet cluster] nodes and controllers stopped in {:.1} s",
            start.elapsed().as_secs_f64()
        );
        // Then the fields: the namespaces (net), the control plane (cp).
    }
}

/// The apiserver's egress to the cluster (its `cluster` egress selection): an HTTP CONNECT proxy on
/// a unix socket that dials the requested node or pod address from inside the fabric namespace.
/// Only the fabric's and the pods' ranges are accepted.
struct EgressProxy {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EgressProxy {
    fn start(socket: &Path, fabric: &str) -> Result<Self> {
        let listener = UnixListener::bind(socket).map_err(io_err("bind the egress socket"))?;
        listener
            .set_nonblocking(true)
            .map_err(io_err("nonblocking egress socket"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let fabric = fabric.to_owned();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let fabric = fabric.clone();
                        std::thread::spawn(move || {
                            let _ = serve_connect(conn, &fabric);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Whether the egress proxy may dial `ip`: the fabric's and the pods' ranges only.
fn egress_allowed(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            (o[0] == 10 && o[1] == 250 && o[2] == 0) || (o[0] == 10 && o[1] == 244)
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            s[0] == 0xfd00 && s[1] == 0x10 && (s[2] == 0x250 || s[2] == 0x244)
        }
    }
}

fn serve_connect(mut conn: UnixStream, fabric: &str) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 8192 || conn.read(&mut byte)? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head);
    let target = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("CONNECT "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|t| t.parse::<SocketAddr>().ok());
    let Some(target) = target.filter(|t| egress_allowed(t.ip())) else {
        conn.write_all(b"HTTP/1.1 403 Forbidden\r\n\r\n")?;
        return Ok(());
    };
    // This thread enters the fabric for good: the socket it makes stays there.
    let ns = File::open(format!("/run/netns/{fabric}"))?;
    setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
    let upstream = match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) => {
            let _ = conn.write_all(format!("HTTP/1.1 502 Bad Gateway\r\n\r\n{e}").as_bytes());
            return Ok(());
        }
    };
    conn.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")?;
    conn.set_read_timeout(None)?;
    let (mut up_read, mut down_write) = (upstream.try_clone()?, conn.try_clone()?);
    let copier = std::thread::spawn(move || {
        let _ = std::io::copy(&mut up_read, &mut down_write);
        let _ = down_write.shutdown(std::net::Shutdown::Write);
    });
    let (mut down_read, mut up_write) = (conn, upstream);
    let _ = std::io::copy(&mut down_read, &mut up_write);
    let _ = up_write.shutdown(std::net::Shutdown::Write);
    let _ = copier.join();
    Ok(())
}
