//! A twin: three namespace nodes with two pods each (`pods[0]` runs the echo server, `pods[1]` is
//! a client), served by one proxy — the real kube-proxy or the Switchyard agent — in one mode.
//!
//! The kube-proxy twin and the Switchyard twin of a mode run side by side on the one control
//! plane: every twin has its own fabric namespace, and behind it the same node names, node, pod and
//! bridge addresses ([`Cluster::create`] lays them out the same way each time), so the Node objects,
//! Services and EndpointSlices are written once and name the endpoints of both twins. Each proxy
//! starts on a fresh kernel (no other proxy's rules, conntrack entries or sysctls left behind by a
//! predecessor), sees the same objects at the same time, and the cells run on both at once.

use std::{path::Path, time::Duration};

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};

use crate::{
    Error, Family, Result,
    agent::{self, Agent},
    controlplane::{self, ControlPlane},
    eventually, kernel,
    kube_proxy::{KubeProxy, Mode},
    netns::{Cluster, Node},
    traffic::{Server, http_get, probe, start_server},
};

use super::services;

/// The pod networks, one per family (kube-proxy's `clusterCIDR`, our `--cluster-cidr`).
pub const CLUSTER_CIDRS: &str = "10.244.0.0/16,fd00:10:244::/56";
/// The Service CIDRs (our `--service-cidr`; kube-proxy reads them from the ServiceCIDR objects the
/// apiserver makes of its `--service-cluster-ip-range`).
pub const SERVICE_CIDRS: &str = "10.96.0.0/16,fd00:10:96::/112";
/// kubelet's marker chains, created with iptables-nft on every node as kubelet does on a modern
/// host: kube-proxy's iptables-wrapper and our variant probe both pick iptables-nft from them.
const KUBELET_CHAINS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// Which proxy serves a twin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proxy {
    /// The real kube-proxy.
    KubeProxy,
    /// The Switchyard agent.
    Switchyard,
}

impl Proxy {
    /// Its column name.
    pub fn name(self) -> &'static str {
        match self {
            Proxy::KubeProxy => "kube-proxy",
            Proxy::Switchyard => "switchyard",
        }
    }
}

/// The running processes of a twin's proxy.
enum Running {
    None,
    KubeProxy(Vec<KubeProxy>),
    Switchyard(Vec<Agent>),
}

/// One twin; everything stops on drop (proxies and servers first, then the namespaces).
pub struct Twin {
    /// Which proxy serves it.
    pub proxy: Proxy,
    running: Running,
    _servers: Vec<Server>,
    /// Its namespaces.
    pub cluster: Cluster,
}

/// Registers the Node objects of a twin's layout (the same for every twin).
pub async fn register_nodes(cp: &ControlPlane, cluster: &Cluster) -> Result<()> {
    for node in &cluster.nodes {
        agent::create_node(cp, node).await?;
    }
    Ok(())
}

/// Creates a twin's namespaces, echo servers, fabric routes and kubelet's chains (no proxy yet).
pub fn create_cluster(cp: &ControlPlane) -> Result<(Cluster, Vec<Server>)> {
    let cluster = Cluster::create(3, 2, cp.port)?;
    let servers = cluster
        .nodes
        .iter()
        .map(|n| start_server(&n.pods[0], &[8080], &[5353]))
        .collect::<Result<Vec<_>>>()?;
    for (v4, v6, node) in services::ROUTES {
        let via = &cluster.nodes[node];
        Cluster::exec(
            &cluster.fabric,
            &[
                "ip",
                "-4",
                "route",
                "add",
                &format!("{v4}/32"),
                "via",
                &via.ip.to_string(),
            ],
        )?;
        Cluster::exec(
            &cluster.fabric,
            &[
                "ip",
                "-6",
                "route",
                "add",
                &format!("{v6}/128"),
                "via",
                &via.ip6.to_string(),
            ],
        )?;
    }
    // A refusal is an ICMP error, which the kernel rate-limits per destination (a burst of 6, then
    // one a second): cells running at once from one client would see some refusals as drops.
    // Both twins lift the limit alike; what a proxy sends is unchanged.
    for netns in std::iter::once(&cluster.fabric).chain(cluster.nodes.iter().map(|n| &n.netns)) {
        Cluster::exec(
            netns,
            &[
                "sysctl",
                "-qw",
                "net.ipv4.icmp_ratelimit=0",
                "net.ipv6.icmp.ratelimit=0",
            ],
        )?;
    }
    for node in &cluster.nodes {
        for tool in ["iptables-nft", "ip6tables-nft"] {
            for chain in KUBELET_CHAINS {
                Cluster::exec(&node.netns, &[tool, "-w", "5", "-t", "mangle", "-N", chain])?;
            }
        }
    }
    Ok((cluster, servers))
}

/// A token for `node`'s agent: bound to its agent Pod, created on first use.
async fn token_for(cp: &ControlPlane, node: &str) -> Result<String> {
    let pods: Api<Pod> = Api::namespaced(cp.admin_client().await?, agent::SYSTEM_NAMESPACE);
    if pods.get_opt(&format!("switchyard-agent-{node}")).await?.is_some() {
        agent::node_token(cp, node).await
    } else {
        agent::agent_token(cp, node).await
    }
}

/// The agent's arguments in `mode`: the documented configuration for a dual-stack cluster.
pub fn agent_args(mode: Mode) -> Vec<&'static str> {
    vec![
        "--mode",
        mode.name(),
        "--cluster-cidr",
        CLUSTER_CIDRS,
        "--service-cidr",
        SERVICE_CIDRS,
        "--min-sync-period",
        "0.1",
    ]
}

async fn start_agents(cp: &ControlPlane, cluster: &Cluster, mode: Mode) -> Result<Vec<Agent>> {
    let mut agents = Vec::new();
    for node in &cluster.nodes {
        // A previous mode's agent of this node left its state file: this is a fresh node.
        let state = cp.dir().join(format!("state-{}", node.name));
        remove_dir(&state)?;
        let token = token_for(cp, &node.name).await?;
        agents.push(Agent::start(cp, node, &token, &agent_args(mode))?);
    }
    Ok(agents)
}

fn remove_dir(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(crate::io_err(format!("remove {}", dir.display()))(e))
        }
        _ => Ok(()),
    }
}

impl Twin {
    /// A new twin for `proxy`: namespaces, echo servers, fabric routes, kubelet's chains; no proxy
    /// runs yet.
    pub fn create(cp: &ControlPlane, proxy: Proxy) -> Result<Self> {
        let (cluster, servers) = create_cluster(cp)?;
        Ok(Self {
            proxy,
            running: Running::None,
            _servers: servers,
            cluster,
        })
    }

    /// Starts the twin's proxy in `mode` on every node and waits until it serves (see
    /// [`Twin::wait_served`]).
    pub async fn start(&mut self, cp: &ControlPlane, mode: Mode) -> Result<()> {
        self.running = match self.proxy {
            Proxy::KubeProxy => Running::KubeProxy(
                self.cluster
                    .nodes
                    .iter()
                    .map(|n| KubeProxy::start(cp, n, mode, CLUSTER_CIDRS))
                    .collect::<Result<_>>()?,
            ),
            Proxy::Switchyard => Running::Switchyard(start_agents(cp, &self.cluster, mode).await?),
        };
        self.wait_served(&cp.admin_client().await?, mode).await
    }

    /// Waits until the proxy of every node serves: `web`'s ClusterIP answers the node's client pod
    /// in both families, and the health check of `local` on node-1 says 200. All objects exist
    /// before the proxies start, so their first full sync holds every Service of the matrix.
    async fn wait_served(&mut self, client: &Client, mode: Mode) -> Result<()> {
        let what = format!("{} ({}) serves every node", self.proxy.name(), mode.name());
        let nodes = self.cluster.nodes.clone();
        let served = eventually(Duration::from_secs(120), &what, || async {
            let all = nodes.iter().all(node_served);
            let hc = http_get(
                &self.cluster.fabric,
                std::net::SocketAddr::new(nodes[0].ip.into(), services::HEALTH_CHECK),
                "/",
            )
            .is_ok_and(|(code, _)| code == 200);
            (all && hc).then_some(())
        })
        .await;
        served.map_err(|e| Error::Prerequisite(format!("{e}\n{}", self.logs())))?;
        if self.proxy == Proxy::KubeProxy && mode == Mode::Nftables {
            // kube-proxy learns the Service CIDRs from ServiceCIDR objects, on a watch of its own:
            // its drop of unallocated addresses can come after its first sync, at its next one.
            crate::kube_proxy::await_cidr_drop(client, Duration::from_secs(120), || {
                cidr_drops_missing(&nodes).is_empty()
            })
            .await
            .map_err(|e| {
                let missing = cidr_drops_missing(&nodes).join(", ");
                Error::Prerequisite(format!("{what}: {e} (missing: {missing})\n{}", self.logs()))
            })?;
        }
        for node in &nodes {
            programmed(self.proxy, mode, node)?;
        }
        if !self.running() {
            return Err(Error::Prerequisite(format!(
                "{what}: a proxy exited\n{}",
                self.logs()
            )));
        }
        Ok(())
    }

    /// Whether every proxy process still runs.
    pub fn running(&mut self) -> bool {
        match &mut self.running {
            Running::None => false,
            Running::KubeProxy(p) => p.iter_mut().all(|k| k.running()),
            Running::Switchyard(a) => a.iter_mut().all(|a| a.exit_status().is_none()),
        }
    }

    /// The last lines of every proxy's log, for failure messages.
    pub fn logs(&self) -> String {
        let texts: Vec<(String, String)> = match &self.running {
            Running::None => Vec::new(),
            Running::KubeProxy(p) => p.iter().map(|k| (k.node.clone(), k.log_text())).collect(),
            Running::Switchyard(a) => a.iter().map(|a| (a.node.clone(), a.log_text())).collect(),
        };
        texts
            .iter()
            .map(|(node, text)| {
                let lines: Vec<&str> = text.lines().collect();
                format!(
                    "--- {node}:\n{}",
                    lines[lines.len().saturating_sub(20)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Checks that `proxy` programmed `node` in `mode` and nothing else: kube-proxy's `kube-proxy` nft
/// table or its `KUBE-SERVICES` chain in iptables-nft; our `switchyard` table or `SWY-SERVICES`
/// in iptables-nft (the variant kubelet's chains select), never the other backend.
fn programmed(proxy: Proxy, mode: Mode, node: &Node) -> Result<()> {
    let tables = kernel::nft_tables(&node.netns)?;
    let save = Cluster::exec(&node.netns, &["iptables-nft-save"])?;
    let (nft, ipt) = match proxy {
        Proxy::KubeProxy => (
            tables.contains("table ip kube-proxy"),
            save.contains(":KUBE-SERVICES"),
        ),
        Proxy::Switchyard => (
            tables.contains("table ip switchyard"),
            save.contains(":SWY-SERVICES"),
        ),
    };
    let want = (mode == Mode::Nftables, mode != Mode::Nftables);
    if (nft, ipt) == want {
        return Ok(());
    }
    Err(Error::Prerequisite(format!(
        "{} in {} mode on {}: nft table {nft}, iptables-nft chains {ipt}\n{tables}\n{save}",
        proxy.name(),
        mode.name(),
        node.name
    )))
}

/// The Service CIDRs of both families, with the nft family of kube-proxy's table.
const CIDR_DROPS: [(&str, &str); 2] = [
    ("ip", controlplane::SERVICE_CIDR),
    ("ip6", controlplane::SERVICE_CIDR6),
];

/// Whether kube-proxy's `cluster-ips-check` chain of `family` on `node` drops `cidr`.
fn drops_cidr(node: &Node, family: &str, cidr: &str) -> bool {
    Cluster::exec(
        &node.netns,
        &["nft", "list", "chain", family, "kube-proxy", "cluster-ips-check"],
    )
    .is_ok_and(|chain| chain.contains(cidr))
}

/// `node family` of every drop of unallocated Service-CIDR addresses still missing (kube-proxy's
/// nftables `cluster-ips-check` chain of each family on each node must drop its Service CIDR).
fn cidr_drops_missing(nodes: &[Node]) -> Vec<String> {
    nodes
        .iter()
        .flat_map(|n| CIDR_DROPS.iter().map(move |(family, cidr)| (n, *family, *cidr)))
        .filter(|(n, family, cidr)| !drops_cidr(n, family, cidr))
        .map(|(n, family, _)| format!("{} {family}", n.name))
        .collect()
}

fn node_served(node: &Node) -> bool {
    Family::BOTH.iter().all(|&f| {
        let Some(ip) = services::cluster_ip("web", f) else {
            return false;
        };
        probe(
            &node.pods[1].netns,
            std::net::SocketAddr::new(ip, 80),
            false,
            3,
            1000,
        )
        .is_ok_and(|o| o.iter().all(|x| x.server().is_some()))
    })
}
