//! The ProxyPolicy settings the backends render, each set in a real ProxyPolicy (through a real
//! operator to the nodes' NodeProxies, applied live without a restart) and seen in the
//! behaviour (issue 14, "an end-to-end test per field"): `clusterCIDR` (traffic from inside it
//! keeps its pod source; the nftables rule masquerading traffic from outside it names it),
//! `masqueradeAll` (the endpoint on the other node sees the client node's address instead of the
//! pod's), and `nodePortAddresses` (a NodePort answers on the node's address only while a listed
//! CIDR holds it). nftables mode, two namespace nodes, one pod each.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::NodeProxy;
use switchyard_e2e::{
    agent::TestEnv,
    eventually, kernel,
    objects::{Ep, apply_service, apply_slice},
    operator::Operator,
    traffic::{Outcome, probe, start_server},
};

const WEB: &str = "10.96.0.150";
const NODE_PORT: u16 = 30150;
const LIMIT: Duration = Duration::from_secs(60);

fn policy(proxy: Value) -> Value {
    json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
        "metadata": {"name": "dataplane"},
        "spec": {"nodeSelector": {"matchLabels": {"pool": "dp"}}, "mode": "nftables", "proxy": proxy}})
}

/// The address the endpoint saw for each of five connections from `netns` to `target`, or the
/// outcomes when one did not answer.
fn sources(netns: &str, target: SocketAddr) -> Result<Vec<IpAddr>, Vec<Outcome>> {
    let outcomes = probe(netns, target, false, 5, 1000).map_err(|_| Vec::new())?;
    outcomes
        .iter()
        .map(Outcome::peer_ip)
        .collect::<Option<Vec<_>>>()
        .ok_or(outcomes)
}

/// Waits until every NodeProxy's spec carries `field` = `value` under `proxy`, then until
/// `check` holds.
async fn applied<F>(env: &TestEnv, what: &str, field: &str, value: &Value, mut check: F)
where
    F: FnMut() -> bool,
{
    let admin = env.cp.admin_client().await.expect("admin");
    let proxies: Api<NodeProxy> = Api::all(admin);
    let nodes: Vec<String> = env.cluster.nodes.iter().map(|n| n.name.clone()).collect();
    eventually(LIMIT, &format!("{what}: in every NodeProxy spec"), || async {
        for node in &nodes {
            let np = proxies.get(node).await.ok()?;
            let spec = serde_json::to_value(np.spec.proxy.as_ref()?).ok()?;
            (spec.get(field) == Some(value)).then_some(())?;
        }
        Some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nagent logs:\n{}", env.agents[0].log_text()));
    eventually(LIMIT, what, || {
        let ok = check();
        async move { ok.then_some(()) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nagent logs:\n{}", env.agents[0].log_text()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_cidr_masquerade_all_and_node_port_addresses_reach_the_data_path() {
    let mut env = TestEnv::start(2, 1).await.expect("control plane and two nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let (n1, n2) = (env.cluster.nodes[0].clone(), env.cluster.nodes[1].clone());
    let _servers: Vec<_> = [&n1, &n2]
        .iter()
        .map(|n| start_server(&n.pods[0], &[8080], &[]).expect("server"))
        .collect();
    // The only endpoint is node-2's pod: node-1's pod reaches it across nodes.
    apply_service(
        &admin,
        "web",
        json!({"type": "NodePort", "clusterIP": WEB, "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": NODE_PORT, "protocol": "TCP"}]}),
        None,
    )
    .await
    .expect("service");
    apply_slice(
        &admin,
        "web",
        &[("http", 8080, "TCP")],
        &[Ep::ready(n2.pods[0].ip, &n2.name)],
    )
    .await
    .expect("slice");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    for n in [&n1, &n2] {
        nodes
            .patch(
                &n.name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"labels": {"pool": "dp"}}})),
            )
            .await
            .expect("label node");
    }
    // No --cluster-cidr: the policy's is the only one.
    env.start_agents(&["--mode", "nftables"]).await.expect("agents");
    let _operator = Operator::start(&env.cp, "op-dp", &[]).await.expect("operator");
    let web = SocketAddr::new(WEB.parse().expect("ip"), 80);
    let pod1 = n1.pods[0].clone();
    let node_port = SocketAddr::new(n1.ip.into(), NODE_PORT);

    // clusterCIDR: pod traffic keeps its source; the outside-the-cluster rule names the CIDR.
    env.cp
        .apply_json(&policy(
            json!({"clusterCIDR": "10.244.0.0/16", "masqueradeAll": false}),
        ))
        .expect("policy");
    applied(
        &env,
        "clusterCIDR",
        "clusterCIDR",
        &json!("10.244.0.0/16"),
        || {
            kernel::nft_ruleset(&n1.netns).is_ok_and(|r| r.contains("ip saddr != 10.244.0.0/16"))
                && sources(&pod1.netns, web).is_ok_and(|s| s.iter().all(|ip| *ip == IpAddr::from(pod1.ip)))
        },
    )
    .await;
    println!(
        "clusterCIDR 10.244.0.0/16: the endpoint sees the pod's address {}",
        pod1.ip
    );

    // masqueradeAll: the endpoint on node-2 sees node-1's address.
    env.cp
        .apply_json(&policy(
            json!({"clusterCIDR": "10.244.0.0/16", "masqueradeAll": true}),
        ))
        .expect("policy");
    applied(&env, "masqueradeAll", "masqueradeAll", &json!(true), || {
        sources(&pod1.netns, web).is_ok_and(|s| s.iter().all(|ip| *ip == IpAddr::from(n1.ip)))
    })
    .await;
    println!("masqueradeAll: the endpoint sees node-1's address {}", n1.ip);

    // nodePortAddresses: a CIDR without node-1's address closes its NodePort there; one with it
    // opens it again.
    let elsewhere = json!(["192.168.250.0/24"]);
    env.cp
        .apply_json(&policy(
            json!({"clusterCIDR": "10.244.0.0/16", "nodePortAddresses": elsewhere}),
        ))
        .expect("policy");
    applied(
        &env,
        "nodePortAddresses elsewhere",
        "nodePortAddresses",
        &elsewhere,
        || sources(&n2.netns, node_port).is_err(),
    )
    .await;
    let closed = probe(&n2.netns, node_port, false, 3, 1000).expect("probe");
    assert!(closed.iter().all(|o| o.server().is_none()), "{closed:?}");
    println!(
        "nodePortAddresses {elsewhere}: node-1's NodePort on {} does not answer ({closed:?})",
        n1.ip
    );
    let own = json!([format!("{}/32", n1.ip)]);
    env.cp
        .apply_json(&policy(
            json!({"clusterCIDR": "10.244.0.0/16", "nodePortAddresses": own}),
        ))
        .expect("policy");
    applied(
        &env,
        "nodePortAddresses with the node's address",
        "nodePortAddresses",
        &own,
        || sources(&n2.netns, node_port).is_ok(),
    )
    .await;
    println!("nodePortAddresses {own}: node-1's NodePort answers");
    for agent in &mut env.agents {
        assert!(agent.exit_status().is_none(), "the agent was never restarted");
    }
}
