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

/// ClusterIPs of the paging test's Services.
fn paged_ip(i: usize) -> String {
    format!("10.96.0.{}", 130 + i)
}

/// Adds Service `paged-{i}` (ClusterIP [`paged_ip`]) with a slice of `node`'s pod.
async fn add_paged(admin: &kube::Client, node: &switchyard_e2e::netns::Node, i: usize) {
    let name = format!("paged-{i}");
    let port = json!([{"name": "http", "port": 80, "targetPort": 8080}]);
    apply_service(
        admin,
        &name,
        json!({"clusterIP": paged_ip(i), "ports": port}),
        None,
    )
    .await
    .expect("service");
    let eps = [Ep::ready(node.pods[0].ip, &node.name)];
    apply_slice(admin, &name, &[("http", 8080, "TCP")], &eps)
        .await
        .expect("slice");
}

/// Some when `node`'s nftables table holds the ClusterIP of every `paged-{want}` and of no
/// `paged-{gone}`.
fn paged_programmed(node: &switchyard_e2e::netns::Node, want: &[usize], gone: &[usize]) -> Option<()> {
    let state = kernel_state(&node.netns, "nftables").ok()?;
    let ok = want.iter().all(|i| state.contains(&paged_ip(*i)))
        && !gone.iter().any(|i| state.contains(&paged_ip(*i)));
    ok.then_some(())
}

/// A control plane with one namespace node (no agent yet) and Services `paged-0` … `paged-{n-1}`.
async fn env_with_paged(n: usize) -> (TestEnv, kube::Client, switchyard_e2e::netns::Node) {
    let env = TestEnv::start(1, 1)
        .await
        .expect("control plane and a namespace node");
    let admin = env.cp.admin_client().await.expect("admin");
    let node = env.cluster.nodes[0].clone();
    for i in 0..n {
        add_paged(&admin, &node, i).await;
    }
    (env, admin, node)
}

/// SIGKILLs the control plane and starts it again (same data, ports and certificates).
async fn restart_control_plane(env: &mut TestEnv) {
    let killed = env.cp.kill_processes().expect("kill the control plane");
    env.cp
        .restart_processes(killed)
        .await
        .expect("restart the control plane");
}

/// Intake in protobuf, as the agent ships: Services and EndpointSlices listed in pages of 2 (real
/// continue tokens from the apiserver), then watched; after the control plane is SIGKILLed and
/// started again the watches resume or relist (whichever the apiserver asks for) and a delete and
/// an add made after the restart reach the kernel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_in_pages_and_follows_changes_across_a_control_plane_restart() {
    // 7 of each: 4 pages of 2 (the last one short), with the default `kubernetes` Service 8.
    let (mut env, admin, node) = env_with_paged(7).await;
    env.start_agents(&[
        "--mode",
        "nftables",
        "--list-page-size",
        "2",
        "--min-sync-period",
        "0.1",
    ])
    .await
    .expect("agent");
    let all: Vec<usize> = (0..7).collect();
    switchyard_e2e::eventually(Duration::from_secs(60), "all 7 paged Services programmed", || {
        std::future::ready(paged_programmed(&node, &all, &[]))
    })
    .await
    .expect("every page listed");

    restart_control_plane(&mut env).await;
    switchyard_e2e::objects::delete_service(&admin, "paged-0")
        .await
        .expect("delete");
    add_paged(&admin, &node, 7).await;
    let after: Vec<usize> = (1..8).collect();
    switchyard_e2e::eventually(
        Duration::from_secs(60),
        "the delete and the add made after the restart programmed",
        || std::future::ready(paged_programmed(&node, &after, &[0])),
    )
    .await
    .expect("the watches came back");
    let agent = &mut env.agents[0];
    assert_eq!(
        agent.exit_status(),
        None,
        "the agent exited:\n{}",
        agent.log_text()
    );
    let log = agent.log_text();
    let lists = log.lines().filter(|l| l.contains(" listed ")).count();
    println!("agent lists (Services and EndpointSlices, start-up and relists): {lists}");
    assert!(lists >= 2, "both kinds listed:\n{log}");
}

/// A watch resumed from a resource version the apiserver no longer has relists (kube-proxy's
/// reflector does the same on a 410). Made deterministic: the agent is frozen, the control plane
/// restarted (its watches end), a delete and an add made, and the control plane restarted again,
/// so its watch cache starts after the agent's last version; thawed, the agent's watches are
/// answered "too old resource version" and it must relist to see the delete and the add.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_a_forgotten_version_relists() {
    let (mut env, admin, node) = env_with_paged(3).await;
    env.start_agents(&["--mode", "nftables", "--min-sync-period", "0.1"])
        .await
        .expect("agent");
    switchyard_e2e::eventually(Duration::from_secs(60), "3 Services programmed", || {
        std::future::ready(paged_programmed(&node, &[0, 1, 2], &[]))
    })
    .await
    .expect("listed");

    env.agents[0].pause();
    restart_control_plane(&mut env).await;
    switchyard_e2e::objects::delete_service(&admin, "paged-0")
        .await
        .expect("delete");
    add_paged(&admin, &node, 3).await;
    restart_control_plane(&mut env).await;
    env.agents[0].resume();

    // Done when the kernel has the delete and the add and the log shows both kinds answered 410
    // and listed again (at start and after it: 4 lists).
    let relisted = |log: &str| {
        let by = |what: &str| {
            let field = [format!("watch={what} "), format!("watch=\"{what}\"")];
            log.lines().any(|l| {
                l.contains("relisting") && l.contains("410") && field.iter().any(|f| l.contains(f.as_str()))
            })
        };
        let lists = log.lines().filter(|l| l.contains(" listed ")).count();
        by("service") && by("endpointslice") && lists >= 4
    };
    let log_path = env.agents[0].log.clone();
    let outcome = switchyard_e2e::eventually(
        Duration::from_secs(60),
        "the delete and the add made while the agent was frozen programmed, after a relist of each kind",
        || {
            let done = paged_programmed(&node, &[1, 2, 3], &[0])
                .filter(|()| relisted(&switchyard_e2e::logs::read(&log_path)));
            std::future::ready(done)
        },
    )
    .await;
    let agent = &mut env.agents[0];
    let log = agent.log_text();
    assert!(outcome.is_ok(), "{outcome:?}:\n{log}");
    assert_eq!(agent.exit_status(), None, "the agent exited:\n{log}");
}
