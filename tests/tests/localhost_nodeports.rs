//! A ProxyPolicy's `proxy.localhostNodePorts`, in nftables and in iptables mode, on a real
//! apiserver through a real operator to the node's NodeProxy, with real traffic from the node's
//! namespace to `127.0.0.1:<NodePort>`:
//! - without the field each mode does as kube-proxy: nftables refuses `127.0.0.1:<NodePort>`
//!   and leaves `route_localnet` alone, iptables serves it with `route_localnet=1`;
//! - `localhostNodePorts: true`: it answers from the pod behind the Service, masqueraded to the
//!   node's address on the pod bridge, with `route_localnet=1`, the `LocalhostNodePorts` condition True, and the
//!   guard dropping a pod's connection to a service bound on the node's loopback (CVE-2020-8558);
//! - turned to `false` live: refused at once (a reset, not a timeout), the node's own
//!   `route_localnet` (0) back and forgotten in the state file, the condition gone, the
//!   NodePort still answering on the node's address, and the agent never restarted.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::NodeProxy;
use switchyard_e2e::{
    agent::{Agent, TestEnv},
    eventually,
    netns::{Cluster, Pod},
    objects::{Ep, apply_service, apply_slice},
    operator::Operator,
    traffic::{Outcome, probe, start_server},
};

const CLUSTER_IP: &str = "10.96.0.130";
const NODE_PORT: u16 = 30090;
/// A port the node's own service listens on (the target of the guard check).
const NODE_LOCAL_PORT: u16 = 9099;
const LIMIT: Duration = Duration::from_secs(60);
const ROUTE_LOCALNET: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";
const CONDITION: &str = "LocalhostNodePorts";

/// Waits for `check` (generous bound); a timeout fails with the agent's log.
async fn until<T, F, Fut>(agent: &Agent, what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually(LIMIT, what, check)
        .await
        .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log_text()))
}

/// The node's `route_localnet`.
fn route_localnet(netns: &str) -> String {
    Cluster::exec(netns, &["cat", ROUTE_LOCALNET])
        .expect("read route_localnet")
        .trim()
        .to_owned()
}

/// `count` TCP attempts from the node to `127.0.0.1:<NodePort>`.
fn localhost(netns: &str, count: u32) -> Vec<Outcome> {
    let target = SocketAddr::from((Ipv4Addr::LOCALHOST, NODE_PORT));
    probe(netns, target, false, count, 2000).expect("probe 127.0.0.1")
}

/// Every attempt answered by `pod`, which saw the node's address on the pod bridge
/// (masqueraded: it cannot answer 127.0.0.1).
fn served_by(outcomes: &[Outcome], pod: &Pod) -> bool {
    let node_side = IpAddr::V4(node_gateway(pod));
    outcomes
        .iter()
        .all(|o| o.server() == Some(pod.name.as_str()) && o.peer_ip() == Some(node_side))
}

fn all_refused(outcomes: &[Outcome]) -> bool {
    outcomes.iter().all(|o| *o == Outcome::Refused)
}

/// Applies the policy in `mode` with `proxy` settings or none.
fn apply_policy(env: &TestEnv, mode: &str, proxy: Option<Value>) {
    let mut spec = json!({"nodeSelector": {"matchLabels": {"pool": "lnp"}}, "mode": mode});
    if let Some(proxy) = proxy {
        spec["proxy"] = proxy;
    }
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
        "metadata": {"name": "localhost"}, "spec": spec});
    env.cp.apply_json(&body).expect("apply policy");
}

/// Waits until the NodeProxy spec's `localhostNodePorts` is `value`.
async fn spec_reached(proxies: &Api<NodeProxy>, node: &str, value: bool) {
    eventually(LIMIT, "localhostNodePorts in the NodeProxy spec", || async move {
        let np = proxies.get(node).await.ok()?;
        (np.spec.proxy?.localhost_node_ports == Some(value)).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The node's `LocalhostNodePorts` condition (status, reason), `None` when it has none.
async fn condition(proxies: &Api<NodeProxy>, node: &str) -> Option<Option<(String, String)>> {
    let status = proxies.get(node).await.ok()?.status?;
    Some(
        status
            .conditions
            .into_iter()
            .find(|c| c.type_ == CONDITION)
            .map(|c| (c.status, c.reason)),
    )
}

/// Whether the agent's state file remembers a replaced `route_localnet`.
fn state_remembers(env: &TestEnv, node: &str) -> bool {
    let file = env.cp.dir().join(format!("state-{node}")).join("state.json");
    std::fs::read_to_string(file).is_ok_and(|s| s.contains("routeLocalnet"))
}

/// Routes the pod's traffic to `127.0.0.0/8` to the node, as an attacker next to the node would
/// send it (CVE-2020-8558): a rule before the pod's own `local` table.
fn route_pod_loopback_to_node(pod: &Pod, node_gateway: &str) {
    let steps: [&[&str]; 6] = [
        &["sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1"],
        &[
            "ip",
            "route",
            "add",
            "127.0.0.0/8",
            "via",
            node_gateway,
            "table",
            "100",
        ],
        &[
            "ip",
            "rule",
            "add",
            "to",
            "127.0.0.0/8",
            "lookup",
            "100",
            "pref",
            "10",
        ],
        &["ip", "rule", "add", "lookup", "local", "pref", "300"],
        &["ip", "rule", "del", "pref", "0"],
        &["ip", "rule", "show"],
    ];
    for step in steps {
        Cluster::exec(&pod.netns, step).unwrap_or_else(|e| panic!("{step:?} in {}: {e}", pod.netns));
    }
}

/// One node in the policy's pool with a pod serving a NodePort Service, a server on the node
/// itself, an agent in `mode` and an operator.
struct Setup {
    env: TestEnv,
    _operator: Operator,
    proxies: Api<NodeProxy>,
    _servers: Vec<switchyard_e2e::traffic::Server>,
}

async fn setup(mode: &str) -> Setup {
    let mut env = TestEnv::start(1, 1).await.expect("control plane and a node");
    let admin = env.cp.admin_client().await.expect("admin");
    let node = env.cluster.nodes[0].clone();
    let pod = node.pods[0].clone();
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    let label = json!({"metadata": {"labels": {"pool": "lnp"}}});
    nodes
        .patch(&node.name, &PatchParams::default(), &Patch::Merge(&label))
        .await
        .expect("label node");
    let spec = json!({"type": "NodePort", "clusterIP": CLUSTER_IP,
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": NODE_PORT}]});
    apply_service(&admin, "web", spec, None).await.expect("service");
    apply_slice(
        &admin,
        "web",
        &[("http", 8080, "TCP")],
        &[Ep::ready(pod.ip, &node.name)],
    )
    .await
    .expect("slice");
    // The pod behind the Service, and a service of the node's own on every address (loopback
    // included), which the guard must keep from the pod.
    let on_node = Pod {
        name: format!("{}-itself", node.name),
        netns: node.netns.clone(),
        ip: node.ip,
        ip6: node.ip6,
    };
    let servers = vec![
        start_server(&pod, &[8080], &[]).expect("pod server"),
        start_server(&on_node, &[NODE_LOCAL_PORT], &[]).expect("node server"),
    ];
    assert_eq!(
        route_localnet(&node.netns),
        "0",
        "a fresh node namespace starts with route_localnet=0"
    );
    env.start_agents(&["--mode", mode, "--cluster-cidr", "10.244.0.0/16"])
        .await
        .expect("agent");
    let operator = Operator::start(&env.cp, "op-a", &[]).await.expect("operator");
    Setup {
        env,
        _operator: operator,
        proxies: Api::all(admin),
        _servers: servers,
    }
}

async fn localhost_node_ports_follow_the_policy(mode: &str) {
    // Bound by name: a `..` would drop the operator and the servers at once.
    let Setup {
        env,
        proxies,
        _operator: _running_operator,
        _servers: _running_servers,
    } = setup(mode).await;
    let node = env.cluster.nodes[0].clone();
    let pod = node.pods[0].clone();
    let (netns, agent) = (node.netns.as_str(), &env.agents[0]);
    let on_node_ip = SocketAddr::from((node.ip, NODE_PORT));
    until(agent, "the NodePort answering on the node's address", || async {
        let o = probe(netns, on_node_ip, false, 3, 2000).ok()?;
        o.iter()
            .all(|o| o.server() == Some(pod.name.as_str()))
            .then_some(())
    })
    .await;

    // No policy field: kube-proxy's default of the mode.
    if mode == "nftables" {
        let o = localhost(netns, 3);
        assert!(all_refused(&o), "nftables default: refused: {o:?}");
        assert_eq!(route_localnet(netns), "0", "nftables default: left alone");
    } else {
        until(agent, "iptables default: 127.0.0.1 served", || async {
            served_by(&localhost(netns, 3), &pod).then_some(())
        })
        .await;
        assert_eq!(route_localnet(netns), "1", "iptables default: set");
    }

    // On.
    apply_policy(&env, mode, Some(json!({"localhostNodePorts": true})));
    spec_reached(&proxies, &node.name, true).await;
    let o = until(agent, "127.0.0.1 served by the pod", || async {
        let o = localhost(netns, 5);
        served_by(&o, &pod).then_some(o)
    })
    .await;
    println!("{mode}: localhostNodePorts=true: {o:?}");
    assert_eq!(route_localnet(netns), "1");
    let c = until(agent, "the LocalhostNodePorts condition", || async {
        condition(&proxies, &node.name).await.flatten()
    })
    .await;
    assert_eq!(c, ("True".to_owned(), "Served".to_owned()));
    until(agent, "the replaced route_localnet in the state file", || async {
        state_remembers(&env, &node.name).then_some(())
    })
    .await;
    // The guard: with route_localnet=1 a pod's connection to the node's loopback is dropped.
    route_pod_loopback_to_node(&pod, &node_gateway(&pod).to_string());
    let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, NODE_LOCAL_PORT));
    let o = probe(&pod.netns, loopback, false, 2, 1000).expect("probe from the pod");
    assert!(
        o.iter().all(|o| *o == Outcome::Timeout),
        "{mode}: the pod reached the node's loopback: {o:?}"
    );
    let o = probe(netns, loopback, false, 1, 2000).expect("probe on the node");
    assert!(
        o[0].server().is_some(),
        "the node's own service answers locally: {o:?}"
    );

    // Off, live.
    apply_policy(&env, mode, Some(json!({"localhostNodePorts": false})));
    let applied = Instant::now();
    spec_reached(&proxies, &node.name, false).await;
    let in_spec = Instant::now();
    until(agent, "127.0.0.1 refused", || async {
        all_refused(&localhost(netns, 1)).then_some(())
    })
    .await;
    println!(
        "{mode}: localhostNodePorts=false: refused {:?} after the apply, {:?} after the NodeProxy spec had it",
        applied.elapsed(),
        in_spec.elapsed()
    );
    let o = localhost(netns, 5);
    assert!(all_refused(&o), "{mode}: refused at once, every time: {o:?}");
    until(agent, "route_localnet back to the node's 0", || async {
        (route_localnet(netns) == "0").then_some(())
    })
    .await;
    until(agent, "the LocalhostNodePorts condition gone", || async {
        condition(&proxies, &node.name).await.filter(Option::is_none)
    })
    .await;
    until(agent, "route_localnet forgotten in the state file", || async {
        (!state_remembers(&env, &node.name)).then_some(())
    })
    .await;
    let o = probe(netns, on_node_ip, false, 3, 2000).expect("probe");
    assert!(
        o.iter().all(|o| o.server() == Some(pod.name.as_str())),
        "{mode}: the NodePort on the node's address: {o:?}"
    );
    let mut env = env;
    assert!(
        env.agents[0].exit_status().is_none(),
        "the agent was never restarted"
    );
}

/// The pod's gateway: the node's address on the pod bridge (`10.244.i.1`).
fn node_gateway(pod: &Pod) -> Ipv4Addr {
    let [a, b, c, _] = pod.ip.octets();
    Ipv4Addr::new(a, b, c, 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn localhost_node_ports_in_nftables_mode_follow_the_policy_live() {
    localhost_node_ports_follow_the_policy("nftables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn localhost_node_ports_in_iptables_mode_follow_the_policy_live() {
    localhost_node_ports_follow_the_policy("iptables").await;
}
