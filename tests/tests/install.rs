//! The install paths: the Helm chart (`helm lint`, `helm template`, `helm install` into a real
//! apiserver, and its RBAC exercised with the chart's own service accounts) and the kustomize bases
//! (`kubectl apply -k config/default`, the samples), kept equal to each other.
//!
//! `config/operator/operator.yaml` and `config/agent/agent.yaml` are rendered from the chart;
//! `SWITCHYARD_UPDATE_GOLDEN=1 cargo test -p switchyard-e2e --test install` rewrites them.

use std::{path::PathBuf, time::Duration};

use k8s_openapi::api::{
    core::v1::{Node, Pod, Secret, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{NodeProxy, ProxyPolicy};
use switchyard_e2e::{binaries, controlplane::ControlPlane, eventually, operator::Operator, tools};

fn chart() -> String {
    binaries::workspace_root()
        .join("helm/switchyard")
        .display()
        .to_string()
}

fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} not rendered"))
}

#[test]
fn chart_lints_and_renders() {
    let out = tools::helm_ok(&["lint", "--strict", &chart()]).expect("helm lint --strict");
    println!("{out}");
    let all = tools::helm_ok(&[
        "template",
        "sy",
        &chart(),
        "--namespace",
        "net-system",
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "agent.loadKernelModules=true",
        "--set",
        "agent.kubeProxyCleanup.enabled=true",
        "--set",
        "agent.takeoverKubeProxy=true",
    ])
    .expect("helm template with every option");
    let objects = docs(&all);
    let mut kinds: Vec<String> = objects
        .iter()
        .map(|o| o["kind"].as_str().unwrap_or_default().to_owned())
        .collect();
    kinds.sort();
    kinds.dedup();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "DaemonSet",
            "Deployment",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ]
    );
    let ds = find(&objects, "DaemonSet", "sy-switchyard-agent");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(
        pod["tolerations"],
        json!([{"operator": "Exists"}]),
        "runs on every node"
    );
    let agent = &pod["containers"][0];
    assert_eq!(
        agent["securityContext"]["capabilities"]["add"],
        json!(["NET_ADMIN", "NET_RAW", "SYS_MODULE"])
    );
    assert_eq!(
        agent["env"][0],
        json!({"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    );
    let mounts = agent["volumeMounts"].as_array().expect("mounts");
    assert!(
        mounts
            .iter()
            .any(|m| m["mountPath"] == "/lib/modules" && m["readOnly"] == true),
        "{mounts:?}"
    );
    assert!(
        mounts.iter().any(|m| m["mountPath"] == "/var/lib/switchyard"),
        "{mounts:?}"
    );
    assert_eq!(
        pod["initContainers"][0]["command"],
        json!(["kube-proxy", "--cleanup"])
    );
    assert!(
        agent["args"]
            .as_array()
            .is_some_and(|a| a.contains(&json!("--takeover-kube-proxy"))),
        "{agent}"
    );
    // Every flag the chart passes exists in the binaries.
    for (binary, args) in [
        ("switchyard-agent", &agent["args"]),
        (
            "switchyard-operator",
            &find(&objects, "Deployment", "sy-switchyard-operator")["spec"]["template"]["spec"]["containers"]
                [0]["args"],
        ),
    ] {
        let help = switchyard_e2e::run(
            &binaries::workspace_bin(binary)
                .expect("binary")
                .display()
                .to_string(),
            &["--help"],
        )
        .expect("--help");
        for arg in args.as_array().expect("args") {
            let flag = arg
                .as_str()
                .unwrap_or_default()
                .split('=')
                .next()
                .unwrap_or_default();
            assert!(
                help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                "{binary} has no {flag}:\n{help}"
            );
        }
    }
    let deploy = find(&objects, "Deployment", "sy-switchyard-operator");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let args = deploy["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(
        args.contains("--lease-name=switchyard-operator") && args.contains("--lease-duration-seconds=15"),
        "{args}"
    );
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "sy-switchyard-agent-own-nodeproxy",
    );
    assert!(
        vap["spec"]["matchConditions"][0]["expression"]
            .as_str()
            .is_some_and(|e| e.contains("system:serviceaccount:net-system:sy-switchyard-agent")),
        "{vap}"
    );

    // Defaults: no SYS_MODULE, no optional objects.
    let objects =
        docs(&tools::helm_ok(&["template", "sy", &chart(), "--namespace", "net-system"]).expect("template"));
    let ds = find(&objects, "DaemonSet", "sy-switchyard-agent");
    assert_eq!(
        ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"],
        json!(["NET_ADMIN", "NET_RAW"])
    );
    assert!(
        !objects
            .iter()
            .any(|o| o["kind"] == "ServiceMonitor" || o["kind"] == "NetworkPolicy")
    );

    // values.schema.json rejects what the chart cannot do.
    for bad in [
        "agent.mode=userspace",
        "operator.replicas=0",
        "agent.stateDir=relative",
        "agent.clusterCIDR=10.244.0.0",
    ] {
        let (ok, _, err) = tools::helm_run(&["template", "sy", &chart(), "--set", bad]).expect("helm");
        assert!(!ok && err.contains("schema"), "{bad} must fail the schema: {err}");
    }
    // A dual-stack cluster CIDR (one per family) reaches the agent's flag as given.
    let dual = tools::helm_ok(&[
        "template",
        "sy",
        &chart(),
        "--set-string",
        "agent.clusterCIDR=10.244.0.0/16\\,fd00:10:244::/56",
    ])
    .expect("helm template with a dual-stack cluster CIDR");
    assert!(
        dual.contains("--cluster-cidr=10.244.0.0/16,fd00:10:244::/56"),
        "{dual}"
    );
    let (ok, _, err) = tools::helm_run(&[
        "template",
        "sy",
        &chart(),
        "--set",
        "operator.leaderElection.leaseGraceSeconds=20",
    ])
    .expect("helm");
    assert!(!ok && err.contains("leaseGraceSeconds must be less"), "{err}");
}

/// The chart rendered for `config/<dir>/<file>`: release "switchyard" in switchyard-system, without
/// Helm's own labels.
fn rendered(template: &str) -> String {
    let out = tools::helm_ok(&[
        "template",
        "switchyard",
        &chart(),
        "--namespace",
        "switchyard-system",
        "--show-only",
        template,
    ])
    .expect("helm template");
    let body: String = out
        .lines()
        .filter(|l| !l.contains("helm.sh/chart:") && !l.contains("app.kubernetes.io/managed-by: Helm"))
        .map(|l| format!("{l}\n"))
        .collect();
    format!(
        "# Rendered from helm/switchyard ({template}, release \"switchyard\" in switchyard-system) by\n# `SWITCHYARD_UPDATE_GOLDEN=1 cargo test -p switchyard-e2e --test install`; do not edit.\n{body}"
    )
}

#[test]
fn config_bases_are_rendered_from_the_chart() {
    let root = binaries::workspace_root();
    for (file, template) in [
        (
            "config/operator/operator.yaml",
            "templates/operator-deployment.yaml",
        ),
        ("config/agent/agent.yaml", "templates/agent-daemonset.yaml"),
    ] {
        let want = rendered(template);
        let path = root.join(file);
        if std::env::var_os("SWITCHYARD_UPDATE_GOLDEN").is_some() {
            std::fs::write(&path, &want).expect("write");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == want,
            "{file} is stale: run SWITCHYARD_UPDATE_GOLDEN=1 cargo test -p switchyard-e2e --test install"
        );
    }
}

#[test]
fn config_rbac_equals_the_charts() {
    let root = binaries::workspace_root();
    let mut config = Vec::new();
    for file in ["operator.yaml", "agent.yaml", "agent-admission.yaml"] {
        config.extend(docs(
            &std::fs::read_to_string(root.join("config/rbac").join(file)).expect("read"),
        ));
    }
    let chart_objects = docs(
        &tools::helm_ok(&[
            "template",
            "switchyard",
            &chart(),
            "--namespace",
            "switchyard-system",
        ])
        .expect("template"),
    );
    for (kind, name, field) in [
        ("ClusterRole", "switchyard-operator", "rules"),
        ("ClusterRole", "switchyard-agent", "rules"),
        ("Role", "switchyard-operator-leader-election", "rules"),
        (
            "ValidatingAdmissionPolicy",
            "switchyard-agent-own-nodeproxy",
            "spec",
        ),
    ] {
        let c = find(&config, kind, name);
        let h = find(&chart_objects, kind, name);
        assert_eq!(
            c[field], h[field],
            "{kind} {name}: config/rbac and the chart differ"
        );
    }
    for (kind, name) in [
        ("ClusterRoleBinding", "switchyard-operator"),
        ("ClusterRoleBinding", "switchyard-agent"),
        ("RoleBinding", "switchyard-operator-leader-election"),
    ] {
        let (c, h) = (find(&config, kind, name), find(&chart_objects, kind, name));
        assert_eq!(
            (&c["roleRef"], &c["subjects"]),
            (&h["roleRef"], &h["subjects"]),
            "{kind} {name}"
        );
    }
}

async fn create_node(client: &Client, name: &str) {
    let node: Node =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {"pool": "general"}}}))
            .expect("node");
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
}

/// A token of the chart's agent service account bound to a Pod on `node` (as the kubelet would
/// mount it into the DaemonSet's pod there).
async fn agent_token(cp: &ControlPlane, namespace: &str, account: &str, node: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(cp.admin_client().await.expect("admin"), namespace);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("agent-{node}")},
        "spec": {"nodeName": node, "serviceAccountName": account, "automountServiceAccountToken": false,
                 "containers": [{"name": "agent", "image": "switchyard-agent:test"}]},
    }))
    .expect("pod");
    let created = pods
        .create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    cp.service_account_token(
        namespace,
        account,
        Some((&created.name_any(), &created.uid().unwrap_or_default())),
    )
    .await
    .expect("token")
}

fn denied<T: std::fmt::Debug>(r: Result<T, kube::Error>, code: u16, what: &str) -> String {
    match r {
        Err(kube::Error::Api(s)) if s.code == code => s.message,
        other => panic!("{what}: expected HTTP {code}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_and_the_charts_rbac() {
    let cp = ControlPlane::start().await.expect("control plane");
    let kubeconfig = cp.admin_kubeconfig().display().to_string();
    let (ns, release) = ("net-system", "edge");
    let out = tools::helm_ok(&[
        "install",
        release,
        &chart(),
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        ns,
        "--create-namespace",
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "agent.loadKernelModules=true",
        "--timeout",
        "2m",
    ])
    .expect("helm install");
    println!("{out}");
    let status = tools::helm_ok(&["status", release, "--kubeconfig", &kubeconfig, "--namespace", ns])
        .expect("helm status");
    assert!(status.contains("STATUS: deployed"), "{status}");
    let listed = cp
        .kubectl_ok(&["get", "-n", ns, "deployment,daemonset,serviceaccount,service,poddisruptionbudget,networkpolicy,role,rolebinding", "-o", "name"], None)
        .expect("get");
    for want in [
        "deployment.apps/edge-switchyard-operator",
        "daemonset.apps/edge-switchyard-agent",
        "serviceaccount/edge-switchyard-agent",
        "serviceaccount/edge-switchyard-operator",
        "poddisruptionbudget.policy/edge-switchyard-operator",
        "networkpolicy.networking.k8s.io/edge-switchyard-operator",
    ] {
        assert!(listed.contains(want), "{want} missing:\n{listed}");
    }
    cp.wait_crds_established().expect("CRDs from the chart's crds/");

    let admin = cp.admin_client().await.expect("admin");
    for n in ["node-1", "node-2"] {
        create_node(&admin, n).await;
    }
    let svc: Service = serde_json::from_value(
        json!({"metadata": {"name": "web", "namespace": "default"}, "spec": {"ports": [{"port": 80}]}}),
    )
    .expect("svc");
    Api::<Service>::namespaced(admin.clone(), "default")
        .create(&PostParams::default(), &svc)
        .await
        .expect("service");
    let secret: Secret = serde_json::from_value(
        json!({"metadata": {"name": "db-password", "namespace": ns}, "stringData": {"p": "x"}}),
    )
    .expect("secret");
    Api::<Secret>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("secret");

    // The agent, with a token bound to its pod on node-1.
    let token = agent_token(&cp, ns, "edge-switchyard-agent", "node-1").await;
    let agent = cp
        .token_client("chart-agent", &token)
        .await
        .expect("agent client");
    Api::<Service>::all(agent.clone())
        .list(&ListParams::default())
        .await
        .expect("agent lists Services");
    Api::<EndpointSlice>::all(agent.clone())
        .list(&ListParams::default())
        .await
        .expect("agent lists EndpointSlices");
    Api::<Node>::all(agent.clone())
        .get("node-1")
        .await
        .expect("agent reads its Node");
    let proxies: Api<NodeProxy> = Api::all(agent.clone());
    // The admission policy takes effect shortly after it is created: wait (with dry runs).
    let probe: NodeProxy = serde_json::from_value(json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "metadata": {"name": "node-2"}, "spec": {}})).expect("np");
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let (proxies_ref, probe_ref, dry_ref) = (&proxies, &probe, &dry);
    eventually(
        Duration::from_secs(30),
        "the admission policy is enforced",
        || async move {
            matches!(proxies_ref.create(dry_ref, probe_ref).await, Err(kube::Error::Api(s)) if s.code == 403)
                .then_some(())
        },
    )
    .await
    .expect("admission policy active");
    let with_spec: NodeProxy = serde_json::from_value(json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "metadata": {"name": "node-1"}, "spec": {"desiredMode": "iptables"}})).expect("np");
    let msg = denied(
        proxies.create(&PostParams::default(), &with_spec).await,
        403,
        "create its NodeProxy with a spec",
    );
    assert!(msg.contains("may not write NodeProxy spec"), "{msg}");
    let own: NodeProxy = serde_json::from_value(json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "metadata": {"name": "node-1"}, "spec": {}})).expect("np");
    proxies
        .create(&PostParams::default(), &own)
        .await
        .expect("agent creates its own NodeProxy");
    let status = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "status": {"activeMode": "nftables", "phase": "Active"}});
    let pp = PatchParams::apply("switchyard-agent").force();
    proxies
        .patch_status("node-1", &pp, &Patch::Apply(&status))
        .await
        .expect("agent writes its own status");
    // Another node's NodeProxy: not for this agent.
    let other: NodeProxy = serde_json::from_value(json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "metadata": {"name": "node-2"}, "spec": {}})).expect("np");
    let msg = denied(
        proxies.create(&PostParams::default(), &other).await,
        403,
        "create node-2's NodeProxy",
    );
    assert!(msg.contains("may only write NodeProxy node-1"), "{msg}");
    Api::<NodeProxy>::all(admin.clone())
        .create(&PostParams::default(), &other)
        .await
        .expect("admin creates node-2");
    let msg = denied(
        proxies.patch_status("node-2", &pp, &Patch::Apply(&status)).await,
        403,
        "write node-2's status",
    );
    assert!(msg.contains("may only write NodeProxy node-1"), "{msg}");
    let spec = json!({"spec": {"desiredMode": "iptables"}});
    denied(
        proxies
            .patch("node-1", &PatchParams::default(), &Patch::Merge(&spec))
            .await,
        403,
        "write its own spec",
    );
    denied(
        proxies.delete("node-1", &DeleteParams::default()).await,
        403,
        "delete its NodeProxy",
    );
    denied(
        Api::<Secret>::namespaced(agent.clone(), ns)
            .list(&ListParams::default())
            .await,
        403,
        "agent lists Secrets",
    );
    // An agent token without a pod (no node-name claim) writes nothing.
    let unbound = cp
        .service_account_token(ns, "edge-switchyard-agent", None)
        .await
        .expect("token");
    let unbound = cp
        .token_client("chart-agent-unbound", &unbound)
        .await
        .expect("client");
    let msg = denied(
        Api::<NodeProxy>::all(unbound)
            .patch_status("node-1", &pp, &Patch::Apply(&status))
            .await,
        403,
        "unbound token writes status",
    );
    assert!(msg.contains("no node-name claim"), "{msg}");

    // The operator cannot read Secrets.
    let token = cp
        .service_account_token(ns, "edge-switchyard-operator", None)
        .await
        .expect("token");
    let op_client = cp.token_client("chart-operator", &token).await.expect("client");
    denied(
        Api::<Secret>::namespaced(op_client.clone(), ns)
            .list(&ListParams::default())
            .await,
        403,
        "operator lists Secrets",
    );
    denied(
        Api::<Secret>::namespaced(op_client.clone(), ns)
            .get("db-password")
            .await,
        403,
        "operator reads a Secret",
    );
    denied(
        Api::<Secret>::all(op_client.clone())
            .list(&ListParams::default())
            .await,
        403,
        "operator lists all Secrets",
    );

    // ... and its RBAC is enough to run: the real operator, as the chart's service account, leads
    // through a Lease in the release namespace and plans a policy.
    let op = Operator::start_as(
        &cp,
        ns,
        "edge-switchyard-operator",
        "chart-op",
        &["--lease-name", "switchyard-operator"],
    )
    .await
    .expect("operator");
    cp.kubectl_ok(
        &["apply", "-f", "-"],
        Some("apiVersion: switchyard.dev/v1alpha1\nkind: ProxyPolicy\nmetadata: {name: general}\nspec:\n  nodeSelector: {matchLabels: {pool: general}}\n  mode: nftables\n  rollout: {paused: true}\n"),
    )
    .expect("policy");
    let policies: Api<ProxyPolicy> = Api::all(admin.clone());
    let policies = &policies;
    eventually(
        Duration::from_secs(60),
        "status from the chart's operator",
        || async move {
            policies
                .get("general")
                .await
                .ok()?
                .status
                .filter(|s| s.target_nodes == 2)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; operator log:\n{}", op.log_text()));
    let lease = cp
        .kubectl_ok(
            &[
                "get",
                "lease",
                "-n",
                ns,
                "switchyard-operator",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ],
            None,
        )
        .expect("lease");
    assert_eq!(lease, "chart-op");
    tools::helm_ok(&[
        "uninstall",
        release,
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        ns,
    ])
    .expect("helm uninstall");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kustomize_default_and_the_samples_apply() {
    let cp = ControlPlane::start().await.expect("control plane");
    let root = binaries::workspace_root();
    let default = root.join("config/default").display().to_string();
    let out = cp
        .kubectl_ok(&["apply", "-k", &default], None)
        .expect("kubectl apply -k config/default");
    println!("{out}");
    for want in [
        "customresourcedefinition.apiextensions.k8s.io/proxypolicies.switchyard.dev",
        "namespace/switchyard-system",
        "validatingadmissionpolicy.admissionregistration.k8s.io/switchyard-agent-own-nodeproxy",
        "deployment.apps/switchyard-operator",
        "daemonset.apps/switchyard-agent",
        "poddisruptionbudget.policy/switchyard-operator",
    ] {
        assert!(out.contains(want), "{want} missing:\n{out}");
    }
    cp.wait_crds_established().expect("established");
    let samples: PathBuf = root.join("config/samples");
    let out = cp
        .kubectl_ok(
            &["apply", "--dry-run=server", "-f", &samples.display().to_string()],
            None,
        )
        .expect("every sample passes server-side validation");
    println!("{out}");
    let count = std::fs::read_dir(&samples)
        .expect("samples")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "yaml"))
        .count();
    assert!(count >= 5, "{count} samples");
    // Applying twice changes nothing (the bases are declarative).
    let again = cp
        .kubectl_ok(&["apply", "-k", &default], None)
        .expect("apply again");
    assert!(!again.contains("created"), "{again}");
}
