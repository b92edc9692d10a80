//! Takeover under load from the real kube-proxy in IPVS mode, in the IPVS VM (this host kernel has
//! no IPVS): `scripts/ipvs-vm-kube-proxy.sh` boots the Debian kernel under qemu TCG, and its /init
//! (`scripts/ipvs-vm-kube-proxy.init`) follows the documented path (helm/switchyard/README.md,
//! "Taking over from kube-proxy") on the VM's node: kube-proxy v1.37 serves in IPVS mode
//! (`kube-ipvs0`, IPVS virtual servers, `KUBE-*` ipsets and iptables chains); a client namespace
//! keeps connecting to a ClusterIP and a NodePort, one TCP connection every 20 ms each; kube-proxy
//! is stopped and the agent starts with `--takeover-kube-proxy` in IPVS mode.
//!
//! Asserted here from the VM's report: every attempt of both loads answered (attempts and failures
//! printed), no `kube-ipvs0`, no IPVS service of kube-proxy (every service left is on an address of
//! our `swy-ipvs0` or a NodePort on a node address), no `KUBE-*` ipset and no `KUBE-*` chain in any
//! iptables variant the VM has (legacy, both families), while our `swy-ipvs0`, `SWY-*` ipsets,
//! virtual servers and `SWY-*` chains serve.
//!
//! The apiserver is this test's (on the host loopback); the VM reaches it only through qemu's
//! restricted user networking with one guest forward (see the script). The agent runs with a token
//! bound to its Pod object, as in the namespace tests; kube-proxy with the admin certificate.

use std::process::Command;

use serde_json::json;
use switchyard_e2e::{
    agent::{agent_token, install_switchyard},
    binaries,
    controlplane::ControlPlane,
    objects::{Ep, apply_service, apply_slice},
};

const NODE: &str = "vm-node";
/// The guest's address on its NIC (the Node's InternalIP).
const NODE_IP: &str = "10.250.0.15";
/// Where the guest reaches the host apiserver (qemu's guest forward; in the serving certificate).
const APISERVER_IN_GUEST: &str = "10.250.0.1";
const VIP: &str = "10.96.0.120";
const NODE_PORT: u16 = 30120;
/// The endpoints: server namespaces inside the VM.
const ENDPOINTS: [&str; 2] = ["10.0.0.2", "10.0.3.2"];

/// `attempts, failed` of `VMTEST takeover load <kind>: N attempts, F failed (...)`.
fn load(stdout: &str, kind: &str) -> Option<(usize, usize)> {
    let prefix = format!("VMTEST takeover load {kind}: ");
    let rest = stdout.lines().find_map(|l| l.strip_prefix(prefix.as_str()))?;
    let mut words = rest.split_whitespace();
    let attempts = words.next()?.parse().ok()?;
    let failed = words.nth(1)?.parse().ok()?;
    Some((attempts, failed))
}

/// The numbers of `VMTEST <what>: <n> ..., <n> ..., ...` (the first number of each comma part).
fn counts(stdout: &str, what: &str) -> Option<Vec<usize>> {
    let prefix = format!("VMTEST {what}: ");
    let rest = stdout.lines().find_map(|l| l.strip_prefix(prefix.as_str()))?;
    rest.split(", ")
        .map(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
        .collect()
}

/// The kubeconfig the guest's components use: the apiserver at its guest address, files in /cfg.
fn guest_kubeconfig(user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://{APISERVER_IN_GUEST}:{{PORT}}\n    certificate-authority: /cfg/ca.crt\nusers:\n- name: u\n  user:\n{user}contexts:\n- name: c\n  context:\n    cluster: test\n    user: u\ncurrent-context: c\n"
    )
}

/// Writes /cfg of the guest: certificates, both kubeconfigs, kube-proxy's configuration.
fn write_guest_config(cp: &ControlPlane, token: &str) -> std::path::PathBuf {
    let dir = cp.dir().join("vm-cfg");
    std::fs::create_dir_all(&dir).expect("vm cfg dir");
    for file in ["ca.crt", "admin.crt", "admin.key"] {
        std::fs::copy(cp.dir().join(file), dir.join(file)).expect("copy certificate");
    }
    let port = cp.port.to_string();
    let admin = "    client-certificate: /cfg/admin.crt\n    client-key: /cfg/admin.key\n";
    std::fs::write(
        dir.join("kube-proxy.kubeconfig"),
        guest_kubeconfig(admin).replace("{PORT}", &port),
    )
    .expect("kube-proxy kubeconfig");
    std::fs::write(
        dir.join("agent.kubeconfig"),
        guest_kubeconfig(&format!("    token: {token}\n")).replace("{PORT}", &port),
    )
    .expect("agent kubeconfig");
    // As the namespace tests' kube-proxy (tests/src/kube_proxy.rs), in IPVS mode; the conntrack
    // sysctls are left alone.
    let config = format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ipvs\n\
         clusterCIDR: 10.244.0.0/16\nhostnameOverride: {NODE}\n\
         metricsBindAddress: 127.0.0.1:10249\nhealthzBindAddress: 127.0.0.1:10256\n\
         clientConnection:\n  kubeconfig: /cfg/kube-proxy.kubeconfig\n\
         conntrack:\n  maxPerCore: 0\n  min: 0\n  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n"
    );
    std::fs::write(dir.join("kube-proxy.yaml"), config).expect("kube-proxy config");
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_from_kube_proxy_ipvs_under_load_in_the_vm() {
    let cp = ControlPlane::start().await.expect("control plane");
    install_switchyard(&cp).expect("install switchyard");
    let client = cp.admin_client().await.expect("client");
    cp.apply_json(&json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
        "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]},
    }))
    .expect("node");
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    nodes
        .patch_status(
            NODE,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&json!({"status": {"addresses": [
                {"type": "InternalIP", "address": NODE_IP},
                {"type": "Hostname", "address": NODE},
            ]}})),
        )
        .await
        .expect("node addresses");
    apply_service(
        &client,
        "web",
        json!({"type": "NodePort", "clusterIP": VIP, "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": NODE_PORT, "protocol": "TCP"}]}),
        None,
    )
    .await
    .expect("service");
    let eps: Vec<Ep> = ENDPOINTS.iter().map(|ip| Ep::ready(ip, NODE)).collect();
    apply_slice(&client, "web", &[("http", 8080, "TCP")], &eps)
        .await
        .expect("slice");
    let token = agent_token(&cp, NODE).await.expect("agent token");
    let cfg = write_guest_config(&cp, &token);
    let kube_proxy = binaries::control_plane_bin()
        .expect("binaries")
        .join("kube-proxy");

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/ipvs-vm-kube-proxy.sh");
    let port = cp.port.to_string();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash")
            .arg(script)
            .env("SWITCHYARD_VM_APISERVER_PORT", port)
            .env("SWITCHYARD_VM_CFG", cfg)
            .env("SWITCHYARD_VM_KUBE_PROXY", kube_proxy)
            .output()
    })
    .await
    .expect("script task")
    .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    let verdict = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("IPVS-VM-KP"))
        .unwrap_or("IPVS-VM-KP: no verdict line from scripts/ipvs-vm-kube-proxy.sh")
        .to_owned();
    assert!(
        out.status.success(),
        "kube-proxy IPVS takeover in the VM failed (exit {:?}): {verdict}",
        out.status.code()
    );

    // kube-proxy served with its objects, and the agent took over.
    let theirs = counts(&stdout, "kube-proxy objects");
    assert!(
        matches!(theirs.as_deref(), Some([addrs, services, sets, chains]) if *addrs >= 2 && *services >= 2 && *sets > 0 && *chains > 0),
        "kube-proxy's objects before the takeover (kube-ipvs0 addresses, IPVS services, ipsets, chains): {theirs:?}"
    );
    // The loads went through kube-proxy before it stopped.
    let before: Vec<usize> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("VMTEST load through kube-proxy: "))
        .map(|rest| rest.split_whitespace().filter_map(|w| w.parse().ok()).collect())
        .unwrap_or_default();
    assert!(
        matches!(before.as_slice(), [cip, np] if *cip >= 20 && *np >= 20),
        "attempts through kube-proxy before it stopped (ClusterIP, NodePort): {before:?}"
    );
    assert!(stdout.contains("VMTEST taken over in "), "{verdict}");
    for kind in ["clusterip", "nodeport"] {
        let l = load(&stdout, kind);
        println!("IPVS takeover load {kind}: (attempts, failed) = {l:?}");
        assert!(
            matches!(l, Some((attempts, 0)) if attempts > 100),
            "{kind} load during the takeover: (attempts, failed) = {l:?}"
        );
    }
    assert!(
        stdout.contains("VMTEST after takeover: ClusterIP 20/20 answered, NodePort 20/20 answered"),
        "served by the agent after the takeover"
    );
    assert!(
        stdout.contains("VMTEST leftovers of kube-proxy: none;"),
        "kube-proxy's leftovers: {:?}",
        stdout.lines().find(|l| l.starts_with("VMTEST leftovers"))
    );
    let ours = counts(&stdout, "ours");
    assert!(
        matches!(ours.as_deref(), Some([addrs, sets, services, chains]) if *addrs >= 2 && *sets > 0 && *services >= 2 && *chains > 0),
        "ours after the takeover (swy-ipvs0 addresses, SWY-* ipsets, IPVS services, SWY-* chains): {ours:?}"
    );
}

/// The report parsers on lines as the VM prints them.
#[test]
fn report_lines_parse() {
    let out = "VMTEST takeover load clusterip: 812 attempts, 0 failed (ep1 400, ep2 412); failures: \n\
        VMTEST takeover load nodeport: 810 attempts, 3 failed (ep1 1, ep2 2); failures:  3 timeout\n\
        VMTEST ours: swy-ipvs0 2 addresses, 9 SWY-* ipsets, 6 IPVS services, 12 SWY-* chains\n";
    assert_eq!(load(out, "clusterip"), Some((812, 0)));
    assert_eq!(load(out, "nodeport"), Some((810, 3)));
    assert_eq!(load(out, "loadbalancer"), None);
    assert_eq!(counts(out, "ours"), Some(vec![2, 9, 6, 12]));
    assert_eq!(counts(out, "kube-proxy objects"), None);
}
