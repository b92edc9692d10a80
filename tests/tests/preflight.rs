//! Migration preflight on the real apiserver, operator and agents in namespace nodes, from
//! measured facts: two nodes run iptables mode; node-1 has a client of `127.0.0.1:<NodePort>`
//! (real connections through the agent's localhost NodePort rules), node-2 drops
//! conntrack-invalid packets (a pod's established connection through node-2 whose conntrack
//! entry is deleted while `nf_conntrack_tcp_loose=0`: its next segments are INVALID in node-2's
//! forward path and dropped by the agent's rule). Both agents export the kernel's nfacct counts
//! under kube-proxy's metric names and in `status.preflightFacts`. A policy to nftables holds
//! both nodes with `PreflightPassed=False` naming each node's finding and what to change; the
//! plugin's `plan` lists them; accepting LocalhostNodePorts lets node-1 switch while node-2 stays
//! held; setting `nf_conntrack_tcp_be_liberal=1` on node-2 (the fix) lets it switch too.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsFd,
    time::Duration,
};

use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{NodeProxy, PreflightFacts, ProxyMode, ProxyPolicy};
use switchyard_e2e::{
    agent::TestEnv,
    eventually,
    netns::{Cluster, Pod},
    objects::{Ep, apply_service, apply_slice},
    operator::Operator,
    throughout, tools,
    traffic::{http_get, probe, start_server},
};

const POLICY: &str = "preflight";
const CLUSTER_IP: &str = "10.96.0.140";
const NODE_PORT: u16 = 30140;
/// The port of the connection node-2 forwards (pod on node-2 to the pod on node-1).
const FORWARDED_PORT: u16 = 9400;
const LIMIT: Duration = Duration::from_secs(120);

/// Every agent's and the operator's log, for a failure message.
fn logs(env: &TestEnv, op: &Operator) -> String {
    let agents: String = env
        .agents
        .iter()
        .zip(&env.cluster.nodes)
        .map(|(a, n)| format!("--- agent on {}:\n{}", n.name, a.log_text()))
        .collect();
    format!("{agents}--- operator:\n{}", op.log_text())
}

/// Runs `f` on a thread inside network namespace `netns` (sockets made there stay there).
fn in_netns<T: Send>(netns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = std::fs::File::open(format!("/run/netns/{netns}")).expect("open netns");
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("thread in netns")
    })
}

/// The policy: nftables on pool `pf`, both nodes at once, accepting `accept`.
fn apply_policy(env: &TestEnv, accept: &[&str]) {
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
    "metadata": {"name": POLICY},
    "spec": {
        "nodeSelector": {"matchLabels": {"pool": "pf"}},
        "mode": "nftables",
        "rollout": {"maxUnavailable": 2, "preflight": {"accept": accept}},
        "healthGate": {"minHealthySeconds": 2, "timeoutSeconds": 60, "failureThreshold": 3},
    }});
    env.cp.apply_json(&body).expect("apply policy");
}

/// The facts node `name`'s agent reports.
async fn facts(proxies: &Api<NodeProxy>, name: &str) -> Option<PreflightFacts> {
    proxies.get(name).await.ok()?.status?.preflight_facts
}

/// The mode node `name` runs (phase Active).
async fn active(proxies: &Api<NodeProxy>, name: &str) -> Option<ProxyMode> {
    let status = proxies.get(name).await.ok()?.status?;
    (status.phase == Some(switchyard_crds::v1alpha1::SwitchPhase::Active))
        .then_some(status.active_mode)
        .flatten()
}

/// The policy's condition `kind` (status, message), once its generation is observed.
async fn condition(policies: &Api<ProxyPolicy>, kind: &str) -> Option<(String, String)> {
    let p = policies.get(POLICY).await.ok()?;
    let status = p.status?;
    if status.observed_generation != p.metadata.generation {
        return None;
    }
    let c = status.conditions.into_iter().find(|c| c.type_ == kind)?;
    Some((c.status, c.message))
}

/// The value of the metric line `name` on the agent's metrics endpoint in `netns`.
fn metric(netns: &str, name: &str) -> Option<u64> {
    let target: SocketAddr = "127.0.0.1:10249".parse().ok()?;
    let (code, body) = http_get(netns, target, "/metrics").ok()?;
    (code == 200).then_some(())?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A connection from `client` (behind node-2) to `server` (behind node-1) through node-2, whose
/// conntrack entry node-2 forgets while it picks up no connection midstream: what the client
/// sends next is INVALID there. Returns the two ends (kept open: their retransmissions go on).
fn invalid_through(node2_netns: &str, client: &Pod, server: &Pod) -> (TcpStream, TcpStream) {
    Cluster::exec(
        node2_netns,
        &["sysctl", "-q", "-w", "net.netfilter.nf_conntrack_tcp_loose=0"],
    )
    .expect("tcp_loose=0 on node-2");
    let addr = SocketAddr::from((server.ip, FORWARDED_PORT));
    let listener = in_netns(&server.netns, || TcpListener::bind(addr)).expect("listen on node-1's pod");
    let mut near = in_netns(&client.netns, || {
        TcpStream::connect_timeout(&addr, Duration::from_secs(5))
    })
    .expect("connect through node-2");
    let (mut far, _) = listener.accept().expect("accept");
    far.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    near.write_all(b"before").expect("write");
    let mut got = [0u8; 6];
    far.read_exact(&mut got).expect("the connection works before");
    let port = FORWARDED_PORT.to_string();
    Cluster::exec(
        node2_netns,
        &["conntrack", "-D", "-p", "tcp", "--orig-port-dst", &port],
    )
    .expect("delete the connection's conntrack entry on node-2");
    near.write_all(b"after").expect("write after");
    (near, far)
}

#[tokio::test(flavor = "multi_thread")]
async fn blocking_findings_hold_nodes_until_accepted_or_fixed() {
    let mut env = TestEnv::start(2, 1).await.expect("control plane and two nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    for n in &env.cluster.nodes {
        let label = json!({"metadata": {"labels": {"pool": "pf"}}});
        nodes
            .patch(&n.name, &PatchParams::default(), &Patch::Merge(&label))
            .await
            .expect("label node");
    }
    let (n1, n2) = (env.cluster.nodes[0].clone(), env.cluster.nodes[1].clone());
    let (pod1, pod2) = (n1.pods[0].clone(), n2.pods[0].clone());
    let spec = json!({"type": "NodePort", "clusterIP": CLUSTER_IP,
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": NODE_PORT}]});
    apply_service(&admin, "web", spec, None).await.expect("service");
    apply_slice(
        &admin,
        "web",
        &[("http", 8080, "TCP")],
        &[Ep::ready(pod1.ip, &n1.name)],
    )
    .await
    .expect("slice");
    let _server = start_server(&pod1, &[8080], &[]).expect("pod server");
    env.start_agents(&["--mode", "iptables", "--cluster-cidr", "10.244.0.0/16"])
        .await
        .expect("agents");
    let op = Operator::start(&env.cp, "op-a", &[]).await.expect("operator");
    let proxies: Api<NodeProxy> = Api::all(admin.clone());
    let policies: Api<ProxyPolicy> = Api::all(admin.clone());
    macro_rules! fail {
        ($e:expr) => {
            panic!("{}\n{}", $e, logs(&env, &op))
        };
    }

    // node-1: a client of 127.0.0.1:<NodePort>, served by iptables mode.
    let localhost = SocketAddr::from(([127, 0, 0, 1], NODE_PORT));
    eventually(LIMIT, "127.0.0.1:<NodePort> answered on node-1", || async {
        let o = probe(&n1.netns, localhost, false, 3, 2000).ok()?;
        o.iter()
            .all(|o| o.server() == Some(pod1.name.as_str()))
            .then_some(())
    })
    .await
    .unwrap_or_else(|e| fail!(e));
    // node-2: conntrack-invalid drops in its forward path, once its agent's rules count them
    // (the connection must be tracked there from its first packet).
    eventually(LIMIT, "node-2's conntrack-invalid counter in place", || async {
        let f = facts(&proxies, &n2.name).await?;
        (f.ct_state_invalid_dropped_packets == Some(0)).then_some(())
    })
    .await
    .unwrap_or_else(|e| fail!(e));
    let _connection = invalid_through(&n2.netns, &pod2, &pod1);

    // Measured: the kernel's counts on the metrics endpoint and in the facts.
    let localhost_metric = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total";
    let invalid_metric = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total";
    let (n1_lo, n2_inv) = eventually(LIMIT, "both counters in the NodeProxy facts", || async {
        let (f1, f2) = (facts(&proxies, &n1.name).await?, facts(&proxies, &n2.name).await?);
        let lo = f1.localhost_node_ports_accepted_packets.filter(|n| *n > 0)?;
        let inv = f2.ct_state_invalid_dropped_packets.filter(|n| *n > 0)?;
        Some((lo, inv))
    })
    .await
    .unwrap_or_else(|e| fail!(e));
    println!("facts: node-1 localhost NodePort packets {n1_lo}, node-2 conntrack-invalid drops {n2_inv}");
    assert!(
        metric(&n1.netns, localhost_metric).is_some_and(|n| n > 0),
        "node-1 {localhost_metric}"
    );
    assert!(
        metric(&n2.netns, invalid_metric).is_some_and(|n| n > 0),
        "node-2 {invalid_metric}"
    );
    let (f1, f2) = (
        facts(&proxies, &n1.name).await.expect("facts"),
        facts(&proxies, &n2.name).await.expect("facts"),
    );
    assert_eq!(
        f1.ct_state_invalid_dropped_packets,
        Some(0),
        "node-1 drops nothing: {f1:?}"
    );
    assert_eq!(
        f2.localhost_node_ports_accepted_packets,
        Some(0),
        "node-2 has no localhost client: {f2:?}"
    );
    assert_eq!((f1.tcp_be_liberal, f2.tcp_be_liberal), (Some(false), Some(false)));

    // A policy to nftables holds both, saying why and what to change.
    apply_policy(&env, &[]);
    let (_, message) = eventually(LIMIT, "PreflightPassed=False naming both nodes", || async {
        let (status, message) = condition(&policies, "PreflightPassed").await?;
        (status == "False"
            && message.contains("2 node(s) held")
            && message.contains(&format!("{}: LocalhostNodePorts", n1.name))
            && message.contains(&format!("{}: ConntrackInvalidDrops", n2.name)))
        .then_some((status, message))
    })
    .await
    .unwrap_or_else(|e| fail!(e));
    println!("PreflightPassed=False: {message}");
    assert!(
        message.contains("localhostNodePorts: true") && message.contains("tcpBeLiberal: true"),
        "{message}"
    );
    let held = |names: Vec<String>| {
        let proxies = proxies.clone();
        move || {
            let (proxies, names) = (proxies.clone(), names.clone());
            async move {
                for n in &names {
                    let np = proxies.get(n).await.map_err(|e| e.to_string())?;
                    if np.spec.desired_mode == Some(ProxyMode::Nftables) {
                        return Err(format!("{n} released: {:?}", np.spec));
                    }
                }
                Ok(())
            }
        }
    };
    throughout(
        Duration::from_secs(5),
        held(vec![n1.name.clone(), n2.name.clone()]),
    )
    .await
    .unwrap_or_else(|e| fail!(e));

    // The plugin's plan shows each node's findings.
    let (ok, out, err) = tools::plugin(&env.cp.admin_kubeconfig(), &["plan", POLICY]).expect("plugin");
    println!("$ kubectl switchyard plan {POLICY}\n{out}");
    assert!(ok, "{out}{err}");
    let row = |node: &str, finding: &str| {
        out.lines()
            .find(|l| l.starts_with(node) && l.contains(finding))
            .unwrap_or_else(|| panic!("no {finding} row for {node}:\n{out}"))
            .to_owned()
    };
    assert!(row(&n1.name, "LocalhostNodePorts").contains("blocking"));
    assert!(row(&n2.name, "ConntrackInvalidDrops").contains("blocking"));
    assert!(out.contains("preflight: 2 node(s) held"), "{out}");

    // Accepting node-1's finding lets it switch; node-2 stays held.
    apply_policy(&env, &["LocalhostNodePorts"]);
    eventually(LIMIT, "node-1 switched to nftables", || async {
        (active(&proxies, &n1.name).await == Some(ProxyMode::Nftables)).then_some(())
    })
    .await
    .unwrap_or_else(|e| fail!(e));
    throughout(Duration::from_secs(3), held(vec![n2.name.clone()]))
        .await
        .unwrap_or_else(|e| fail!(e));
    let (status, message) = condition(&policies, "PreflightPassed").await.expect("condition");
    assert!(
        status == "False" && message.contains("1 node(s) held") && message.contains(&n2.name),
        "{status}: {message}"
    );

    // Fixing node-2 (tcp_be_liberal=1, read into its facts) lets it switch.
    Cluster::exec(
        &n2.netns,
        &[
            "sysctl",
            "-q",
            "-w",
            "net.netfilter.nf_conntrack_tcp_be_liberal=1",
        ],
    )
    .expect("tcp_be_liberal=1 on node-2");
    eventually(LIMIT, "node-2 switched to nftables, the policy Ready", || async {
        let n2_on = active(&proxies, &n2.name).await == Some(ProxyMode::Nftables);
        let (passed, _) = condition(&policies, "PreflightPassed").await?;
        let (ready, _) = condition(&policies, "Ready").await?;
        (n2_on && passed == "True" && ready == "True").then_some(())
    })
    .await
    .unwrap_or_else(|e| fail!(e));
    let last: Value = serde_json::to_value(proxies.get(&n2.name).await.expect("np").status).expect("json");
    println!("node-2 lastSwitch: {}", last["lastSwitch"]);
}
