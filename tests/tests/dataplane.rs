//! The agent as the service proxy, per backend, with real traffic between namespace nodes:
//! ClusterIP (TCP and UDP) with load spread, session affinity, NodePort, externalIPs,
//! LoadBalancer IPs with source ranges, externalTrafficPolicy=Local (source IP preserved),
//! internalTrafficPolicy=Local, terminating-endpoint fallback, no endpoints → refused at once,
//! hairpin, endpoint removal, Service deletion (checked in the kernel), agent restart without
//! a data-path flush, and `--cleanup`.

use std::{net::SocketAddr, time::Duration};

use serde_json::json;
use switchyard_e2e::{
    agent::{Agent, TestEnv},
    binaries,
    netns::Cluster,
    objects::{Ep, apply_service, apply_slice, delete_service},
    traffic::{Outcome, http_get, probe, start_server, tally},
};

const WEB: &str = "10.96.0.100";
const STICKY: &str = "10.96.0.101";
const NODEPORT_SVC: &str = "10.96.0.102";
const LOCAL_SVC: &str = "10.96.0.103";
const EMPTY: &str = "10.96.0.104";
const TERMINATING: &str = "10.96.0.105";
const ITP: &str = "10.96.0.106";
const EXTERNAL_IP: &str = "172.18.0.10";
const LB_IP: &str = "172.18.0.100";

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("ip"), port)
}

fn answered_all(outcomes: &[Outcome]) -> bool {
    !outcomes.is_empty() && outcomes.iter().all(|o| o.server().is_some())
}

/// Polls until `count` attempts from `netns` to `target` all succeed (at most `limit`).
async fn until_answered(netns: &str, target: SocketAddr, udp: bool, limit: Duration) -> Vec<Outcome> {
    let start = std::time::Instant::now();
    loop {
        let outcomes = probe(netns, target, udp, 3, 500).expect("probe");
        if answered_all(&outcomes) || start.elapsed() > limit {
            return outcomes;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The kernel's rules without packet counters and timestamps (they change with traffic).
fn rules_only(text: &str) -> String {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match (l.starts_with(':'), l.rfind(" [")) {
            (true, Some(i)) => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn kernel_state(netns: &str, mode: &str) -> String {
    let args: Vec<&str> = if mode == "nftables" {
        vec!["nft", "list", "ruleset"]
    } else {
        vec!["sh", "-c", "iptables-legacy-save; iptables-nft-save"]
    };
    Cluster::exec(netns, &args).unwrap_or_default()
}

async fn scenario(mode: &str) {
    let mut env = TestEnv::start(3, 2).await.expect("control plane and 3 namespace nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let nodes = env.cluster.nodes.clone();
    let (n1, n2, n3) = (&nodes[0], &nodes[1], &nodes[2]);
    let mut servers = Vec::new();
    for node in &nodes {
        servers.push(start_server(&node.pods[0], &[8080], &[5353]).expect("echo server"));
    }
    // The fabric plays an external router: external and LB IPs are routed to node-1.
    for ip in [EXTERNAL_IP, LB_IP] {
        Cluster::exec(&env.cluster.fabric, &["ip", "route", "add", &format!("{ip}/32"), "via", &n1.ip.to_string()]).expect("route");
    }
    let eps_all = [Ep::ready(n1.pods[0].ip, &n1.name), Ep::ready(n2.pods[0].ip, &n2.name), Ep::ready(n3.pods[0].ip, &n3.name)];
    let http = [("http", 8080, "TCP")];
    apply_service(&admin, "web", json!({"clusterIP": WEB, "ports": [
        {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
        {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}]}), None).await.expect("web");
    apply_slice(&admin, "web", &[("http", 8080, "TCP"), ("dns", 5353, "UDP")], &eps_all).await.expect("web slice");
    apply_service(&admin, "sticky", json!({"clusterIP": STICKY, "sessionAffinity": "ClientIP",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}), None).await.expect("sticky");
    apply_slice(&admin, "sticky", &http, &eps_all).await.expect("sticky slice");
    apply_service(&admin, "np", json!({"type": "NodePort", "clusterIP": NODEPORT_SVC, "externalIPs": [EXTERNAL_IP],
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}]}), None).await.expect("np");
    apply_slice(&admin, "np", &http, &[Ep::ready(n2.pods[0].ip, &n2.name)]).await.expect("np slice");
    apply_service(&admin, "local", json!({"type": "LoadBalancer", "clusterIP": LOCAL_SVC, "externalTrafficPolicy": "Local",
        "healthCheckNodePort": 30999, "loadBalancerSourceRanges": ["10.250.0.0/24"],
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30081}]}),
        Some(json!({"loadBalancer": {"ingress": [{"ip": LB_IP}]}}))).await.expect("local");
    apply_slice(&admin, "local", &http, &[Ep::ready(n1.pods[0].ip, &n1.name), Ep::ready(n2.pods[0].ip, &n2.name)]).await.expect("local slice");
    apply_service(&admin, "empty", json!({"clusterIP": EMPTY, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}), None).await.expect("empty");
    apply_service(&admin, "term", json!({"clusterIP": TERMINATING, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}), None).await.expect("term");
    apply_slice(&admin, "term", &http, &[Ep::terminating(n3.pods[0].ip, &n3.name)]).await.expect("term slice");
    apply_service(&admin, "itp", json!({"clusterIP": ITP, "internalTrafficPolicy": "Local",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}), None).await.expect("itp");
    apply_slice(&admin, "itp", &http, &[Ep::ready(n2.pods[0].ip, &n2.name)]).await.expect("itp slice");

    // kube-proxy ran on node-1 before: its nftables table and iptables chains are still there.
    Cluster::exec(&n1.netns, &["nft", "add table ip kube-proxy; add chain ip kube-proxy services"]).expect("kube-proxy nft leftovers");
    Cluster::exec(&n1.netns, &["sh", "-c", "iptables-legacy -t nat -N KUBE-SERVICES && iptables-legacy -t nat -N KUBE-SVC-X && \
        iptables-legacy -t nat -A KUBE-SERVICES -j KUBE-SVC-X && iptables-legacy -t nat -A PREROUTING -j KUBE-SERVICES && \
        iptables-legacy -t filter -N KUBE-FIREWALL"]).expect("kube-proxy iptables leftovers");
    let agent_args = ["--mode", mode, "--cluster-cidr", "10.244.0.0/16", "--min-sync-period", "0.1", "--takeover-kube-proxy"];
    env.start_agents(&agent_args).await.expect("agents");
    for node in &nodes {
        let o = until_answered(&node.pods[1].netns, addr(WEB, 80), false, Duration::from_secs(60)).await;
        assert!(answered_all(&o), "{mode}: {} never reached web: {o:?}\nagent log:\n{}", node.name,
            env.agents.iter().find(|a| a.node == node.name).map(Agent::log_text).unwrap_or_default());
    }
    let client = &n1.pods[1].netns;
    // --takeover-kube-proxy removed kube-proxy's leftovers once ours served, and kept kubelet's chain.
    let mut taken = false;
    for _ in 0..50 {
        let nft = Cluster::exec(&n1.netns, &["nft", "list", "tables"]).unwrap_or_default();
        let ipt = Cluster::exec(&n1.netns, &["iptables-legacy-save"]).unwrap_or_default();
        if !nft.contains("kube-proxy") && !ipt.contains("KUBE-SERVICES") && !ipt.contains("KUBE-SVC-X") {
            assert!(ipt.contains(":KUBE-FIREWALL"), "{mode}: kubelet's chain must stay");
            taken = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(taken, "{mode}: kube-proxy leftovers not removed");

    // ClusterIP TCP: every attempt answered, spread over the 3 endpoints. With 90 uniform attempts
    // each endpoint expects 30 (sd 4.5); [15, 45] is a ±3.3 sd tolerance.
    let o = probe(client, addr(WEB, 80), false, 90, 1000).expect("probe");
    let t = tally(&o);
    assert!(answered_all(&o), "{mode}: {t:?}");
    assert_eq!(t.len(), 3, "{mode}: {t:?}");
    assert!(t.values().all(|n| (15..=45).contains(n)), "{mode}: spread out of tolerance: {t:?}");
    println!("{mode}: ClusterIP spread over 90 connections: {t:?}");

    // ClusterIP UDP.
    let o = probe(client, addr(WEB, 53), true, 30, 1000).expect("probe");
    assert!(answered_all(&o), "{mode}: udp {:?}", tally(&o));
    assert!(tally(&o).len() >= 2, "{mode}: udp not spread {:?}", tally(&o));

    // Session affinity: one client stays on one endpoint.
    let o = probe(client, addr(STICKY, 80), false, 20, 1000).expect("probe");
    assert!(answered_all(&o) && tally(&o).len() == 1, "{mode}: affinity {:?}", tally(&o));

    // NodePort from outside the cluster (the fabric), masqueraded to the remote endpoint.
    let fabric = env.cluster.fabric.clone();
    let o = probe(&fabric, addr(&n1.ip.to_string(), 30080), false, 10, 1000).expect("probe");
    assert!(answered_all(&o), "{mode}: nodeport {o:?}");
    assert!(o.iter().all(|x| matches!(x, Outcome::Answered { server, peer } if server == &n2.pods[0].name && peer.starts_with(&format!("{}:", n1.ip)))), "{mode}: nodeport {o:?}");
    // externalIP.
    let o = probe(&fabric, addr(EXTERNAL_IP, 80), false, 5, 1000).expect("probe");
    assert!(answered_all(&o), "{mode}: externalIP {o:?}");

    // externalTrafficPolicy=Local: node-1 answers with its local endpoint and sees the real client
    // address; node-3 has no local endpoint and drops.
    let o = probe(&fabric, addr(&n1.ip.to_string(), 30081), false, 10, 1000).expect("probe");
    assert!(o.iter().all(|x| matches!(x, Outcome::Answered { server, peer } if server == &n1.pods[0].name && peer.starts_with("10.250.0.1:"))), "{mode}: ETP=Local {o:?}");
    let o = probe(&fabric, addr(&n3.ip.to_string(), 30081), false, 3, 500).expect("probe");
    assert!(o.iter().all(|x| *x == Outcome::Timeout), "{mode}: ETP=Local without local endpoints must drop: {o:?}");

    // LoadBalancer IP: the fabric is inside loadBalancerSourceRanges; a pod is not.
    let o = probe(&fabric, addr(LB_IP, 80), false, 5, 1000).expect("probe");
    assert!(o.iter().all(|x| matches!(x, Outcome::Answered { peer, .. } if peer.starts_with("10.250.0.1:"))), "{mode}: LB {o:?}");
    let o = probe(&n2.pods[1].netns, addr(LB_IP, 80), false, 3, 500).expect("probe");
    assert!(o.iter().all(|x| *x == Outcome::Timeout), "{mode}: LB source range must drop a pod: {o:?}");

    // No endpoints: refused at once, not a timeout.
    let started = std::time::Instant::now();
    let o = probe(client, addr(EMPTY, 80), false, 3, 2000).expect("probe");
    assert!(o.iter().all(|x| *x == Outcome::Refused), "{mode}: no endpoints {o:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "{mode}: refusal took {:?}", started.elapsed());

    // Terminating-endpoint fallback.
    let o = probe(client, addr(TERMINATING, 80), false, 5, 1000).expect("probe");
    assert!(o.iter().all(|x| x.server() == Some(n3.pods[0].name.as_str())), "{mode}: fallback {o:?}");

    // internalTrafficPolicy=Local: only node-2 has the endpoint.
    let o = probe(&n2.pods[1].netns, addr(ITP, 80), false, 5, 1000).expect("probe");
    assert!(o.iter().all(|x| x.server() == Some(n2.pods[0].name.as_str())), "{mode}: ITP local {o:?}");
    let o = probe(client, addr(ITP, 80), false, 3, 500).expect("probe");
    assert!(o.iter().all(|x| *x == Outcome::Timeout), "{mode}: ITP=Local without local endpoint must drop: {o:?}");

    // Health: /healthz and /livez with kube-proxy's semantics, /metrics with kube-proxy's names.
    let (code, body) = http_get(&n1.netns, addr("127.0.0.1", 10256), "/healthz").expect("healthz");
    assert_eq!(code, 200, "{mode}: {body}");
    assert!(body.contains("\"healthy\":true") && body.contains("\"nodeEligible\":true") && body.contains("application/json"), "{mode}: {body}");
    let (code, _) = http_get(&n1.netns, addr("127.0.0.1", 10256), "/livez").expect("livez");
    assert_eq!(code, 200);
    let (code, metrics) = http_get(&n1.netns, addr("127.0.0.1", 10249), "/metrics").expect("metrics");
    assert_eq!(code, 200);
    for name in ["kubeproxy_sync_proxy_rules_duration_seconds_bucket", "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                 "kubeproxy_sync_proxy_rules_service_changes_pending", "kubeproxy_sync_proxy_rules_no_local_endpoints",
                 "kubeproxy_proxy_healthz_total", "switchyard_programmed_services"] {
        assert!(metrics.contains(name), "{mode}: /metrics lacks {name}");
    }
    // The health-check node port of the ETP=Local LoadBalancer: 200 where a local endpoint exists.
    let (code, body) = http_get(&fabric, addr(&n1.ip.to_string(), 30999), "/").expect("hc");
    assert_eq!(code, 200, "{mode}: {body}");
    assert!(body.contains("\"localEndpoints\":1") && body.to_lowercase().contains("x-load-balancing-endpoint-weight: 1"), "{mode}: {body}");
    let (code, _) = http_get(&fabric, addr(&n3.ip.to_string(), 30999), "/").expect("hc");
    assert_eq!(code, 503, "{mode}: no local endpoint on node-3");

    // --render prints the rules for the cluster state without touching the kernel.
    let bin = binaries::workspace_bin("switchyard-agent").expect("agent bin");
    let before = rules_only(&kernel_state(&n2.netns, mode));
    let rendered = Cluster::exec(&n2.netns, &[&bin.display().to_string(), "--render", "--node-name", "node-2", "--kubeconfig",
        &env.agents.iter().find(|a| a.node == n2.name).expect("agent").kubeconfig.display().to_string(), "--mode", mode,
        "--cluster-cidr", "10.244.0.0/16"]).expect("render");
    assert!(rendered.contains(WEB) && rendered.contains(if mode == "nftables" { "table ip switchyard" } else { "*nat" }), "{mode}: {rendered}");
    assert_eq!(rules_only(&kernel_state(&n2.netns, mode)), before, "{mode}: --render changed the kernel");

    // Hairpin: an endpoint reaching its own Service, and itself through it.
    let o = probe(&n1.pods[0].netns, addr(WEB, 80), false, 30, 1000).expect("probe");
    let t = tally(&o);
    assert!(answered_all(&o) && t.contains_key(&n1.pods[0].name), "{mode}: hairpin {t:?}");

    // Removing an endpoint stops traffic to it.
    apply_slice(&admin, "web", &[("http", 8080, "TCP"), ("dns", 5353, "UDP")], &eps_all[..2]).await.expect("shrink");
    let mut clean = false;
    for _ in 0..50 {
        let o = probe(client, addr(WEB, 80), false, 30, 1000).expect("probe");
        if answered_all(&o) && !tally(&o).contains_key(&n3.pods[0].name) {
            clean = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(clean, "{mode}: removed endpoint still receives traffic");

    // Deleting a Service removes its rules from the kernel.
    delete_service(&admin, "sticky").await.expect("delete sticky");
    let mut gone = false;
    for _ in 0..50 {
        let state = kernel_state(&n1.netns, mode);
        if !state.contains(STICKY) && !state.contains("default/sticky") {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(gone, "{mode}: deleted service still in the kernel:\n{}", kernel_state(&n1.netns, mode));

    // The agent stops: the data path keeps working; it restarts: still working, no flush.
    let idx = env.agents.iter().position(|a| a.node == n1.name).expect("agent");
    drop(env.agents.remove(idx));
    let o = probe(client, addr(WEB, 80), false, 20, 1000).expect("probe");
    assert!(answered_all(&o), "{mode}: traffic while the agent is down: {o:?}");
    let token = switchyard_e2e::agent::node_token(&env.cp, &n1.name).await.expect("token");
    env.agents.push(Agent::start(&env.cp, n1, &token, &agent_args).expect("restart agent"));
    let o = probe(client, addr(WEB, 80), false, 40, 1000).expect("probe");
    assert!(answered_all(&o), "{mode}: traffic across the agent restart: {o:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let o = probe(client, addr(WEB, 80), false, 20, 1000).expect("probe");
    assert!(answered_all(&o), "{mode}: traffic after the agent restart: {o:?}");

    // A NodeProxy deleted under a running agent is registered again with its status.
    let proxies: kube::Api<switchyard_crds::v1alpha1::NodeProxy> = kube::Api::all(admin.clone());
    proxies.delete(&n2.name, &Default::default()).await.expect("delete nodeproxy");
    let mut back = false;
    for _ in 0..100 {
        if proxies.get_opt(&n2.name).await.ok().flatten().is_some_and(|np| np.status.is_some_and(|s| s.active_mode.is_some())) {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(back, "{mode}: the agent did not register its deleted NodeProxy again");

    // --cleanup leaves nothing of ours in the node.
    let idx = env.agents.iter().position(|a| a.node == n3.name).expect("agent");
    drop(env.agents.remove(idx));
    Cluster::exec(&n3.netns, &[&bin.display().to_string(), "--cleanup"]).expect("cleanup");
    let state = kernel_state(&n3.netns, mode);
    assert!(!state.contains("switchyard") && !state.contains("SWY"), "{mode}: leftovers after --cleanup:\n{state}");
    drop(servers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_backend_serves_every_service_feature() {
    scenario("nftables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_backend_serves_every_service_feature() {
    scenario("iptables").await;
}
