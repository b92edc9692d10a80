//! Running `switchyard-agent` inside node namespaces with a real, node-bound identity.
//!
//! For each node the harness creates the Kubernetes Node, a Pod object `switchyard-agent-<node>`
//! with `spec.nodeName` (no kubelet runs it; it exists so the TokenRequest API can bind a token to it
//! and add the node-name claim), issues the token, and starts the agent in the node namespace with a
//! kubeconfig pointing at the fabric's apiserver address.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::{Api, ResourceExt, api::PostParams};
use serde_json::json;

use crate::{
    Error, Result, binaries,
    controlplane::{self, ControlPlane, Credential},
    io_err,
    netns::{self, Cluster},
    sweep,
};

/// Namespace of Switchyard's components in tests (as in `config/`).
pub const SYSTEM_NAMESPACE: &str = "switchyard-system";

/// Applies the namespace, CRDs and RBAC from `config/`.
pub fn install_switchyard(cp: &ControlPlane) -> Result<()> {
    let root = binaries::workspace_root();
    cp.install_crds()?;
    for file in [
        "namespace.yaml",
        "agent.yaml",
        "agent-admission.yaml",
        "operator.yaml",
    ] {
        let path = root.join("config/rbac").join(file);
        cp.kubectl_ok(
            &["apply", "--server-side", "-f", &path.display().to_string()],
            None,
        )?;
    }
    Ok(())
}

/// Creates the Node object for a namespace node (addresses and pod CIDRs as in the fabric), dual-stack
/// as a dual-stack kubelet and node IPAM register it: both InternalIPs and both pod CIDRs, IPv4
/// first (the cluster's primary family; `podCIDR` is the first of `podCIDRs`).
pub async fn create_node(cp: &ControlPlane, node: &netns::Node) -> Result<Node> {
    let nodes: Api<Node> = Api::all(cp.admin_client().await?);
    let object: Node = serde_json::from_value(json!({
        "metadata": {"name": node.name, "labels": {"kubernetes.io/hostname": node.name}},
        "spec": {"podCIDR": node.pod_cidr, "podCIDRs": [node.pod_cidr, node.pod_cidr6]},
    }))
    .map_err(|e| Error::Prerequisite(e.to_string()))?;
    let created = nodes.create(&PostParams::default(), &object).await?;
    let status = json!({"status": {"addresses": [
        {"type": "InternalIP", "address": node.ip.to_string()},
        {"type": "InternalIP", "address": node.ip6.to_string()},
        {"type": "Hostname", "address": node.name},
    ]}});
    nodes
        .patch_status(
            &node.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await?;
    Ok(created)
}

/// Creates the agent's Pod object on `node` and returns a token bound to it.
pub async fn agent_token(cp: &ControlPlane, node: &str) -> Result<String> {
    let pods: Api<Pod> = Api::namespaced(cp.admin_client().await?, SYSTEM_NAMESPACE);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("switchyard-agent-{node}"), "labels": {"app.kubernetes.io/name": "switchyard-agent"}},
        "spec": {
            "nodeName": node,
            "serviceAccountName": "switchyard-agent",
            "automountServiceAccountToken": false,
            "containers": [{"name": "agent", "image": "switchyard-agent:test"}],
        },
    }))
    .map_err(|e| Error::Prerequisite(e.to_string()))?;
    let created = pods.create(&PostParams::default(), &pod).await?;
    let uid = created.uid().unwrap_or_default();
    cp.service_account_token(
        SYSTEM_NAMESPACE,
        "switchyard-agent",
        Some((&created.name_any(), &uid)),
    )
    .await
}

/// A fresh token bound to the existing agent Pod of `node` (for restarting an agent).
pub async fn node_token(cp: &ControlPlane, node: &str) -> Result<String> {
    let pods: Api<Pod> = Api::namespaced(cp.admin_client().await?, SYSTEM_NAMESPACE);
    let pod = pods.get(&format!("switchyard-agent-{node}")).await?;
    let uid = pod.uid().unwrap_or_default();
    cp.service_account_token(
        SYSTEM_NAMESPACE,
        "switchyard-agent",
        Some((&pod.name_any(), &uid)),
    )
    .await
}

/// A running agent process; killed on drop.
pub struct Agent {
    /// Node it serves.
    pub node: String,
    /// Kubeconfig it uses (reachable from its namespace).
    pub kubeconfig: PathBuf,
    /// Its log file.
    pub log: PathBuf,
    child: Child,
}

impl Agent {
    /// Starts the agent for `node` inside its namespace with `token`.
    pub fn start(cp: &ControlPlane, node: &netns::Node, token: &str, extra_args: &[&str]) -> Result<Self> {
        Self::start_with_env(cp, node, token, extra_args, &[])
    }

    /// Like [`Agent::start`], with extra environment variables (fault injection).
    pub fn start_with_env(
        cp: &ControlPlane,
        node: &netns::Node,
        token: &str,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let server = format!("https://{}:{}", controlplane::ADVERTISE_ADDRESS, cp.port);
        let kubeconfig = cp.write_kubeconfig(
            &format!("agent-{}", node.name),
            &server,
            Credential::Token(token.into()),
        )?;
        let log = cp.dir().join(format!("agent-{}.log", node.name));
        let bin = binaries::workspace_bin("switchyard-agent")?;
        // Appended, so a restarted agent's log follows the previous one's.
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(io_err("agent log"))?;
        let out = err.try_clone().map_err(io_err("agent log"))?;
        let child = Command::new("ip")
            .envs(env.iter().copied())
            .args(["netns", "exec", &node.netns])
            .arg(&bin)
            .args(["--node-name", &node.name, "--kubeconfig"])
            .arg(&kubeconfig)
            .arg("--state-dir")
            .arg(cp.dir().join(format!("state-{}", node.name)))
            .args(extra_args)
            .env("RUST_LOG", "info")
            .env(crate::logs::NO_COLOR.0, crate::logs::NO_COLOR.1)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err("start agent"))?;
        sweep::record_pid(cp.dir(), child.id());
        Ok(Self {
            node: node.name.clone(),
            kubeconfig,
            log,
            child,
        })
    }

    /// The agent's log so far, as plain text (no colours).
    pub fn log_text(&self) -> String {
        crate::logs::read(&self.log)
    }

    /// The agent's exit status once it has exited (it never should on its own).
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Agent {
    /// Freezes the agent with SIGSTOP (a hung process: its connections stay open, unread).
    pub fn pause(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// Thaws an agent frozen by [`Agent::pause`].
    pub fn resume(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    /// `ip netns exec` execs the agent, so the child's PID is the agent's.
    fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
        }
    }

    /// Kills the agent with SIGKILL (no chance to clean up), as a crash would.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        sweep::stop_child(&mut self.child, Duration::from_secs(5));
    }
}

/// A control plane with Switchyard installed, namespace nodes registered as Nodes, and (optionally)
/// agents running on them. Dropped in reverse order: agents, namespaces, control plane.
pub struct TestEnv {
    /// Agents, one per node when started.
    pub agents: Vec<Agent>,
    /// The namespace nodes.
    pub cluster: Cluster,
    /// The control plane.
    pub cp: ControlPlane,
}

impl TestEnv {
    /// Starts the control plane, installs Switchyard, creates `nodes` namespace nodes with
    /// `pods_per_node` pods each, and registers them as Nodes.
    pub async fn start(nodes: usize, pods_per_node: usize) -> Result<Self> {
        let cp = ControlPlane::start().await?;
        install_switchyard(&cp)?;
        let cluster = Cluster::create(nodes, pods_per_node, cp.port)?;
        for node in &cluster.nodes {
            create_node(&cp, node).await?;
        }
        Ok(Self {
            agents: Vec::new(),
            cluster,
            cp,
        })
    }

    /// Starts an agent on every node.
    pub async fn start_agents(&mut self, extra_args: &[&str]) -> Result<()> {
        for node in &self.cluster.nodes {
            let token = agent_token(&self.cp, &node.name).await?;
            self.agents
                .push(Agent::start(&self.cp, node, &token, extra_args)?);
        }
        Ok(())
    }
}

/// For operator-level tests that play the agents: creates `node`'s NodeProxy with an empty spec,
/// owned by its Node, as the agent registers it.
pub async fn register_node_proxy(client: &kube::Client, node: &str, node_uid: &str) -> Result<()> {
    let proxies: Api<switchyard_crds::v1alpha1::NodeProxy> = Api::all(client.clone());
    let np: switchyard_crds::v1alpha1::NodeProxy = serde_json::from_value(json!({
        "apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy",
        "metadata": {"name": node, "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}]},
        "spec": {},
    }))
    .map_err(|e| Error::Prerequisite(e.to_string()))?;
    proxies.create(&PostParams::default(), &np).await?;
    Ok(())
}

/// For operator-level tests that play the agents: writes `status` into `node`'s NodeProxy the way
/// the agent does (server-side apply, field manager `switchyard-agent`).
pub async fn write_agent_status(client: &kube::Client, node: &str, status: serde_json::Value) -> Result<()> {
    let proxies: Api<switchyard_crds::v1alpha1::NodeProxy> = Api::all(client.clone());
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "status": status});
    let params = kube::api::PatchParams::apply(switchyard_crds::consts::AGENT_FIELD_MANAGER).force();
    proxies
        .patch_status(node, &params, &kube::api::Patch::Apply(&body))
        .await?;
    Ok(())
}
