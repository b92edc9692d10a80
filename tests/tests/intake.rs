//! What the agent takes from the API, per backend, as kube-proxy takes it: topology hints keep
//! each node's traffic in its zone; a Service labelled for another service proxy
//! (`service.kubernetes.io/service-proxy-name`), a headless Service and an ExternalName Service
//! are not programmed at all (checked in the kernel, and by traffic for the labelled one).

use std::{net::SocketAddr, time::Duration};

use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use switchyard_e2e::{
    Family, Result,
    agent::TestEnv,
    kernel,
    objects::{Ep, apply_service, apply_slice},
    traffic::{Outcome, probe, start_server, tally},
};

const HINTED: &str = "10.96.0.120";
const OTHER_PROXY: &str = "10.96.0.121";

/// The backend's state in the node's kernel; a failed listing is an error, never an empty text
/// that the absence checks below would pass on.
fn kernel_state(netns: &str, mode: &str) -> Result<String> {
    kernel::backend_state(netns, mode, &[Family::V4])
}

async fn scenario(mode: &str) {
    let mut env = TestEnv::start(2, 2)
        .await
        .expect("control plane and 2 namespace nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let nodes = env.cluster.nodes.clone();
    let (n1, n2) = (&nodes[0], &nodes[1]);
    let zones = ["zone-a", "zone-b"];
    let node_api: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    for (node, zone) in nodes.iter().zip(zones) {
        let labels = json!({"metadata": {"labels": {"topology.kubernetes.io/zone": zone}}});
        node_api
            .patch(&node.name, &PatchParams::default(), &Patch::Merge(&labels))
            .await
            .expect("zone label");
    }
    let servers: Vec<_> = nodes
        .iter()
        .map(|n| start_server(&n.pods[0], &[8080], &[]).expect("echo server"))
        .collect();
    let http = [("http", 8080, "TCP")];
    let port = json!([{"name": "http", "port": 80, "targetPort": 8080}]);

    // Every endpoint hinted for its node's zone: each node keeps to its own zone's endpoint.
    apply_service(
        &admin,
        "hinted",
        json!({"clusterIP": HINTED, "ports": port}),
        None,
    )
    .await
    .expect("hinted");
    let hinted = [
        Ep::ready(n1.pods[0].ip, &n1.name).for_zone(zones[0]),
        Ep::ready(n2.pods[0].ip, &n2.name).for_zone(zones[1]),
    ];
    apply_slice(&admin, "hinted", &http, &hinted)
        .await
        .expect("hinted slice");
    // Labelled for another service proxy: someone else's to program.
    let labels = json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    let api: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(admin.clone(), "default");
    apply_service(
        &admin,
        "other-proxy",
        json!({"clusterIP": OTHER_PROXY, "ports": port}),
        None,
    )
    .await
    .expect("other-proxy");
    api.patch(
        "other-proxy",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": labels}})),
    )
    .await
    .expect("label");
    apply_slice(&admin, "other-proxy", &http, &hinted)
        .await
        .expect("other-proxy slice");
    // Headless and ExternalName: nothing to proxy.
    apply_service(
        &admin,
        "headless",
        json!({"clusterIP": "None", "ports": port}),
        None,
    )
    .await
    .expect("headless");
    apply_slice(&admin, "headless", &http, &hinted)
        .await
        .expect("headless slice");
    apply_service(
        &admin,
        "external-name",
        json!({"type": "ExternalName", "externalName": "example.invalid"}),
        None,
    )
    .await
    .expect("external-name");

    env.start_agents(&[
        "--mode",
        mode,
        "--cluster-cidr",
        "10.244.0.0/16",
        "--min-sync-period",
        "0.1",
    ])
    .await
    .expect("agents");
    let target: SocketAddr = format!("{HINTED}:80").parse().expect("addr");
    // Deterministic when hints are honoured (no false failure). Were they ignored, 20 uniform
    // choices between the 2 endpoints would all land on the node's own one with probability
    // 2^-20 < 1e-6 per node.
    for (node, own) in [(n1, &n1.pods[0].name), (n2, &n2.pods[0].name)] {
        let mut answered = Vec::new();
        for _ in 0..300 {
            answered = probe(&node.pods[1].netns, target, false, 20, 1000).expect("probe");
            if answered.iter().all(|o| matches!(o, Outcome::Answered { .. })) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let t = tally(&answered);
        assert_eq!(
            t.keys().collect::<Vec<_>>(),
            [own],
            "{mode}: {} keeps to its zone: {t:?}",
            node.name
        );
        assert_eq!(t.values().sum::<usize>(), 20, "{mode}: {t:?}");
        println!("{mode}: {} -> {t:?}", node.name);
    }

    // The other proxy's Service, the headless and the ExternalName one are not in the kernel.
    for node in &nodes {
        let state = kernel_state(&node.netns, mode).expect("kernel state");
        assert!(state.contains(HINTED), "{mode}: the hinted Service is programmed");
        for absent in [
            OTHER_PROXY,
            "default/other-proxy",
            "default/headless",
            "default/external-name",
        ] {
            assert!(
                !state.contains(absent),
                "{mode}: {absent} must not be programmed on {}",
                node.name
            );
        }
    }
    let o = probe(
        &n1.pods[1].netns,
        format!("{OTHER_PROXY}:80").parse().expect("addr"),
        false,
        3,
        500,
    )
    .expect("probe");
    assert!(
        o.iter().all(|x| !matches!(x, Outcome::Answered { .. })),
        "{mode}: the other proxy's Service answered: {o:?}"
    );
    drop(servers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_takes_what_kube_proxy_takes() {
    scenario("nftables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_takes_what_kube_proxy_takes() {
    scenario("iptables").await;
}
