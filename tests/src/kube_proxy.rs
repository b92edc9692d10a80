//! Running the real kube-proxy (built by `scripts/build-control-plane.sh` at the pinned Kubernetes
//! version) in a namespace node, as [`crate::agent::Agent`] runs our agent: the incumbent that
//! takeover tests replace, and an oracle to compare with.
//!
//! It runs with a config file (`KubeProxyConfiguration`): `--hostname-override` is the node's name,
//! `clusterCIDR` the pod CIDRs, `mode` iptables or nftables, metrics and healthz on the node
//! namespace's own loopback, and conntrack sysctls left alone (`maxPerCore: 0`, zero timeouts: the
//! conntrack table size is global, not the namespace's to set). It authenticates with the admin
//! certificate. `nft`, the iptables tools and `conntrack` come from `PATH`; for iptables mode the
//! harness puts a directory first in `PATH` whose `iptables*`/`ip6tables*` point at the chosen
//! variant, as iptables-wrapper does in kube-proxy's image.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::{
    Api, Client, ResourceExt,
    api::{ListParams, Patch, PatchParams},
};
use serde_json::json;

use crate::{
    Result, binaries,
    controlplane::{self, ControlPlane, Credential},
    io_err,
    netns::Node,
    sweep,
};

/// kube-proxy's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `iptables`, with the iptables variant (`"nft"` or `"legacy"`) its `iptables` runs.
    Iptables(&'static str),
    /// `nftables`.
    Nftables,
}

impl Mode {
    /// The `mode` of the configuration (and our agent's `--mode`).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Iptables(_) => "iptables",
            Mode::Nftables => "nftables",
        }
    }
}

/// A running kube-proxy; stopped on drop.
pub struct KubeProxy {
    /// Node it serves.
    pub node: String,
    /// Its log file.
    pub log: PathBuf,
    child: Option<Child>,
}

impl KubeProxy {
    /// Starts kube-proxy in `node`'s namespace in `mode`; `cluster_cidr` is comma-separated, one
    /// per family.
    pub fn start(cp: &ControlPlane, node: &Node, mode: Mode, cluster_cidr: &str) -> Result<Self> {
        let dir = cp.dir().join(format!("kube-proxy-{}", node.name));
        std::fs::create_dir_all(&dir).map_err(io_err("kube-proxy dir"))?;
        let server = format!("https://{}:{}", controlplane::ADVERTISE_ADDRESS, cp.port);
        let kubeconfig =
            cp.write_kubeconfig(&format!("kube-proxy-{}", node.name), &server, Credential::Admin)?;
        let config = format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             mode: {mode}\nclusterCIDR: {cluster_cidr}\nhostnameOverride: {name}\n\
             metricsBindAddress: 127.0.0.1:10249\nhealthzBindAddress: 127.0.0.1:10256\n\
             clientConnection:\n  kubeconfig: {kubeconfig}\n\
             conntrack:\n  maxPerCore: 0\n  min: 0\n  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n",
            mode = mode.name(),
            name = node.name,
            kubeconfig = kubeconfig.display(),
        );
        let config_path = dir.join("config.yaml");
        std::fs::write(&config_path, config).map_err(io_err("kube-proxy config"))?;
        // iptables-wrapper's job: `iptables*` of the chosen variant first in PATH.
        let tools = dir.join("bin");
        std::fs::create_dir_all(&tools).map_err(io_err("kube-proxy tools"))?;
        let variant = match mode {
            Mode::Iptables(v) => v,
            Mode::Nftables => "nft",
        };
        for family in ["iptables", "ip6tables"] {
            for suffix in ["", "-save", "-restore"] {
                let link = tools.join(format!("{family}{suffix}"));
                let _ = std::fs::remove_file(&link);
                std::os::unix::fs::symlink(format!("/usr/sbin/{family}-{variant}{suffix}"), &link)
                    .map_err(io_err("kube-proxy tool link"))?;
            }
        }
        let path = format!(
            "{}:{}",
            tools.display(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
        );
        let bin = binaries::control_plane_bin()?.join("kube-proxy");
        let log = cp.dir().join(format!("kube-proxy-{}.log", node.name));
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(io_err("kube-proxy log"))?;
        let out = err.try_clone().map_err(io_err("kube-proxy log"))?;
        let child = Command::new("ip")
            .args(["netns", "exec", &node.netns])
            .arg(&bin)
            .arg(format!("--config={}", config_path.display()))
            .arg(format!("--hostname-override={}", node.name))
            .arg("--v=2")
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err("start kube-proxy"))?;
        sweep::record_pid(cp.dir(), child.id());
        Ok(Self {
            node: node.name.clone(),
            log,
            child: Some(child),
        })
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        crate::logs::read(&self.log)
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Stops it as a DaemonSet's pod is stopped (SIGTERM, then SIGKILL after a grace period):
    /// kube-proxy leaves its rules in the kernel (KEP-2448), so the node keeps being served.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            sweep::stop_child(&mut child, Duration::from_secs(10));
        }
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The Node label kube-proxy's topology handling watches (`topology.kubernetes.io/zone`).
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Makes every running kube-proxy run a full sync, in both families: each Node's zone label is
/// set to a throwaway value and then put back as it was. kube-proxy (nftables, v1.37) writes its
/// fixed chains, the Service-CIDR drop among them, only at a full sync (`setupNFTables`), and a
/// change of its node's topology labels is what forces one (`OnTopologyChange` sets
/// `needFullSync`); a Service or endpoint change makes only a partial sync, and the next periodic
/// full sync is an hour away.
async fn force_full_sync(client: &Client) -> Result<()> {
    let nodes: Api<NodeObject> = Api::all(client.clone());
    for node in nodes.list(&ListParams::default()).await? {
        let name = node.name_any();
        let original = node
            .labels()
            .get(ZONE_LABEL)
            .map_or(serde_json::Value::Null, |zone| json!(zone));
        for zone in [json!("switchyard-test-full-sync"), original] {
            let patch = json!({"metadata": {"labels": {ZONE_LABEL: zone}}});
            nodes
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
    }
    Ok(())
}

/// Waits up to `limit` until `dropped()` holds: kube-proxy in nftables mode drops traffic to
/// unallocated Service-CIDR addresses. It renders that drop at a full sync after its ServiceCIDR
/// informer delivered, but that event alone does not make it sync (`OnServiceCIDRsChanged` only
/// records the CIDRs): when the informer comes after its first sync, the drop waits for the next
/// full sync. So every 10 s without the drop a full sync is forced ([`force_full_sync`]; CI saw
/// the drop missing for 120 s while Services were created and deleted to make it sync, which
/// gives only partial syncs).
pub async fn await_cidr_drop(client: &Client, limit: Duration, dropped: impl Fn() -> bool) -> Result<()> {
    let start = Instant::now();
    let mut nudged = Instant::now();
    loop {
        if dropped() {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(crate::Error::Timeout(
                limit,
                "kube-proxy's drop of unallocated Service-CIDR addresses".into(),
            ));
        }
        if nudged.elapsed() > Duration::from_secs(10) {
            force_full_sync(client).await?;
            nudged = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
