//! The agent as the service proxy, per backend, with real traffic between namespace nodes:
//! ClusterIP (TCP and UDP) with load spread, session affinity, NodePort, externalIPs,
//! LoadBalancer IPs with source ranges, externalTrafficPolicy=Local (source IP preserved),
//! internalTrafficPolicy=Local, terminating-endpoint fallback, no endpoints → refused at once,
//! hairpin, endpoint removal, Service deletion (checked in the kernel), agent restart without
//! a data-path flush, and `--cleanup`.
//!
//! The same matrix runs twice per backend: on IPv4 Services (`*_serves_every_service_feature`), and
//! on dual-stack Services (`*_over_ipv6`: `RequireDualStack` with fixed ClusterIPs of both
//! families, an EndpointSlice per family, IPv6 externalIPs, LoadBalancer ingress IPs and source
//! ranges), where every feature is checked over both families, each through its own addresses,
//! plus an IPv6-only Service. The dual-stack run gives the agent `--cluster-cidr` of both families
//! and reads the kernel of both: `nft list ruleset` (tables `ip switchyard` and `ip6 switchyard`),
//! `iptables-*-save` and `ip6tables-*-save`.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use switchyard_e2e::{
    Family, Result,
    agent::{Agent, TestEnv},
    binaries, eventually, kernel,
    netns::{self, Cluster, Node, Pod},
    objects::{Ep, apply_service, apply_slice_family, delete_service},
    stats::{FALSE_FAILURE, SPREAD_3, check_uniform, samples_to_see},
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

// The IPv6 twins, from the cluster's IPv6 Service CIDR (fd00:10:96::/112) and, for the addresses
// outside the cluster, from fd00:10:251::/64, which the fabric routes to node-1.
const WEB6: &str = "fd00:10:96::100";
const STICKY6: &str = "fd00:10:96::101";
const NODEPORT_SVC6: &str = "fd00:10:96::102";
const LOCAL_SVC6: &str = "fd00:10:96::103";
const EMPTY6: &str = "fd00:10:96::104";
const TERMINATING6: &str = "fd00:10:96::105";
const ITP6: &str = "fd00:10:96::106";
/// ClusterIP of the IPv6-only (SingleStack IPv6) Service of the dual-stack run.
const V6_ONLY: &str = "fd00:10:96::107";
const EXTERNAL_IP6: &str = "fd00:10:251::10";
const LB_IP6: &str = "fd00:10:251::100";

/// The Services' IP families in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stack {
    /// IPv4 Services, as the API defaults them in this (IPv4-primary) cluster.
    V4,
    /// `RequireDualStack` Services, IPv4 first.
    Dual,
}

impl Stack {
    fn families(self) -> &'static [Family] {
        match self {
            Stack::V4 => &[Family::V4],
            Stack::Dual => &Family::BOTH,
        }
    }

    /// The agent's `--cluster-cidr`: one CIDR per family, comma-separated.
    fn cluster_cidr(self) -> &'static str {
        match self {
            Stack::V4 => "10.244.0.0/16",
            Stack::Dual => "10.244.0.0/16,fd00:10:244::/56",
        }
    }
}

/// The addresses of one family.
struct Addrs {
    web: &'static str,
    sticky: &'static str,
    empty: &'static str,
    terminating: &'static str,
    itp: &'static str,
    external_ip: &'static str,
    lb_ip: &'static str,
}

fn addrs(family: Family) -> Addrs {
    match family {
        Family::V4 => Addrs {
            web: WEB,
            sticky: STICKY,
            empty: EMPTY,
            terminating: TERMINATING,
            itp: ITP,
            external_ip: EXTERNAL_IP,
            lb_ip: LB_IP,
        },
        Family::V6 => Addrs {
            web: WEB6,
            sticky: STICKY6,
            empty: EMPTY6,
            terminating: TERMINATING6,
            itp: ITP6,
            external_ip: EXTERNAL_IP6,
            lb_ip: LB_IP6,
        },
    }
}

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("ip"), port)
}

/// A Service spec with the run's ClusterIPs added to `spec`: `clusterIP` alone (IPv4), or
/// `RequireDualStack` with `clusterIPs` of both families.
fn with_cluster_ips(stack: Stack, v4: &str, v6: &str, mut spec: Value) -> Value {
    let fields = spec.as_object_mut().expect("a spec is an object");
    fields.insert("clusterIP".into(), json!(v4));
    if stack == Stack::Dual {
        fields.insert("clusterIPs".into(), json!([v4, v6]));
        fields.insert("ipFamilyPolicy".into(), json!("RequireDualStack"));
        fields.insert("ipFamilies".into(), json!(["IPv4", "IPv6"]));
    }
    spec
}

/// `[v4]`, or `[v4, v6]` in the dual-stack run (externalIPs, source ranges).
fn per_stack(stack: Stack, v4: &str, v6: &str) -> Value {
    match stack {
        Stack::V4 => json!([v4]),
        Stack::Dual => json!([v4, v6]),
    }
}

/// Applies `service`'s EndpointSlice of every family of the run, with `pods` (and the nodes they
/// run on) as endpoints, ready or terminating.
async fn slices(
    admin: &kube::Client,
    stack: Stack,
    service: &str,
    ports: &[(&str, u16, &str)],
    pods: &[(&Pod, &Node)],
    terminating: bool,
) {
    for &family in stack.families() {
        let eps: Vec<Ep> = pods
            .iter()
            .map(|(p, n)| {
                if terminating {
                    Ep::terminating(p.ip_of(family), &n.name)
                } else {
                    Ep::ready(p.ip_of(family), &n.name)
                }
            })
            .collect();
        apply_slice_family(admin, service, family, ports, &eps)
            .await
            .unwrap_or_else(|e| panic!("{service} {family:?} slice: {e}"));
    }
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

/// Everything of the backend in the node's kernel: the whole nftables ruleset (every family's
/// tables), or both iptables variants' saves, and in the dual-stack run the ip6tables ones too. A
/// listing that fails is an error (an absence check must not pass on it).
fn kernel_state(netns: &str, mode: &str, stack: Stack) -> Result<String> {
    kernel::backend_state(netns, mode, stack.families())
}

/// The backend's rules of one family: table `ip switchyard` or `ip6 switchyard`, or the
/// `iptables-save` or `ip6tables-save` output of both variants.
fn family_state(netns: &str, mode: &str, family: Family) -> Result<String> {
    match (mode, family) {
        ("nftables", Family::V4) => Cluster::exec(netns, &["nft", "list", "table", "ip", "switchyard"]),
        ("nftables", Family::V6) => Cluster::exec(netns, &["nft", "list", "table", "ip6", "switchyard"]),
        _ => kernel::iptables_saves(netns, &[family]),
    }
}

/// Whether the node's agent has synced since `since` (its
/// `kubeproxy_sync_proxy_rules_last_timestamp_seconds`, in Unix seconds).
fn synced_since(netns: &str, since: f64) -> bool {
    let Ok((200, metrics)) = http_get(netns, addr("127.0.0.1", 10249), "/metrics") else {
        return false;
    };
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("kubeproxy_sync_proxy_rules_last_timestamp_seconds "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .is_some_and(|t| t >= since)
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
}

/// The answering servers' names of `pods` (the endpoints a spread is checked over).
fn names<'a>(pods: &[&'a Pod]) -> Vec<&'a str> {
    pods.iter().map(|p| p.name.as_str()).collect()
}

async fn scenario(mode: &str, stack: Stack) {
    let run = match stack {
        Stack::V4 => mode.to_owned(),
        Stack::Dual => format!("{mode} dual-stack"),
    };
    let families = stack.families();
    let mut env = TestEnv::start(3, 2)
        .await
        .expect("control plane and 3 namespace nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let nodes = env.cluster.nodes.clone();
    let (n1, n2, n3) = (&nodes[0], &nodes[1], &nodes[2]);
    let mut servers = Vec::new();
    for node in &nodes {
        servers.push(start_server(&node.pods[0], &[8080], &[5353]).expect("echo server"));
    }
    // The topology itself carries every family of the run, pod to pod, before any agent runs.
    for &f in families {
        let o = probe(
            &n1.pods[1].netns,
            SocketAddr::new(n2.pods[0].ip_of(f), 8080),
            false,
            2,
            1000,
        )
        .expect("probe");
        assert!(
            o.iter().all(|x| x.peer_ip() == Some(n1.pods[1].ip_of(f))),
            "{run} {f:?}: pod to pod without Services: {o:?}"
        );
    }
    // The fabric plays an external router: external and LB IPs are routed to node-1.
    for &f in families {
        let a = addrs(f);
        for ip in [a.external_ip, a.lb_ip] {
            let (flag, len) = if f == Family::V4 { ("-4", 32) } else { ("-6", 128) };
            Cluster::exec(
                &env.cluster.fabric,
                &[
                    "ip",
                    flag,
                    "route",
                    "add",
                    &format!("{ip}/{len}"),
                    "via",
                    &n1.ip_of(f).to_string(),
                ],
            )
            .expect("route");
        }
    }
    let all = [(&n1.pods[0], n1), (&n2.pods[0], n2), (&n3.pods[0], n3)];
    let web_ports = [("http", 8080, "TCP"), ("dns", 5353, "UDP")];
    let http = [("http", 8080, "TCP")];
    apply_service(
        &admin,
        "web",
        with_cluster_ips(
            stack,
            WEB,
            WEB6,
            json!({"ports": [
        {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
        {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}]}),
        ),
        None,
    )
    .await
    .expect("web");
    slices(&admin, stack, "web", &web_ports, &all, false).await;
    apply_service(
        &admin,
        "sticky",
        with_cluster_ips(
            stack,
            STICKY,
            STICKY6,
            json!({"sessionAffinity": "ClientIP",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        None,
    )
    .await
    .expect("sticky");
    slices(&admin, stack, "sticky", &http, &all, false).await;
    apply_service(
        &admin,
        "np",
        with_cluster_ips(
            stack,
            NODEPORT_SVC,
            NODEPORT_SVC6,
            json!({"type": "NodePort",
        "externalIPs": per_stack(stack, EXTERNAL_IP, EXTERNAL_IP6),
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}]}),
        ),
        None,
    )
    .await
    .expect("np");
    slices(&admin, stack, "np", &http, &[(&n2.pods[0], n2)], false).await;
    let ingress: Vec<Value> = families.iter().map(|&f| json!({"ip": addrs(f).lb_ip})).collect();
    apply_service(
        &admin,
        "local",
        with_cluster_ips(
            stack,
            LOCAL_SVC,
            LOCAL_SVC6,
            json!({"type": "LoadBalancer",
        "externalTrafficPolicy": "Local", "healthCheckNodePort": 30999,
        "loadBalancerSourceRanges": per_stack(stack, netns::FABRIC_CIDR, netns::FABRIC_CIDR6),
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30081}]}),
        ),
        Some(json!({"loadBalancer": {"ingress": ingress}})),
    )
    .await
    .expect("local");
    slices(
        &admin,
        stack,
        "local",
        &http,
        &[(&n1.pods[0], n1), (&n2.pods[0], n2)],
        false,
    )
    .await;
    apply_service(
        &admin,
        "empty",
        with_cluster_ips(
            stack,
            EMPTY,
            EMPTY6,
            json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        None,
    )
    .await
    .expect("empty");
    apply_service(
        &admin,
        "term",
        with_cluster_ips(
            stack,
            TERMINATING,
            TERMINATING6,
            json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        None,
    )
    .await
    .expect("term");
    slices(&admin, stack, "term", &http, &[(&n3.pods[0], n3)], true).await;
    apply_service(
        &admin,
        "itp",
        with_cluster_ips(
            stack,
            ITP,
            ITP6,
            json!({"internalTrafficPolicy": "Local",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        None,
    )
    .await
    .expect("itp");
    slices(&admin, stack, "itp", &http, &[(&n2.pods[0], n2)], false).await;
    if stack == Stack::Dual {
        // An IPv6-only Service in the dual-stack cluster: one IPv6 slice, no IPv4 ClusterIP.
        let svc = apply_service(
            &admin,
            "web6only",
            json!({"ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv6"],
            "clusterIP": V6_ONLY, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
            None,
        )
        .await
        .expect("web6only");
        assert_eq!(
            svc.spec.and_then(|s| s.cluster_ips),
            Some(vec![V6_ONLY.to_owned()])
        );
        let eps: Vec<Ep> = all.iter().map(|(p, n)| Ep::ready(p.ip6, &n.name)).collect();
        apply_slice_family(&admin, "web6only", Family::V6, &http, &eps)
            .await
            .expect("web6only slice");
        // The apiserver took the dual-stack Services as meant.
        let web = kube::Api::<k8s_openapi::api::core::v1::Service>::namespaced(admin.clone(), "default")
            .get("web")
            .await
            .expect("web");
        let spec = web.spec.expect("spec");
        assert_eq!(spec.cluster_ips, Some(vec![WEB.to_owned(), WEB6.to_owned()]));
        assert_eq!(spec.ip_families, Some(vec!["IPv4".to_owned(), "IPv6".to_owned()]));
    }

    // kube-proxy ran on node-1 before: its nftables table and iptables chains are still there
    // (of both families in a dual-stack cluster).
    Cluster::exec(
        &n1.netns,
        &["nft", "add table ip kube-proxy; add chain ip kube-proxy services"],
    )
    .expect("kube-proxy nft leftovers");
    Cluster::exec(&n1.netns, &["sh", "-c", "iptables-legacy -t nat -N KUBE-SERVICES && iptables-legacy -t nat -N KUBE-SVC-X && \
        iptables-legacy -t nat -A KUBE-SERVICES -j KUBE-SVC-X && iptables-legacy -t nat -A PREROUTING -j KUBE-SERVICES && \
        iptables-legacy -t filter -N KUBE-FIREWALL"]).expect("kube-proxy iptables leftovers");
    if stack == Stack::Dual {
        Cluster::exec(
            &n1.netns,
            &[
                "nft",
                "add table ip6 kube-proxy; add chain ip6 kube-proxy services",
            ],
        )
        .expect("kube-proxy nft ip6 leftovers");
        Cluster::exec(&n1.netns, &["sh", "-c", "ip6tables-legacy -t nat -N KUBE-SERVICES && ip6tables-legacy -t nat -N KUBE-SVC-X && \
            ip6tables-legacy -t nat -A KUBE-SERVICES -j KUBE-SVC-X && ip6tables-legacy -t nat -A PREROUTING -j KUBE-SERVICES && \
            ip6tables-legacy -t filter -N KUBE-KUBELET-CANARY"]).expect("kube-proxy ip6tables leftovers");
    }
    let agent_args = [
        "--mode",
        mode,
        "--cluster-cidr",
        stack.cluster_cidr(),
        "--min-sync-period",
        "0.1",
        "--takeover-kube-proxy",
    ];
    env.start_agents(&agent_args).await.expect("agents");
    for node in &nodes {
        for &f in families {
            let target = addr(addrs(f).web, 80);
            let start = Instant::now();
            loop {
                let o = until_answered(&node.pods[1].netns, target, false, Duration::from_secs(2)).await;
                if answered_all(&o) {
                    break;
                }
                let agent = env
                    .agents
                    .iter_mut()
                    .find(|a| a.node == node.name)
                    .expect("agent");
                let exited = agent.exit_status();
                assert!(
                    exited.is_none() && start.elapsed() < Duration::from_secs(60),
                    "{run}: {} never reached web over {f:?} ({target}): {o:?}; agent exited: {exited:?}\nagent log:\n{}",
                    node.name,
                    agent.log_text()
                );
            }
        }
    }
    let client = &n1.pods[1].netns;
    // --takeover-kube-proxy removed kube-proxy's leftovers once ours served, and kept kubelet's chain.
    let mut taken = false;
    for _ in 0..50 {
        let nft = kernel::nft_tables(&n1.netns).expect("nft list tables");
        let ipt = Cluster::exec(&n1.netns, &["iptables-legacy-save"]).expect("iptables-legacy-save");
        let ip6t = if stack == Stack::Dual {
            Cluster::exec(&n1.netns, &["ip6tables-legacy-save"]).expect("ip6tables-legacy-save")
        } else {
            String::new()
        };
        if !nft.contains("kube-proxy")
            && [&ipt, &ip6t]
                .iter()
                .all(|t| !t.contains("KUBE-SERVICES") && !t.contains("KUBE-SVC-X"))
        {
            assert!(ipt.contains(":KUBE-FIREWALL"), "{run}: kubelet's chain must stay");
            if stack == Stack::Dual {
                assert!(
                    ip6t.contains(":KUBE-KUBELET-CANARY"),
                    "{run}: kubelet's IPv6 chain must stay"
                );
            }
            taken = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(taken, "{run}: kube-proxy leftovers not removed");

    if stack == Stack::Dual {
        // Each family's rules are in that family's table, or ip6tables.
        let (v4, v6) = (
            family_state(&n1.netns, mode, Family::V4).expect("IPv4 rules"),
            family_state(&n1.netns, mode, Family::V6).expect("IPv6 rules"),
        );
        assert!(
            v6.contains(WEB6) && v6.contains(STICKY6) && v6.contains(V6_ONLY),
            "{run}: IPv6 rules missing:\n{v6}"
        );
        assert!(
            v4.contains(WEB) && !v4.contains("fd00:10:96::") && !v4.contains("web6only"),
            "{run}: IPv4 rules:\n{v4}"
        );
        assert!(
            !v6.contains("10.96.0."),
            "{run}: IPv4 addresses in the IPv6 rules:\n{v6}"
        );
        if mode == "nftables" {
            assert!(v6.contains("table ip6 switchyard"), "{run}: {v6}");
        } else {
            assert!(v6.contains("SWY-"), "{run}: no SWY-* chains in ip6tables:\n{v6}");
        }
    }

    let endpoints = names(&[&n1.pods[0], &n2.pods[0], &n3.pods[0]]);
    for &f in families {
        let (a, run) = (addrs(f), format!("{run} {f:?}"));
        // ClusterIP TCP: every attempt answered, spread uniformly over the 3 endpoints. Each of
        // SPREAD_3 = 600 new connections picks an endpoint at random (numgen random / statistic
        // random); stats::check_uniform accepts [143, 260] per endpoint, which a uniform choice
        // leaves with probability <= 1e-6 (exact binomial tails, union bound), and still fails a
        // 2:1:1 skew with probability >= 0.999, a 2:2:1 skew with >= 0.98, an endpoint never
        // chosen always (stats unit tests). The old check, [15, 45] over 90, failed a correct
        // data path with probability 1.5e-3.
        let o = probe(client, addr(a.web, 80), false, SPREAD_3 as u32, 1000).expect("probe");
        let t = tally(&o);
        assert!(answered_all(&o), "{run}: {t:?}");
        if let Err(e) = check_uniform(&t, &endpoints) {
            panic!("{run}: ClusterIP TCP spread: {e}");
        }
        println!("{run}: ClusterIP spread over {SPREAD_3} connections: {t:?}");

        // ClusterIP UDP: a new socket (source port) per attempt, each a new conntrack entry and a
        // new random choice; the same check as TCP (false failure <= 1e-6, catches 2:1:1).
        let o = probe(client, addr(a.web, 53), true, SPREAD_3 as u32, 1000).expect("probe");
        let t = tally(&o);
        assert!(answered_all(&o), "{run}: udp {t:?}");
        if let Err(e) = check_uniform(&t, &endpoints) {
            panic!("{run}: ClusterIP UDP spread: {e}");
        }
        println!("{run}: ClusterIP UDP spread over {SPREAD_3} datagrams: {t:?}");

        // Session affinity: one client stays on one endpoint. Deterministic when affinity works
        // (no false failure); without it, 20 uniform choices land on one endpoint with
        // probability 3 * 3^-20 < 1e-9.
        let o = probe(client, addr(a.sticky, 80), false, 20, 1000).expect("probe");
        assert!(
            answered_all(&o) && tally(&o).len() == 1,
            "{run}: affinity {:?}",
            tally(&o)
        );

        // NodePort from outside the cluster (the fabric), masqueraded to the remote endpoint.
        let fabric = env.cluster.fabric.clone();
        let o = probe(&fabric, SocketAddr::new(n1.ip_of(f), 30080), false, 10, 1000).expect("probe");
        assert!(answered_all(&o), "{run}: nodeport {o:?}");
        assert!(
            o.iter()
                .all(|x| x.server() == Some(n2.pods[0].name.as_str()) && x.peer_ip() == Some(n1.ip_of(f))),
            "{run}: nodeport {o:?}"
        );
        // externalIP.
        let o = probe(&fabric, addr(a.external_ip, 80), false, 5, 1000).expect("probe");
        assert!(answered_all(&o), "{run}: externalIP {o:?}");

        // externalTrafficPolicy=Local: node-1 answers with its local endpoint and sees the real
        // client address; node-3 has no local endpoint and drops.
        let o = probe(&fabric, SocketAddr::new(n1.ip_of(f), 30081), false, 10, 1000).expect("probe");
        assert!(
            o.iter()
                .all(|x| x.server() == Some(n1.pods[0].name.as_str())
                    && x.peer_ip() == Some(netns::fabric_ip(f))),
            "{run}: ETP=Local {o:?}"
        );
        let o = probe(&fabric, SocketAddr::new(n3.ip_of(f), 30081), false, 3, 500).expect("probe");
        assert!(
            o.iter().all(|x| *x == Outcome::Timeout),
            "{run}: ETP=Local without local endpoints must drop: {o:?}"
        );

        // LoadBalancer IP: the fabric is inside loadBalancerSourceRanges; a pod is not.
        let o = probe(&fabric, addr(a.lb_ip, 80), false, 5, 1000).expect("probe");
        assert!(
            !o.is_empty() && o.iter().all(|x| x.peer_ip() == Some(netns::fabric_ip(f))),
            "{run}: LB {o:?}"
        );
        let o = probe(&n2.pods[1].netns, addr(a.lb_ip, 80), false, 3, 500).expect("probe");
        assert!(
            o.iter().all(|x| *x == Outcome::Timeout),
            "{run}: LB source range must drop a pod: {o:?}"
        );

        // No endpoints: refused at once, not a timeout, in both families. (Over IPv6 an ICMPv6
        // port unreachable answering a pod's first SYN can arrive while connect() still holds the
        // socket and is dropped (TcpExtLockDroppedIcmps), refusing only after the SYN is resent a
        // second later; the agent answers TCP with a reset over IPv6, which is never dropped.)
        // "At once" is each attempt's own 900 ms limit, below the 1 s SYN resend: a refusal that
        // needed a resend is a Timeout outcome. No wall-clock bound on the whole probe (process
        // start included), which a loaded CI machine could exceed.
        let started = std::time::Instant::now();
        let o = probe(client, addr(a.empty, 80), false, 3, 900).expect("probe");
        assert!(
            o.iter().all(|x| *x == Outcome::Refused),
            "{run}: no endpoints (each attempt limited to 900 ms) {o:?}"
        );
        println!("{run}: 3 refusals in {:?}", started.elapsed());

        // Terminating-endpoint fallback.
        let o = probe(client, addr(a.terminating, 80), false, 5, 1000).expect("probe");
        assert!(
            o.iter().all(|x| x.server() == Some(n3.pods[0].name.as_str())),
            "{run}: fallback {o:?}"
        );

        // internalTrafficPolicy=Local: only node-2 has the endpoint.
        let o = probe(&n2.pods[1].netns, addr(a.itp, 80), false, 5, 1000).expect("probe");
        assert!(
            o.iter().all(|x| x.server() == Some(n2.pods[0].name.as_str())),
            "{run}: ITP local {o:?}"
        );
        let o = probe(client, addr(a.itp, 80), false, 3, 500).expect("probe");
        assert!(
            o.iter().all(|x| *x == Outcome::Timeout),
            "{run}: ITP=Local without local endpoint must drop: {o:?}"
        );

        // The health-check node port of the ETP=Local LoadBalancer, on the node's address of this
        // family: 200 where a local endpoint exists.
        let (code, body) = http_get(&fabric, SocketAddr::new(n1.ip_of(f), 30999), "/").expect("hc");
        assert_eq!(code, 200, "{run}: {body}");
        assert!(
            body.contains("\"localEndpoints\":1")
                && body
                    .to_lowercase()
                    .contains("x-load-balancing-endpoint-weight: 1"),
            "{run}: {body}"
        );
        let (code, _) = http_get(&fabric, SocketAddr::new(n3.ip_of(f), 30999), "/").expect("hc");
        assert_eq!(code, 503, "{run}: no local endpoint on node-3");

        // Hairpin: an endpoint reaching its own Service, and itself through it. Itself is one of 3
        // uniform choices: missed in all of samples_to_see(1/3, 1e-6) = 35 attempts with
        // probability (2/3)^35 <= 1e-6 (30 attempts, as before, missed it with 5.2e-6).
        let hairpin = samples_to_see(1.0 / 3.0, FALSE_FAILURE);
        let o = probe(&n1.pods[0].netns, addr(a.web, 80), false, hairpin, 1000).expect("probe");
        let t = tally(&o);
        assert!(
            answered_all(&o) && t.contains_key(&n1.pods[0].name),
            "{run}: hairpin {t:?}"
        );
    }

    if stack == Stack::Dual {
        // The IPv6-only Service: spread over its 3 IPv6 endpoints, checked as the ClusterIP
        // spread (false failure <= 1e-6; catches 2:1:1 with >= 0.999, a missing endpoint always).
        let o = probe(client, addr(V6_ONLY, 80), false, SPREAD_3 as u32, 1000).expect("probe");
        let t = tally(&o);
        assert!(answered_all(&o), "{run}: IPv6-only Service {t:?}");
        if let Err(e) = check_uniform(&t, &endpoints) {
            panic!("{run}: IPv6-only Service spread: {e}");
        }
        // A client inside the IPv6 cluster CIDR is not masqueraded.
        assert!(
            o.iter().all(|x| x.peer_ip() == Some(n1.pods[1].ip6.into())),
            "{run}: IPv6-only Service source: {o:?}"
        );
    }

    // Health: /healthz and /livez with kube-proxy's semantics, /metrics with kube-proxy's names.
    let (code, body) = http_get(&n1.netns, addr("127.0.0.1", 10256), "/healthz").expect("healthz");
    assert_eq!(code, 200, "{run}: {body}");
    assert!(
        body.contains("\"healthy\":true")
            && body.contains("\"nodeEligible\":true")
            && body.contains("application/json"),
        "{run}: {body}"
    );
    let (code, _) = http_get(&n1.netns, addr("127.0.0.1", 10256), "/livez").expect("livez");
    assert_eq!(code, 200);
    let (code, metrics) = http_get(&n1.netns, addr("127.0.0.1", 10249), "/metrics").expect("metrics");
    assert_eq!(code, 200);
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        "kubeproxy_sync_proxy_rules_no_local_endpoints",
        "kubeproxy_proxy_healthz_total",
        "switchyard_programmed_services",
    ] {
        assert!(metrics.contains(name), "{run}: /metrics lacks {name}");
    }

    // --render prints the rules for the cluster state without touching the kernel.
    let bin = binaries::workspace_bin("switchyard-agent").expect("agent bin");
    let before = rules_only(&kernel_state(&n2.netns, mode, stack).expect("kernel state before --render"));
    assert!(
        before.contains(WEB),
        "{run}: the listing before --render shows our rules:\n{before}"
    );
    let rendered = Cluster::exec(
        &n2.netns,
        &[
            &bin.display().to_string(),
            "--render",
            "--node-name",
            "node-2",
            "--kubeconfig",
            &env.agents
                .iter()
                .find(|a| a.node == n2.name)
                .expect("agent")
                .kubeconfig
                .display()
                .to_string(),
            "--mode",
            mode,
            "--cluster-cidr",
            stack.cluster_cidr(),
        ],
    )
    .expect("render");
    assert!(
        rendered.contains(WEB)
            && rendered.contains(if mode == "nftables" {
                "table ip switchyard"
            } else {
                "*nat"
            }),
        "{run}: {rendered}"
    );
    if stack == Stack::Dual {
        assert!(
            rendered.contains(WEB6) && rendered.contains(V6_ONLY),
            "{run}: --render lacks the IPv6 rules: {rendered}"
        );
        assert!(
            mode != "nftables" || rendered.contains("table ip6 switchyard"),
            "{run}: {rendered}"
        );
    }
    assert_eq!(
        rules_only(&kernel_state(&n2.netns, mode, stack).expect("kernel state after --render")),
        before,
        "{run}: --render changed the kernel"
    );

    // Removing an endpoint stops traffic to it: wait until a round of attempts misses it, then
    // confirm over samples_to_see(1/3, 1e-6) = 35 more, which a still-programmed endpoint (one of
    // 3 uniform choices) would miss with probability <= 1e-6.
    slices(&admin, stack, "web", &web_ports, &all[..2], false).await;
    let confirm = samples_to_see(1.0 / 3.0, FALSE_FAILURE);
    for &f in families {
        let mut clean = false;
        for _ in 0..150 {
            let o = probe(client, addr(addrs(f).web, 80), false, 30, 1000).expect("probe");
            if answered_all(&o) && !tally(&o).contains_key(&n3.pods[0].name) {
                clean = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(clean, "{run} {f:?}: removed endpoint still receives traffic");
        let o = probe(client, addr(addrs(f).web, 80), false, confirm, 1000).expect("probe");
        assert!(
            answered_all(&o) && !tally(&o).contains_key(&n3.pods[0].name),
            "{run} {f:?}: removed endpoint answered again: {:?}",
            tally(&o)
        );
    }

    // Deleting a Service removes its rules from the kernel.
    // Only a listing that succeeded and lacks it counts as gone; a failed listing fails the test.
    let state = kernel_state(&n1.netns, mode, stack).expect("kernel state");
    assert!(
        families.iter().all(|&f| state.contains(addrs(f).sticky)),
        "{run}: the sticky Service is in the kernel before its deletion:\n{state}"
    );
    delete_service(&admin, "sticky").await.expect("delete sticky");
    let gone = eventually(Duration::from_secs(30), "deleted service gone", || async {
        let state = kernel_state(&n1.netns, mode, stack).expect("kernel state");
        (families.iter().all(|&f| !state.contains(addrs(f).sticky)) && !state.contains("default/sticky"))
            .then_some(())
    })
    .await;
    if let Err(e) = gone {
        panic!(
            "{run}: {e}: deleted service still in the kernel:\n{}",
            kernel_state(&n1.netns, mode, stack).expect("kernel state")
        );
    }

    // The agent stops: the data path keeps working; it restarts: still working, no flush.
    let idx = env.agents.iter().position(|a| a.node == n1.name).expect("agent");
    drop(env.agents.remove(idx));
    for &f in families {
        let o = probe(client, addr(addrs(f).web, 80), false, 20, 1000).expect("probe");
        assert!(
            answered_all(&o),
            "{run} {f:?}: traffic while the agent is down: {o:?}"
        );
    }
    let token = switchyard_e2e::agent::node_token(&env.cp, &n1.name)
        .await
        .expect("token");
    let restarted_at = unix_now();
    env.agents
        .push(Agent::start(&env.cp, n1, &token, &agent_args).expect("restart agent"));
    for &f in families {
        let o = probe(client, addr(addrs(f).web, 80), false, 40, 1000).expect("probe");
        assert!(
            answered_all(&o),
            "{run} {f:?}: traffic across the agent restart: {o:?}"
        );
    }
    // Once the restarted agent has synced (its metric says so), traffic still flows.
    eventually(Duration::from_secs(60), "the restarted agent synced", || async {
        synced_since(&n1.netns, restarted_at).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{run}: {e}"));
    for &f in families {
        let o = probe(client, addr(addrs(f).web, 80), false, 20, 1000).expect("probe");
        assert!(
            answered_all(&o),
            "{run} {f:?}: traffic after the agent restart: {o:?}"
        );
    }

    // A NodeProxy deleted under a running agent is registered again with its status.
    let proxies: kube::Api<switchyard_crds::v1alpha1::NodeProxy> = kube::Api::all(admin.clone());
    proxies
        .delete(&n2.name, &Default::default())
        .await
        .expect("delete nodeproxy");
    let mut back = false;
    for _ in 0..100 {
        if proxies
            .get_opt(&n2.name)
            .await
            .ok()
            .flatten()
            .is_some_and(|np| np.status.is_some_and(|s| s.active_mode.is_some()))
        {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        back,
        "{run}: the agent did not register its deleted NodeProxy again"
    );

    // --cleanup leaves nothing of ours in the node.
    let idx = env.agents.iter().position(|a| a.node == n3.name).expect("agent");
    drop(env.agents.remove(idx));
    let state = kernel_state(&n3.netns, mode, stack).expect("kernel state before --cleanup");
    assert!(
        state.contains("switchyard") || state.contains("SWY"),
        "{run}: our rules are there before --cleanup:\n{state}"
    );
    Cluster::exec(&n3.netns, &[&bin.display().to_string(), "--cleanup"]).expect("cleanup");
    // A listing that failed is an error here, not an empty (clean) state.
    let state = kernel_state(&n3.netns, mode, stack).expect("kernel state after --cleanup");
    assert!(
        !state.contains("switchyard") && !state.contains("SWY"),
        "{run}: leftovers after --cleanup:\n{state}"
    );
    drop(servers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_backend_serves_every_service_feature() {
    scenario("nftables", Stack::V4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_backend_serves_every_service_feature() {
    scenario("iptables", Stack::V4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_backend_serves_every_service_feature_over_ipv6() {
    scenario("nftables", Stack::Dual).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_backend_serves_every_service_feature_over_ipv6() {
    scenario("iptables", Stack::Dual).await;
}
