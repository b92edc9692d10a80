//! A ProxyPolicy's `proxy` settings that the agent applies outside the backends' renders, each
//! set in a real ProxyPolicy (through a real operator to the node's NodeProxy) and seen in the
//! node: `serviceProxyName` (a Service labelled with the name appears in the kernel, one without
//! the label disappears, and back when the policy drops it), `conntrack.*` (the per-namespace
//! timeouts and `tcp_be_liberal` reach the node namespace's `/proc/sys/net/netfilter`, the
//! host-global `nf_conntrack_max` is refused there and reported in the `ConntrackSysctls`
//! condition, and every value is put back when the policy drops them), and `syncPeriodSeconds`
//! (on an idle node, a check of our rules in the kernel every period, counted by
//! `switchyard_idle_checks_total`; our table deleted behind the agent's back is found by the next
//! check and restored by a full resync, which `kubeproxy_sync_full_proxy_rules_duration_seconds_count`
//! counts). The agent is never restarted; at the end, `--cleanup` puts back the values of a
//! stopped agent.

use std::{net::SocketAddr, time::Duration};

use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::NodeProxy;
use switchyard_e2e::{
    agent::{Agent, TestEnv},
    binaries, eventually, kernel,
    netns::Cluster,
    operator::Operator,
    traffic::http_get,
};

const PLAIN: &str = "10.96.0.120";
const NAMED: &str = "10.96.0.121";
const PROXY_NAME: &str = "swy-e2e";
const LIMIT: Duration = Duration::from_secs(45);
const NETFILTER: &str = "/proc/sys/net/netfilter";
/// The per-namespace knobs the policy sets, and the values it sets them to.
const KNOBS: [&str; 3] = [
    "nf_conntrack_udp_timeout",
    "nf_conntrack_tcp_be_liberal",
    "nf_conntrack_tcp_timeout_established",
];
const POLICY_VALUES: [&str; 3] = ["47", "1", "7207"];
const REFUSED: &str = "conntrack sysctl not written";

/// A ClusterIP Service in `default`, labelled with `proxy` as its service-proxy-name.
async fn apply_service(client: &kube::Client, name: &str, ip: &str, proxy: Option<&str>) {
    let labels = proxy.map(|p| json!({"service.kubernetes.io/service-proxy-name": p}));
    let body = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}});
    Api::<k8s_openapi::api::core::v1::Service>::namespaced(client.clone(), "default")
        .patch(
            name,
            &PatchParams::apply("switchyard-e2e").force(),
            &Patch::Apply(&body),
        )
        .await
        .expect("apply service");
}

/// Applies the policy, with `proxy` settings or none.
fn apply_policy(env: &TestEnv, proxy: Option<Value>) {
    let mut spec = json!({"nodeSelector": {"matchLabels": {"pool": "ps"}}, "mode": "nftables"});
    if let Some(proxy) = proxy {
        spec["proxy"] = proxy;
    }
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
        "metadata": {"name": "settings"}, "spec": spec});
    env.cp.apply_json(&body).expect("apply policy");
}

/// Which of the two ClusterIPs the node's nftables ruleset holds (a failed listing fails).
fn programmed(netns: &str) -> (bool, bool) {
    let rules = kernel::nft_ruleset(netns).expect("nft list ruleset");
    (rules.contains(PLAIN), rules.contains(NAMED))
}

/// The policy's knobs in the node's namespace.
fn knobs(netns: &str) -> Vec<String> {
    KNOBS.iter().map(|k| sysctl(netns, k)).collect()
}

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

/// A conntrack sysctl of the node's namespace.
fn sysctl(netns: &str, name: &str) -> String {
    Cluster::exec(netns, &["cat", &format!("{NETFILTER}/{name}")])
        .expect("read sysctl")
        .trim()
        .to_owned()
}

/// The value of the agent's metric `series` (name and labels); 0 for a counter not created yet
/// while the metrics answer.
fn metric(netns: &str, series: &str) -> Option<u64> {
    let addr = SocketAddr::new("127.0.0.1".parse().ok()?, 10249);
    let (200, text) = http_get(netns, addr, "/metrics").ok()? else {
        return None;
    };
    let found = text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')
            .and_then(|v| v.trim().parse().ok())
    });
    Some(found.unwrap_or(0))
}

/// The agent's count of full syncs.
fn full_syncs(netns: &str) -> Option<u64> {
    metric(netns, "kubeproxy_sync_full_proxy_rules_duration_seconds_count")
}

/// The agent's count of idle checks that found `result` (`intact`, `changed`).
fn idle_checks(netns: &str, result: &str) -> Option<u64> {
    metric(
        netns,
        &format!("switchyard_idle_checks_total{{result=\"{result}\"}}"),
    )
}

/// The node's `ConntrackSysctls` condition (status, reason, message).
async fn conntrack_condition(proxies: &Api<NodeProxy>, node: &str) -> Option<(String, String, String)> {
    let np = proxies.get(node).await.ok()?;
    np.status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == "ConntrackSysctls")
        .map(|c| (c.status, c.reason, c.message))
}

/// Waits until the NodeProxy spec's `proxy` satisfies `check` (the operator has written it).
async fn spec_reached(proxies: &Api<NodeProxy>, node: &str, what: &str, check: fn(&Value) -> bool) {
    eventually(LIMIT, what, || async move {
        let np = proxies.get(node).await.ok()?;
        let proxy = serde_json::to_value(&np.spec.proxy).ok()?;
        check(&proxy).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The node's host-global `nf_conntrack_max` (checked read-only in the node first: the kernel
/// refuses it there, so the test cannot change the host's value).
fn host_conntrack_max(netns: &str) -> u64 {
    let path = format!("{NETFILTER}/nf_conntrack_max");
    let mode = Cluster::exec(netns, &["stat", "-c", "%a", &path]).expect("stat");
    assert_eq!(
        mode.trim(),
        "444",
        "nf_conntrack_max must be read-only in the node"
    );
    std::fs::read_to_string(&path)
        .expect("host nf_conntrack_max")
        .trim()
        .parse()
        .expect("a number")
}

/// One node labelled into the policy's pool, a Service without and one with the proxy name, an
/// agent in nftables mode (flags: no proxy name, 30 s sync period) and an operator.
async fn setup() -> (TestEnv, Operator, Api<NodeProxy>) {
    let mut env = TestEnv::start(1, 0).await.expect("control plane and a node");
    let admin = env.cp.admin_client().await.expect("admin");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    let label = json!({"metadata": {"labels": {"pool": "ps"}}});
    let name = env.cluster.nodes[0].name.clone();
    nodes
        .patch(&name, &PatchParams::default(), &Patch::Merge(&label))
        .await
        .expect("label node");
    apply_service(&admin, "plain", PLAIN, None).await;
    apply_service(&admin, "named", NAMED, Some(PROXY_NAME)).await;
    env.start_agents(&["--mode", "nftables", "--cluster-cidr", "10.244.0.0/16"])
        .await
        .expect("agent");
    let operator = Operator::start(&env.cp, "op-a", &[]).await.expect("operator");
    (env, operator, Api::all(admin))
}

/// Whether the agent's state file remembers a replaced conntrack value.
fn state_remembers(env: &TestEnv, node: &str) -> bool {
    let file = env.cp.dir().join(format!("state-{node}")).join("state.json");
    std::fs::read_to_string(file).is_ok_and(|s| s.contains("udpTimeout"))
}

/// The policy drops the fields: the default proxy's Services and the node's own values return.
async fn settings_dropped(env: &TestEnv, proxies: &Api<NodeProxy>, before: &[String]) {
    let node = &env.cluster.nodes[0];
    let (netns, agent) = (node.netns.as_str(), &env.agents[0]);
    apply_policy(env, None);
    spec_reached(
        proxies,
        &node.name,
        "the settings gone from the NodeProxy spec",
        |p| p.get("serviceProxyName").is_none() && p.get("conntrack").is_none(),
    )
    .await;
    until(
        agent,
        "the unlabelled Service back, the named one out",
        || async { (programmed(netns) == (true, false)).then_some(()) },
    )
    .await;
    until(agent, "the node's own conntrack values back", || async {
        (knobs(netns) == before).then_some(())
    })
    .await;
    until(agent, "the ConntrackSysctls condition gone", || async {
        let conditions = proxies.get(&node.name).await.ok()?.status?.conditions;
        conditions
            .iter()
            .all(|c| c.type_ != "ConntrackSysctls")
            .then_some(())
    })
    .await;
    assert!(
        !state_remembers(env, &node.name),
        "nothing replaced is left in the state file"
    );
}

/// The policy sets a conntrack value again; the agent stops, and `--cleanup` (with its state
/// directory) puts the node's value back.
async fn cleanup_restores(env: &mut TestEnv, before: &[String]) {
    let node = env.cluster.nodes[0].clone();
    let netns = node.netns.as_str();
    apply_policy(env, Some(json!({"conntrack": {"udpTimeoutSeconds": 47}})));
    until(&env.agents[0], "the UDP timeout set again", || async {
        (sysctl(netns, KNOBS[0]) == "47").then_some(())
    })
    .await;
    // The agent stores what it replaced right after the write: wait for the file, not just the
    // kernel value.
    until(&env.agents[0], "the replaced value in the state file", || async {
        state_remembers(env, &node.name).then_some(())
    })
    .await;
    let log = env.agents[0].log_text();
    drop(env.agents.remove(0));
    assert_eq!(sysctl(netns, KNOBS[0]), "47", "a stopped agent leaves the value");
    let bin = binaries::workspace_bin("switchyard-agent").expect("agent binary");
    let state_dir = env.cp.dir().join(format!("state-{}", node.name));
    let (bin, state_dir) = (bin.display().to_string(), state_dir.display().to_string());
    Cluster::exec(netns, &[&bin, "--cleanup", "--state-dir", &state_dir])
        .unwrap_or_else(|e| panic!("--cleanup: {e}\nagent log:\n{log}"));
    assert_eq!(knobs(netns), before, "--cleanup put the node's values back");
    assert!(!state_remembers(env, &node.name), "and forgot them");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_settings_reach_the_node_without_a_restart() {
    let (mut env, _operator, proxies) = setup().await;
    let node = env.cluster.nodes[0].clone();
    let (netns, agent) = (node.netns.as_str(), &env.agents[0]);
    until(agent, "the unlabelled Service only, without a name", || async {
        (programmed(netns) == (true, false)).then_some(())
    })
    .await;
    let host_max = host_conntrack_max(netns);
    let before = knobs(netns);
    assert_eq!(before[1], "0", "tcp_be_liberal starts off");
    until(agent, "the full-sync metric", || async { full_syncs(netns) }).await;

    // Every field set in the policy.
    let proxy = json!({"serviceProxyName": PROXY_NAME, "syncPeriodSeconds": 2, "minSyncPeriodSeconds": 0,
        "conntrack": {"udpTimeoutSeconds": 47, "tcpBeLiberal": true, "tcpEstablishedTimeoutSeconds": 7207,
                      "maxPerCore": 1, "min": host_max + 1024}});
    apply_policy(&env, Some(proxy));
    spec_reached(
        &proxies,
        &node.name,
        "the policy's settings in the NodeProxy spec",
        |p| p["serviceProxyName"] == PROXY_NAME,
    )
    .await;
    until(agent, "the named Service in, the unlabelled one out", || async {
        (programmed(netns) == (false, true)).then_some(())
    })
    .await;
    until(agent, "the conntrack values in the node", || async {
        (knobs(netns) == POLICY_VALUES).then_some(())
    })
    .await;
    let (status, reason, message) = until(agent, "the ConntrackSysctls condition", || async {
        conntrack_condition(&proxies, &node.name).await
    })
    .await;
    println!("ConntrackSysctls={status} {reason}: {message}");
    assert_eq!((status.as_str(), reason.as_str()), ("False", "NotWritable"));
    assert!(
        message.contains("nf_conntrack_max") && message.contains("host-global"),
        "{message}"
    );
    assert_eq!(
        sysctl(netns, "nf_conntrack_max"),
        host_max.to_string(),
        "the host's value stays"
    );
    assert!(
        state_remembers(&env, &node.name),
        "the replaced values are in the state file"
    );
    let refusals = agent.log_text().matches(REFUSED).count();
    assert!(refusals >= 1, "the refusal is logged:\n{}", agent.log_text());

    // syncPeriodSeconds 2: an idle node checks its rules every 2 s (with the flag's 30 s, at
    // most two checks would fit in the bound), and does not resync in full while they are intact.
    let checks = until(agent, "the idle-check metric", || async {
        idle_checks(netns, "intact")
    })
    .await;
    let fulls = until(agent, "the full-sync metric", || async { full_syncs(netns) }).await;
    let start = std::time::Instant::now();
    let count = until(agent, "five idle checks", || async {
        idle_checks(netns, "intact").filter(|n| *n >= checks + 5)
    })
    .await;
    let fulls_after = until(agent, "the full-sync metric", || async { full_syncs(netns) }).await;
    println!(
        "idle checks {checks} -> {count} in {:?}, full syncs {fulls} -> {fulls_after}",
        start.elapsed()
    );
    assert_eq!(fulls_after, fulls, "intact rules are not resynced in full");
    // Our table deleted behind the agent's back: the next check finds it, a full resync restores it.
    let served = programmed(netns);
    let changed = until(agent, "the idle-check metric", || async {
        idle_checks(netns, "changed")
    })
    .await;
    Cluster::exec(netns, &["nft", "delete", "table", "ip", "switchyard"]).expect("delete our table");
    assert_eq!(programmed(netns), (false, false), "the table is gone");
    let start = std::time::Instant::now();
    until(agent, "the table restored by a full resync", || async {
        let found = idle_checks(netns, "changed")? > changed;
        (found && full_syncs(netns)? > fulls_after && programmed(netns) == served).then_some(())
    })
    .await;
    println!(
        "our table deleted behind the agent's back: restored in {:?} ({served:?} served)",
        start.elapsed()
    );
    let again = agent.log_text().matches(REFUSED).count();
    assert_eq!(again, refusals, "a refusal is logged once, not at every sync");

    settings_dropped(&env, &proxies, &before).await;
    assert!(
        env.agents[0].exit_status().is_none(),
        "the agent was never restarted"
    );
    cleanup_restores(&mut env, &before).await;
}
