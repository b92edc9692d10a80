//! The real-node tier: three network-namespace nodes each running a real containerd and kubelet,
//! with kube-controller-manager and kube-scheduler. A DaemonSet and a Deployment run, the real
//! EndpointSlice controller publishes the Service's endpoints, pods carry a working ServiceAccount
//! token, pods reach pods on other nodes, hostNetwork pods share their node's namespace, and the
//! garbage collector removes a deleted DaemonSet's pods. Nothing is left behind afterwards.
//! (ClusterIPs are not reachable here: no proxy runs yet.)

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    authentication::v1::{TokenReview, TokenReviewSpec},
    core::v1::Pod,
    discovery::v1::EndpointSlice,
};
use kube::{
    Api,
    api::{ListParams, PostParams},
};
use switchyard_e2e::{
    cluster::{KubeletCluster, pod_ready},
    eventually, images, sweep,
};

const NS: &str = "smoke";

fn manifests() -> String {
    let image = images::BUSYBOX_IMAGE;
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata:
  name: {NS}
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: echo
  namespace: {NS}
spec:
  selector:
    matchLabels: {{app: echo}}
  template:
    metadata:
      labels: {{app: echo}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: echo
        image: {image}
        imagePullPolicy: Never
        command: ["sh", "-c", "hostname > /var/www/index.html && exec httpd -f -p 8080 -h /var/www"]
        ports:
        - {{name: http, containerPort: 8080}}
        readinessProbe:
          httpGet: {{path: /, port: 8080}}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata:
  name: echo
  namespace: {NS}
spec:
  selector: {{app: echo}}
  ipFamilyPolicy: PreferDualStack
  ports:
  - {{name: http, port: 80, targetPort: http}}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: hostnet
  namespace: {NS}
spec:
  replicas: 1
  selector:
    matchLabels: {{app: hostnet}}
  template:
    metadata:
      labels: {{app: hostnet}}
    spec:
      hostNetwork: true
      terminationGracePeriodSeconds: 1
      containers:
      - name: sleep
        image: {image}
        imagePullPolicy: Never
        command: ["sleep", "100000"]
"#
    )
}

fn pod_ips(pod: &Pod) -> Vec<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ips.as_ref())
        .map(|ips| ips.iter().map(|i| i.ip.clone()).collect())
        .unwrap_or_default()
}

fn node_of(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

fn exec(cluster: &KubeletCluster, pod: &str, command: &[&str]) -> String {
    cluster
        .exec(NS, pod, command, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("kubectl exec {pod} {command:?}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_nodes_run_pods_with_the_real_controllers() {
    let mut cluster = KubeletCluster::start(3)
        .await
        .expect("control plane and 3 kubelet nodes");
    let run_dir: PathBuf = cluster.dir().to_path_buf();
    let node_dirs: Vec<PathBuf> = cluster.nodes.iter().map(|n| n.dir.clone()).collect();
    let cgroups: Vec<String> = cluster.nodes.iter().map(|n| n.cgroup.clone()).collect();
    let node_ips: BTreeMap<String, (String, String)> = cluster
        .nodes
        .iter()
        .map(|n| (n.name.clone(), (n.ip.to_string(), n.ip6.to_string())))
        .collect();

    let t = Instant::now();
    let busybox = images::busybox_image(cluster.dir()).expect("busybox image");
    cluster
        .load_image(&busybox)
        .expect("load the busybox image into every node");
    eprintln!(
        "[kubelet nodes] busybox image packed and loaded: {:.1} s",
        t.elapsed().as_secs_f64()
    );

    // The namespace's default ServiceAccount comes from the controller-manager: wait for it, so the
    // ServiceAccount admission does not reject the controllers' first pods.
    cluster
        .kubectl_ok(&["create", "namespace", NS], None)
        .expect("create namespace");
    let admin = cluster.client().await.expect("admin client");
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(admin.clone(), NS);
    eventually(Duration::from_secs(60), "default ServiceAccount", || {
        let sas = sas.clone();
        async move { sas.get_opt("default").await.ok().flatten() }
    })
    .await
    .expect("the serviceaccount controller creates `default`");

    let t = Instant::now();
    cluster
        .kubectl_ok(&["apply", "-f", "-"], Some(&manifests()))
        .expect("apply the workloads");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let echo = cluster
        .wait_pods_ready(NS, "app=echo", 3, Duration::from_secs(120))
        .await
        .expect("the DaemonSet's pods run");
    let on: BTreeSet<String> = echo.iter().map(node_of).collect();
    assert_eq!(on.len(), 3, "one DaemonSet pod on every node: {on:?}");
    eprintln!(
        "[kubelet nodes] DaemonSet pods Running and Ready on 3 nodes: {:.1} s after apply",
        t.elapsed().as_secs_f64()
    );

    // Each pod has addresses from its node's pod CIDRs (IPv4 and IPv6), named by the kubelet.
    let mut by_node: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for pod in &echo {
        let node = node_of(pod);
        let ips = pod_ips(pod);
        let i: usize = node.trim_start_matches("node-").parse().expect("node index");
        assert!(
            ips.iter().any(|ip| ip.starts_with(&format!("10.244.{i}."))),
            "{node}'s pod has IPv4 from 10.244.{i}.0/24: {ips:?}"
        );
        assert!(
            ips.iter().any(|ip| ip.starts_with(&format!("fd00:10:244:{i}::"))),
            "{node}'s pod has IPv6 from fd00:10:244:{i}::/64: {ips:?}"
        );
        by_node.insert(node, (pod.metadata.name.clone().expect("pod name"), ips));
    }

    // The real EndpointSlice controller publishes every ready pod, with its node, per family.
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), NS);
    let expected: BTreeSet<String> = by_node.values().flat_map(|(_, ips)| ips.clone()).collect();
    eventually(Duration::from_secs(60), "EndpointSlices of echo", || {
        let slices = slices.clone();
        let expected = expected.clone();
        let by_node = by_node.clone();
        async move {
            let list = slices
                .list(&ListParams::default().labels("kubernetes.io/service-name=echo"))
                .await
                .ok()?;
            let mut seen = BTreeSet::new();
            for slice in &list.items {
                let labels = slice.metadata.labels.clone().unwrap_or_default();
                if labels
                    .get("endpointslice.kubernetes.io/managed-by")
                    .map(String::as_str)
                    != Some("endpointslice-controller.k8s.io")
                {
                    return None;
                }
                for ep in &slice.endpoints {
                    let ready = ep.conditions.as_ref().and_then(|c| c.ready) == Some(true);
                    let node = ep.node_name.clone().unwrap_or_default();
                    for addr in &ep.addresses {
                        let on_its_node = by_node.get(&node).is_some_and(|(_, ips)| ips.contains(addr));
                        if ready && on_its_node {
                            seen.insert(addr.clone());
                        }
                    }
                }
            }
            (seen == expected).then_some(())
        }
    })
    .await
    .expect("the EndpointSlice controller lists every pod of both families");

    // A ServiceAccount token is mounted, and the apiserver accepts it as the pod's identity.
    let (pod1, _) = &by_node["node-1"];
    let token = exec(
        &cluster,
        pod1,
        &["cat", "/var/run/secrets/kubernetes.io/serviceaccount/token"],
    );
    let namespace = exec(
        &cluster,
        pod1,
        &["cat", "/var/run/secrets/kubernetes.io/serviceaccount/namespace"],
    );
    assert_eq!(namespace.trim(), NS);
    let ca = exec(
        &cluster,
        pod1,
        &["cat", "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"],
    );
    assert_eq!(
        ca.trim(),
        cluster.cp.pki().ca_cert.trim(),
        "the mounted ca.crt is the cluster's CA (kube-root-ca.crt)"
    );
    let reviews: Api<TokenReview> = Api::all(admin.clone());
    let review = reviews
        .create(
            &PostParams::default(),
            &TokenReview {
                spec: TokenReviewSpec {
                    token: Some(token.trim().to_owned()),
                    audiences: None,
                },
                ..Default::default()
            },
        )
        .await
        .expect("TokenReview");
    let status = review.status.expect("TokenReview status");
    assert_eq!(status.authenticated, Some(true), "{status:?}");
    let user = status.user.expect("reviewed user");
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:smoke:default")
    );
    let extra = user.extra.unwrap_or_default();
    assert_eq!(
        extra.get("authentication.kubernetes.io/pod-name"),
        Some(&vec![pod1.clone()]),
        "the token is bound to its pod: {extra:?}"
    );
    assert_eq!(
        extra.get("authentication.kubernetes.io/node-name"),
        Some(&vec!["node-1".to_owned()]),
        "and names its node: {extra:?}"
    );

    // Pods reach pods on other nodes directly (both families), through the host-gw routes.
    let t = Instant::now();
    for i in 1..=3 {
        let (from, _) = &by_node[&format!("node-{i}")];
        let (to, to_ips) = &by_node[&format!("node-{}", i % 3 + 1)];
        for ip in to_ips {
            // busybox's nc (its static wget crashes on name-service lookups without libnss).
            let request = format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {ip} 8080");
            let response = exec(&cluster, from, &["sh", "-c", &request]);
            let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
            assert_eq!(
                body.trim(),
                to,
                "{from} → {ip}:8080 answers with {to}'s name:\n{response}"
            );
        }
    }
    eprintln!(
        "[kubelet nodes] 6 pod-to-pod requests across nodes (kubectl exec): {:.1} s",
        t.elapsed().as_secs_f64()
    );

    // Pods reach the apiserver at the fabric's address (what components get as their apiserver
    // until a proxy serves the `kubernetes` ClusterIP): its TLS port answers plain HTTP with 400.
    let (host, port) = cluster.apiserver_endpoint();
    let request = format!("printf 'GET /readyz HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {host} {port}");
    let response = exec(&cluster, &by_node["node-2"].0, &["sh", "-c", &request]);
    assert!(
        response.starts_with("HTTP/1.0 400") && response.contains("HTTPS server"),
        "a pod reaches the apiserver at {host}:{port}:\n{response}"
    );

    // The hostNetwork pod has its node's addresses and sees the node's interfaces.
    let hostnet = eventually(Duration::from_secs(60), "hostNetwork pod Running", || {
        let pods = pods.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels("app=hostnet"))
                .await
                .ok()?;
            list.items.into_iter().find(pod_ready)
        }
    })
    .await
    .expect("the Deployment's hostNetwork pod runs");
    let node = node_of(&hostnet);
    let (ip4, ip6) = &node_ips[&node];
    let ips = pod_ips(&hostnet);
    assert!(
        ips.contains(ip4) && ips.contains(ip6),
        "hostNetwork pod IPs {ips:?} are {node}'s"
    );
    let addrs = exec(
        &cluster,
        hostnet.metadata.name.as_deref().expect("name"),
        &["ip", "addr", "show", "eth0"],
    );
    assert!(
        addrs.contains(&format!("{ip4}/24")),
        "the hostNetwork pod sees {node}'s eth0:\n{addrs}"
    );

    // The garbage collector removes the pods of a deleted DaemonSet.
    cluster
        .kubectl_ok(
            &[
                "delete",
                "daemonset",
                "-n",
                NS,
                "echo",
                "--cascade=background",
                "--wait=false",
            ],
            None,
        )
        .expect("delete the DaemonSet");
    eventually(Duration::from_secs(60), "echo pods garbage-collected", || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&ListParams::default().labels("app=echo")).await.ok()?;
            list.items.is_empty().then_some(())
        }
    })
    .await
    .expect("the garbage collector deletes the DaemonSet's pods");

    // Teardown leaves nothing: no processes naming the run, no cgroups, no mounts, no directories.
    let t = Instant::now();
    drop(cluster);
    eprintln!("[kubelet nodes] teardown: {:.1} s", t.elapsed().as_secs_f64());
    let marker = format!("{}/", run_dir.display());
    let own = std::process::id();
    let left: Vec<u32> = sweep::all_pids()
        .into_iter()
        .filter(|p| *p != own)
        .filter(|p| {
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default())
                .contains(&marker)
        })
        .collect();
    assert!(left.is_empty(), "processes of the run are left: {left:?}");
    for mount in sweep::cgroup_mounts() {
        for cg in &cgroups {
            assert!(
                !mount.join(cg).exists(),
                "cgroup {} is left",
                mount.join(cg).display()
            );
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    assert!(
        !mounts.contains(&run_dir.display().to_string()),
        "mounts under {} are left",
        run_dir.display()
    );
    assert!(!run_dir.exists(), "{} is left", run_dir.display());
    for dir in node_dirs {
        assert!(!dir.exists(), "{} is left", dir.display());
    }
}

/// The project's images (`scripts/build-images.sh`) load into every node and the testbox runs:
/// its `swy-echo` answers a pod on another node. Ignored by default: it needs the archives, which
/// `scripts/test.sh` does not build yet (`cargo test --test kubelet_nodes -- --ignored`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the archives of scripts/build-images.sh"]
async fn project_images_load_and_run_on_kubelet_nodes() {
    let archives: Vec<PathBuf> = ["agent", "operator", "testbox"]
        .into_iter()
        .map(|name| images::project_image(name).expect("image archive"))
        .collect();
    let mut cluster = KubeletCluster::start(2)
        .await
        .expect("control plane and 2 kubelet nodes");
    let t = Instant::now();
    for archive in &archives {
        cluster.load_image(archive).expect("load into every node");
    }
    eprintln!(
        "[kubelet nodes] project images loaded into 2 nodes: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    for node in &cluster.nodes {
        let listed = node.crictl(&["images", "-o", "json"]).expect("crictl images");
        for archive in &archives {
            let reference = images::archive_reference(archive).expect("reference");
            assert!(listed.contains(&reference), "{} lists {reference}", node.name);
        }
    }
    let testbox = images::archive_reference(&archives[2]).expect("testbox reference");
    let manifest = format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: server, namespace: default}}
spec:
  nodeName: node-1
  terminationGracePeriodSeconds: 1
  containers:
  - name: echo
    image: {testbox}
    imagePullPolicy: Never
    command: ["swy-echo", "serve", "--name", "server", "--tcp", "8080"]
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: default}}
spec:
  nodeName: node-2
  terminationGracePeriodSeconds: 1
  containers:
  - name: sleep
    image: {testbox}
    imagePullPolicy: Never
    command: ["sleep", "100000"]
"#
    );
    eventually(Duration::from_secs(60), "default ServiceAccount", || {
        let cluster = &cluster;
        async move {
            cluster
                .kubectl(&["get", "serviceaccount", "default"], None)
                .ok()
                .filter(|(ok, _, _)| *ok)
        }
    })
    .await
    .expect("default ServiceAccount");
    cluster
        .kubectl_ok(&["apply", "-f", "-"], Some(&manifest))
        .expect("apply pods");
    let admin = cluster.client().await.expect("client");
    let pods: Api<Pod> = Api::namespaced(admin, "default");
    let server = eventually(Duration::from_secs(120), "testbox pods running", || {
        let pods = pods.clone();
        async move {
            let server = pods.get("server").await.ok().filter(pod_ready)?;
            pods.get("client").await.ok().filter(pod_ready)?;
            Some(server)
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.diagnostics()));
    cluster.check_running().expect("components running");
    for ip in pod_ips(&server) {
        let target = if ip.contains(':') {
            format!("[{ip}]:8080")
        } else {
            format!("{ip}:8080")
        };
        let out = cluster
            .exec(
                "default",
                "client",
                &[
                    "swy-echo", "client", "--target", &target, "--proto", "tcp", "--count", "1",
                ],
                Duration::from_secs(60),
            )
            .expect("swy-echo client");
        assert!(out.starts_with("ok server "), "client → {target}: {out}");
    }
}

/// The chart installs on kubelet nodes: the agent DaemonSet runs on every node (hostNetwork, in
/// the node's namespace) and registers its NodeProxy, the operator Deployment runs; both reach the
/// apiserver at the fabric address (`apiServer.host`), as on a cluster without kube-proxy.
/// Ignored by default: it needs the archives of `scripts/build-images.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the archives of scripts/build-images.sh"]
async fn chart_installs_on_kubelet_nodes() {
    let archives: Vec<PathBuf> = ["agent", "operator"]
        .into_iter()
        .map(|name| images::project_image(name).expect("image archive"))
        .collect();
    let mut cluster = KubeletCluster::start(3)
        .await
        .expect("control plane and 3 kubelet nodes");
    for archive in &archives {
        cluster.load_image(archive).expect("load into every node");
    }
    let (host, port) = cluster.apiserver_endpoint();
    let chart = switchyard_e2e::binaries::workspace_root().join("helm/switchyard");
    let t = Instant::now();
    let (ok, out, err) = cluster
        .helm(&[
            "install",
            "switchyard",
            &chart.display().to_string(),
            "--namespace",
            "switchyard-system",
            "--create-namespace",
            "--set",
            &format!("apiServer.host={host}"),
            "--set",
            &format!("apiServer.port={port}"),
            "--set",
            "agent.clusterCIDR=10.244.0.0/16",
        ])
        .expect("helm");
    assert!(ok, "helm install: {out}\n{err}");
    let agents = cluster
        .wait_pods_ready(
            "switchyard-system",
            "app.kubernetes.io/component=agent",
            3,
            Duration::from_secs(180),
        )
        .await
        .expect("the agent DaemonSet runs on every node");
    eprintln!(
        "[kubelet nodes] chart installed, 3 agents Ready: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let on: BTreeSet<String> = agents.iter().map(node_of).collect();
    assert_eq!(on.len(), 3, "one agent per node: {on:?}");
    cluster
        .wait_pods_ready(
            "switchyard-system",
            "app.kubernetes.io/component=operator",
            1,
            Duration::from_secs(180),
        )
        .await
        .expect("the operator runs");
    eprintln!(
        "[kubelet nodes] operator Ready: {:.1} s after install",
        t.elapsed().as_secs_f64()
    );
    let admin = cluster.client().await.expect("client");
    let proxies: Api<switchyard_crds::v1alpha1::NodeProxy> = Api::all(admin);
    eventually(Duration::from_secs(60), "a NodeProxy per node", || {
        let proxies = proxies.clone();
        async move {
            let list = proxies.list(&ListParams::default()).await.ok()?;
            let names: BTreeSet<String> = list
                .items
                .iter()
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            (names.len() == 3).then_some(names)
        }
    })
    .await
    .expect("every agent registers its NodeProxy");
}
