//! Agents in network-namespace nodes register NodeProxies whose capabilities match this kernel,
//! and an agent's identity is confined to its own node's NodeProxy status.

use std::time::Duration;

use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use switchyard_crds::v1alpha1::{NodeProxy, ProxyMode, ProxyPolicy};
use switchyard_e2e::{
    agent::{SYSTEM_NAMESPACE, TestEnv},
    eventually,
};

fn forbidden(result: Result<impl std::fmt::Debug, kube::Error>) -> String {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 || status.code == 422 => status.message.clone(),
        other => panic!("expected the apiserver to forbid this, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_register_capabilities_and_are_confined_to_their_node() {
    let mut env = TestEnv::start(3, 0)
        .await
        .expect("control plane and 3 namespace nodes");
    env.start_agents(&["--report-only"]).await.expect("agents start");
    let admin = env.cp.admin_client().await.expect("admin client");
    let proxies: Api<NodeProxy> = Api::all(admin.clone());

    // Every agent registers its NodeProxy with capabilities probed in its own namespace.
    for agent in &env.agents {
        let np = eventually(
            Duration::from_secs(60),
            &format!("NodeProxy {} status", agent.node),
            || {
                let proxies = proxies.clone();
                let name = agent.node.clone();
                async move {
                    proxies
                        .get_opt(&name)
                        .await
                        .ok()
                        .flatten()
                        .filter(|np| np.status.as_ref().is_some_and(|s| s.capabilities.is_some()))
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}; agent log:\n{}", agent.log_text()));
        let caps = np.status.and_then(|s| s.capabilities).expect("capabilities");
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("kernel release");
        assert_eq!(caps.kernel_version, release.trim());
        assert!(
            caps.nftables.usable,
            "nf_tables is usable on this kernel: {:?}",
            caps.nftables
        );
        assert!(!caps.ipvs.usable, "this kernel has no IPVS: {:?}", caps.ipvs);
        assert!(
            caps.ipvs.detail.as_deref().unwrap_or_default().contains("IPVS"),
            "{:?}",
            caps.ipvs
        );
        assert!(caps.ipset.usable);
        // No IPVS here; `external` (another service proxy serves the node) is always possible.
        assert_eq!(
            caps.supported_modes,
            vec![ProxyMode::Iptables, ProxyMode::Nftables, ProxyMode::External]
        );
        assert!(caps.iptables_variant.is_some());
        // Owned by its Node, with an empty spec: the agent never writes spec.
        let owners = np.metadata.owner_references.unwrap_or_default();
        assert_eq!(owners.len(), 1);
        assert_eq!(
            (owners[0].kind.as_str(), owners[0].name.as_str()),
            ("Node", agent.node.as_str())
        );
        assert_eq!(np.spec, Default::default());
    }

    // The probe left nothing behind in the node namespaces.
    for node in &env.cluster.nodes {
        let tables = switchyard_e2e::netns::Cluster::exec(&node.netns, &["nft", "list", "tables"])
            .expect("nft list tables");
        assert_eq!(tables.trim(), "", "{} has leftover nft tables", node.name);
    }

    // Printer columns, wide.
    let wide = env
        .cp
        .kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)
        .expect("get nodeproxies");
    let header: Vec<&str> = wide
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME", "DESIRED", "ACTIVE", "PHASE", "KERNEL", "MODES", "POLICY", "AGE"
        ],
        "{wide}"
    );
    assert_eq!(
        wide.lines().filter(|l| l.starts_with("node-")).count(),
        3,
        "{wide}"
    );
    assert!(
        wide.contains("Initializing") && wide.contains("[\"iptables\",\"nftables\",\"external\"]"),
        "{wide}"
    );
    println!("{wide}");

    // node-1's agent identity, as the real agent holds it (token bound to its pod on node-1).
    let token = env
        .cp
        .service_account_token(
            SYSTEM_NAMESPACE,
            "switchyard-agent",
            Some(("switchyard-agent-node-1", &pod_uid(&env, "node-1").await)),
        )
        .await
        .expect("token for node-1's agent");
    let agent1 = env
        .cp
        .token_client("agent-node-1-probe", &token)
        .await
        .expect("agent client");
    let as_agent: Api<NodeProxy> = Api::all(agent1.clone());
    let apply = PatchParams::apply("switchyard-agent").force();

    // Its own status: allowed.
    let own = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "status": {"agentVersion": "probe"}});
    as_agent
        .patch_status("node-1", &apply, &Patch::Apply(&own))
        .await
        .expect("agent writes its own status");

    // Another node's status: denied by the admission policy, with its message. The apiserver loads
    // admission policies asynchronously after they are created, so wait until it enforces it.
    let msg = eventually(
        Duration::from_secs(30),
        "the admission policy to be enforced",
        || {
            let (as_agent, apply, own) = (as_agent.clone(), apply.clone(), own.clone());
            async move {
                match as_agent.patch_status("node-2", &apply, &Patch::Apply(&own)).await {
                    Ok(_) => None,
                    other => Some(forbidden(other)),
                }
            }
        },
    )
    .await
    .expect("policy enforced");
    assert!(
        msg.contains("switchyard-agent on node node-1 may only write NodeProxy node-1, not node-2"),
        "{msg}"
    );

    // Its own spec: denied (RBAC grants no update or patch of nodeproxies, only of their status).
    let spec = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "metadata": {"name": "node-1"}, "spec": {"desiredMode": "iptables"}});
    let msg = forbidden(as_agent.patch("node-1", &apply, &Patch::Apply(&spec)).await);
    assert!(msg.contains("cannot patch resource \"nodeproxies\""), "{msg}");

    // Creating a NodeProxy for another node, or one with a spec: denied.
    let mut other = NodeProxy::new("node-9", Default::default());
    let msg = forbidden(as_agent.create(&PostParams::default(), &other).await);
    assert!(
        msg.contains("may only write NodeProxy node-1, not node-9"),
        "{msg}"
    );
    other.metadata.name = Some("node-1".into());
    other.spec.desired_mode = Some(ProxyMode::Ipvs);
    let _ = proxies
        .delete("node-1", &Default::default())
        .await
        .expect("admin deletes node-1's NodeProxy");
    let msg = forbidden(as_agent.create(&PostParams::default(), &other).await);
    assert!(msg.contains("may not write NodeProxy spec"), "{msg}");

    // Deleting: denied (RBAC grants no delete).
    let msg = forbidden(as_agent.delete("node-2", &Default::default()).await);
    assert!(msg.contains("forbidden"), "{msg}");

    // Any ProxyPolicy: denied by RBAC, read and write.
    let policies: Api<ProxyPolicy> = Api::all(agent1);
    let msg = forbidden(policies.list(&Default::default()).await);
    assert!(msg.contains("cannot list resource \"proxypolicies\""), "{msg}");
    let policy: ProxyPolicy = serde_json::from_value(json!({
        "apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
        "metadata": {"name": "sneaky"}, "spec": {"nodeSelector": {}, "mode": "iptables"}
    }))
    .expect("policy");
    let msg = forbidden(policies.create(&PostParams::default(), &policy).await);
    assert!(msg.contains("cannot create resource \"proxypolicies\""), "{msg}");

    // A token without a node binding is refused even for "its own" name.
    let unbound = env
        .cp
        .service_account_token(SYSTEM_NAMESPACE, "switchyard-agent", None)
        .await
        .expect("unbound token");
    let unbound = env
        .cp
        .token_client("agent-unbound", &unbound)
        .await
        .expect("client");
    let msg = forbidden(
        Api::<NodeProxy>::all(unbound)
            .patch_status("node-2", &apply, &Patch::Apply(&own))
            .await,
    );
    assert!(
        msg.contains("must use a service-account token bound to a pod on a node"),
        "{msg}"
    );

    // The node-1 agent restarts its registration after the admin deleted its NodeProxy: it is recreated.
    drop(env.agents.remove(0));
    let node1 = env.cluster.nodes[0].clone();
    let token = env
        .cp
        .service_account_token(
            SYSTEM_NAMESPACE,
            "switchyard-agent",
            Some(("switchyard-agent-node-1", &pod_uid(&env, "node-1").await)),
        )
        .await
        .expect("token");
    env.agents
        .push(switchyard_e2e::agent::Agent::start(&env.cp, &node1, &token, &[]).expect("restart agent"));
    eventually(Duration::from_secs(60), "node-1 re-registered", || {
        let proxies = proxies.clone();
        async move {
            proxies
                .get_opt("node-1")
                .await
                .ok()
                .flatten()
                .filter(|np| np.status.as_ref().is_some_and(|s| s.capabilities.is_some()))
        }
    })
    .await
    .expect("node-1 NodeProxy recreated by its agent");
}

async fn pod_uid(env: &TestEnv, node: &str) -> String {
    let pods: Api<k8s_openapi::api::core::v1::Pod> =
        Api::namespaced(env.cp.admin_client().await.expect("client"), SYSTEM_NAMESPACE);
    pods.get(&format!("switchyard-agent-{node}"))
        .await
        .expect("agent pod")
        .metadata
        .uid
        .expect("uid")
}
