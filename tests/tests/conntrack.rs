//! UDP flows follow the programmed state, per backend: a client that keeps sending from one
//! socket keeps its conntrack entry (and the DNAT it got, or none) for as long as it sends. So a
//! flow that started before the agent programmed the node (no DNAT: nobody answers) must be
//! deleted by the agent's first sync, and removing the endpoint a flow was DNATed to must delete
//! its entry; the client's next datagrams then reach a current endpoint. Without the agent's
//! conntrack cleanup neither happens (the removed endpoint, still running here, keeps answering).

use std::{
    fs::File,
    net::{SocketAddr, UdpSocket},
    os::fd::AsFd,
    time::{Duration, Instant},
};

use nix::sched::{CloneFlags, setns};
use serde_json::json;
use switchyard_e2e::{
    agent::TestEnv,
    objects::{Ep, apply_service, apply_slice},
    traffic::start_server,
};

const DNS: &str = "10.96.0.53";

/// A UDP socket bound to `port` inside `netns` (it stays in the namespace it was made in).
fn udp_socket_in(netns: &str, port: u16) -> UdpSocket {
    let path = format!("/run/netns/{netns}");
    std::thread::spawn(move || {
        let target = File::open(&path).expect("netns file");
        setns(target.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
        let socket = UdpSocket::bind(("0.0.0.0", port)).expect("bind udp");
        // Generous for a loaded machine (an answer takes well under a millisecond): a late answer
        // would otherwise be counted as none, and then read as the answer to the next datagram.
        socket
            .set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        socket
    })
    .join()
    .expect("netns thread")
}

/// Sends one datagram and returns the answering server's name, if any answered in time.
fn ask(socket: &UdpSocket, target: SocketAddr) -> Option<String> {
    socket.send_to(b"?", target).ok()?;
    let mut buf = [0u8; 256];
    let (n, _) = socket.recv_from(&mut buf).ok()?;
    String::from_utf8_lossy(&buf[..n])
        .split_whitespace()
        .next()
        .map(str::to_owned)
}

async fn scenario(mode: &str) {
    let mut env = TestEnv::start(2, 2)
        .await
        .expect("control plane and 2 namespace nodes");
    let admin = env.cp.admin_client().await.expect("admin");
    let nodes = env.cluster.nodes.clone();
    let servers: Vec<_> = nodes
        .iter()
        .map(|n| start_server(&n.pods[0], &[], &[5353]).expect("echo server"))
        .collect();
    apply_service(&admin, "dns", json!({"clusterIP": DNS, "ports": [{"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}]}), None)
        .await
        .expect("dns");
    let eps = [
        Ep::ready(nodes[0].pods[0].ip, &nodes[0].name),
        Ep::ready(nodes[1].pods[0].ip, &nodes[1].name),
    ];
    let ports = [("dns", 5353, "UDP")];
    apply_slice(&admin, "dns", &ports, &eps).await.expect("dns slice");
    // Before the agent: another component's conntrack rule makes the node track connections (as a
    // node always does), and the client's datagrams to the ClusterIP leave un-DNATed, unanswered.
    let node1 = &nodes[0].netns;
    switchyard_e2e::netns::Cluster::exec(
        node1,
        &["nft", "add table ip other; add chain ip other forward { type filter hook forward priority 0; }; add rule ip other forward ct state new counter"],
    )
    .expect("another component's conntrack rule");
    let socket = udp_socket_in(&nodes[0].pods[1].netns, 40053);
    let target: SocketAddr = format!("{DNS}:53").parse().expect("addr");
    for _ in 0..3 {
        assert_eq!(
            ask(&socket, target),
            None,
            "{mode}: nothing serves the ClusterIP yet"
        );
    }
    let entries = switchyard_e2e::netns::Cluster::exec(node1, &["cat", "/proc/net/nf_conntrack"])
        .expect("conntrack table");
    assert!(
        entries.contains(&format!("dst={DNS} sport=40053 dport=53")),
        "{mode}: the early flow is tracked:\n{entries}"
    );

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

    // The same socket keeps sending: the first sync deleted its un-DNATed entry, so it is answered,
    // and from then on it sticks to the endpoint that answered first.
    let started = Instant::now();
    let first = loop {
        if let Some(name) = ask(&socket, target) {
            break name;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let entries = switchyard_e2e::netns::Cluster::exec(node1, &["cat", "/proc/net/nf_conntrack"])
                .unwrap_or_default();
            let log = env
                .agents
                .iter()
                .find(|a| a.node == nodes[0].name)
                .map(|a| a.log_text())
                .unwrap_or_default();
            panic!("{mode}: the early flow was never answered; conntrack:\n{entries}\nagent log:\n{log}");
        }
    };
    println!(
        "{mode}: the flow that started before the agent was answered {:?} after the agent started",
        started.elapsed()
    );
    for _ in 0..10 {
        assert_eq!(
            ask(&socket, target).as_deref(),
            Some(first.as_str()),
            "{mode}: one socket, one endpoint"
        );
    }

    // Remove the endpoint that answered; keep sending from the same socket.
    let (gone, kept): (Vec<Ep>, Vec<Ep>) = eps.iter().cloned().partition(|e| first.starts_with(&e.node));
    assert_eq!(
        (gone.len(), kept.len()),
        (1, 1),
        "{mode}: {first} is one of the endpoints"
    );
    apply_slice(&admin, "dns", &ports, &kept).await.expect("shrink");
    let removed_at = Instant::now();
    let mut answers = Vec::new();
    let moved = loop {
        let answer = ask(&socket, target);
        if let Some(name) = answer.as_ref().filter(|n| **n != first) {
            break Some(name.clone());
        }
        answers.push(answer);
        // Generous for a loaded CI machine: the agent deletes the entry after its next sync.
        if removed_at.elapsed() > Duration::from_secs(60) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let moved = moved.unwrap_or_else(|| {
        let kept = answers
            .iter()
            .filter(|a| a.as_deref() == Some(first.as_str()))
            .count();
        panic!(
            "{mode}: the flow stayed on the removed endpoint {first}: {kept} of {} answers in 60 s",
            answers.len()
        )
    });
    println!(
        "{mode}: UDP flow moved from {first} to {moved} {:?} after the endpoint left",
        removed_at.elapsed()
    );
    // It stays there: the old entry is gone, not just bypassed once.
    for _ in 0..10 {
        assert_eq!(
            ask(&socket, target).as_deref(),
            Some(moved.as_str()),
            "{mode}: the flow went back"
        );
    }
    drop(servers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_udp_flows_leave_removed_endpoints() {
    scenario("nftables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_udp_flows_leave_removed_endpoints() {
    scenario("iptables").await;
}
