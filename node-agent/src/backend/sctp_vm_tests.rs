//! SCTP through the nftables and the iptables (legacy) backends with real associations. The host
//! kernel has no SCTP, so these tests are ignored there and run by `scripts/ipvs-vm.sh` inside its
//! Debian kernel VM (`SWITCHYARD_IPVS_VM=1`), after the IPVS tests, in the same process.
//!
//! Topology, in namespaces of their own so the IPVS tests' `client`/`rs*` ones are untouched: the
//! VM's root namespace is the node (`10.0.2.1`, forwarding on); `sctp-client` (`10.0.2.2`) opens
//! one-to-one SCTP sockets (`SOCK_STREAM`, `IPPROTO_SCTP`, through `socket2`: the crate forbids
//! unsafe code); `sctp-ep1` and `sctp-ep2` each run an SCTP server that answers every message with
//! its namespace's name. Per backend: a ClusterIP and a NodePort service with both servers as
//! endpoints must spread new associations over both; a service without endpoints must refuse a
//! default SCTP socket at once (the node answers INIT with ICMP protocol unreachable, which SCTP
//! takes as an ABORT; port unreachable would only be a soft error); after cleanup none of the
//! backend's objects may remain.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use socket2::{Domain, SockAddr, Socket, Type};

use crate::backend::iptables::IptablesBackend;
use crate::backend::nftables::NftablesBackend;
use crate::backend::vm_support::{enter, in_netns, ipcmd, require_vm, sh, wired_netns};
use crate::backend::{Backend, Settings};
use crate::model::fixtures::{self, add};
use crate::model::{Changes, NodeInfo, Protocol, ServicePort, Snapshot};
use crate::sys::iptables::Variant;

const IPPROTO_SCTP: i32 = 132;
const CLIENT: &str = "sctp-client";
/// The node's address on the client's link: the NodePort destination.
const NODE_IP: &str = "10.0.2.1";
/// Server namespaces and their addresses (inside the cluster CIDR, so not masqueraded to).
const SERVERS: [(&str, &str); 2] = [("sctp-ep1", "10.244.21.10"), ("sctp-ep2", "10.244.22.10")];
/// The servers' port (the endpoints' target port; the service port differs, so DNAT rewrites it).
const TARGET_PORT: u16 = 9132;
const SERVICE_PORT: u16 = 7000;
/// A ClusterIP-only service, and a NodePort one, both on the two servers.
const CLUSTER_IP: &str = "10.96.1.10";
const NP_CLUSTER_IP: &str = "10.96.1.11";
const NODE_PORT: u16 = 30132;
/// A ClusterIP + NodePort service without endpoints.
const NONE_IP: &str = "10.96.1.20";
const NONE_NODE_PORT: u16 = 30133;
/// New associations per destination: as many as the host-side spread check in
/// `tests/tests/ipvs_vm.rs` needs (`switchyard_e2e::stats::SPREAD_2`; false failure <= 1e-6, catches
/// a 2:1 skew); about 5 ms each in the VM.
const ASSOCIATIONS: usize = 500;
const TIMEOUT: Duration = Duration::from_secs(3);
/// The wait for a connect to a service without endpoints.
const REFUSAL_LIMIT: Duration = Duration::from_secs(1);

fn sctp_socket() -> std::io::Result<Socket> {
    Socket::new(
        Domain::IPV4,
        Type::STREAM,
        Some(socket2::Protocol::from(IPPROTO_SCTP)),
    )
}

/// Builds the namespaces and starts the SCTP servers once per process.
fn topology() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        require_vm();
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").unwrap();
        ipcmd("link set lo up");
        wired_netns(CLIENT, "s-", "10.0.2.2", NODE_IP);
        // INIT is retransmitted after 200 ms instead of 3 s (see the no-endpoint check).
        in_netns(CLIENT, || {
            std::fs::write("/proc/sys/net/sctp/rto_min", "100").unwrap();
            std::fs::write("/proc/sys/net/sctp/rto_initial", "200").unwrap();
        });
        // Service addresses need a route for packets to them to reach the forward hook (where a
        // service without endpoints is rejected), as a node's default route gives them; the VM
        // has no NIC, so a dummy link stands in for it.
        ipcmd("link add sctp-svc0 type dummy");
        ipcmd("link set sctp-svc0 up");
        ipcmd("route add 10.96.1.0/24 dev sctp-svc0");
        for (i, (ns, addr)) in SERVERS.iter().enumerate() {
            wired_netns(ns, "s-", addr, &format!("10.244.{}.1", 21 + i));
            start_server(ns);
        }
    });
}

/// An SCTP server in `ns` answering every message of every association with `ns`.
fn start_server(ns: &'static str) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        enter(ns);
        let listen = || -> std::io::Result<Socket> {
            let s = sctp_socket()?;
            s.set_reuse_address(true)?;
            s.bind(&SockAddr::from(SocketAddr::from(([0, 0, 0, 0], TARGET_PORT))))?;
            s.listen(64)?;
            Ok(s)
        };
        let listener = match listen() {
            Ok(l) => l,
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                return;
            }
        };
        let _ = tx.send(Ok(()));
        while let Ok((conn, _)) = listener.accept() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while let Ok(n) = (&conn).read(&mut buf) {
                    if n == 0 || (&conn).write_all(ns.as_bytes()).is_err() {
                        break;
                    }
                }
            });
        }
    });
    let started = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    started.unwrap_or_else(|e| panic!("SCTP server in {ns}: {e}"));
}

/// Opens one association from the client namespace (connect within `limit`), asks who answers,
/// and closes it.
fn ask(dst: &str, port: u16, limit: Duration) -> std::io::Result<String> {
    let to = SockAddr::from(SocketAddr::new(dst.parse().unwrap(), port));
    in_netns(CLIENT, move || {
        let s = sctp_socket()?;
        s.connect_timeout(&to, limit)?;
        s.set_read_timeout(Some(TIMEOUT))?;
        (&s).write_all(b"who")?;
        let mut buf = [0u8; 64];
        let n = (&s).read(&mut buf)?;
        if n == 0 {
            return Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "association closed",
            ));
        }
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    })
}

/// Answers per server over `ASSOCIATIONS` new associations to `dst:port`.
fn spread(dst: &str, port: u16) -> BTreeMap<String, usize> {
    let mut counts: BTreeMap<String, usize> = SERVERS.iter().map(|(ns, _)| (ns.to_string(), 0)).collect();
    for i in 0..ASSOCIATIONS {
        let who = ask(dst, port, TIMEOUT).unwrap_or_else(|e| panic!("association {i} to {dst}:{port}: {e}"));
        *counts.entry(who).or_default() += 1;
    }
    counts
}

fn counts_text(counts: &BTreeMap<String, usize>) -> String {
    counts
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What one association attempt got, and after how long.
fn attempt(dst: &str, port: u16) -> (Result<String, Refusal>, Duration) {
    let t = Instant::now();
    let r = ask(dst, port, REFUSAL_LIMIT).map_err(|e| match e.raw_os_error() {
        Some(code) => Refusal::Os(nix::errno::Errno::from_raw(code)),
        None => Refusal::Other(e.kind()),
    });
    (r, t.elapsed())
}

/// How an association attempt failed: the errno connect() returned, or another failure.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refusal {
    Os(nix::errno::Errno),
    Other(ErrorKind),
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

fn settings() -> Settings {
    Settings {
        node: NodeInfo {
            name: "vm".into(),
            addresses: vec![NODE_IP.parse().unwrap()],
            zone: None,
        },
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..Settings::default()
    }
}

fn sctp_port(name: &str, cluster_ip: &str, node_port: Option<u16>) -> ServicePort {
    let name = fixtures::port_name("sctp", name, "assoc", Protocol::Sctp);
    ServicePort {
        node_port,
        ..fixtures::cluster_ip(
            name,
            cluster_ip.parse::<std::net::IpAddr>().unwrap(),
            SERVICE_PORT,
        )
    }
}

fn snapshot() -> Snapshot {
    let mut s = Snapshot::default();
    let servers = || {
        SERVERS
            .iter()
            .map(|(_, a)| fixtures::ready(a.parse::<std::net::IpAddr>().unwrap(), TARGET_PORT, "other"))
            .collect()
    };
    add(&mut s, sctp_port("cip", CLUSTER_IP, None), servers());
    add(&mut s, sctp_port("np", NP_CLUSTER_IP, Some(NODE_PORT)), servers());
    add(&mut s, sctp_port("none", NONE_IP, Some(NONE_NODE_PORT)), vec![]);
    s
}

/// A counter of `/proc/thread-self/net/<file>` (`Icmp: ... InDestUnreachs ...` style: a header
/// line and a value line per prefix) in the calling thread's network namespace.
fn counter(file: &str, prefix: &str, name: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/thread-self/net/{file}")).unwrap();
    let mut lines = text.lines().filter(|l| l.starts_with(prefix));
    let (names, values) = (lines.next().unwrap_or_default(), lines.next().unwrap_or_default());
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == name)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("{file}: no {prefix} {name}"))
}

/// ICMP destination unreachables the client received, and ICMP errors it dropped because the
/// socket was locked by its owner (`LockDroppedIcmps`).
fn client_icmp() -> (u64, u64) {
    in_netns(CLIENT, || {
        (
            counter("snmp", "Icmp:", "InDestUnreachs"),
            counter("netstat", "TcpExt:", "LockDroppedIcmps"),
        )
    })
}

/// A sysctl of the node (the VM's root namespace), restored when dropped.
struct Sysctl {
    path: &'static str,
    old: String,
}

impl Sysctl {
    fn set(path: &'static str, value: &str) -> Self {
        let old = std::fs::read_to_string(path).unwrap();
        std::fs::write(path, value).unwrap();
        Self { path, old }
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path, self.old.trim());
    }
}

/// Programs the snapshot with `b`, sends real SCTP through it, cleans up; `leftovers` lists the
/// backend's objects still in the kernel.
fn exercise(backend: &str, b: &mut dyn Backend, leftovers: impl Fn() -> Vec<String>) {
    topology();
    b.cleanup().unwrap();
    assert_eq!(leftovers(), Vec::<String>::new(), "before the test");
    let stats = b
        .sync(
            &crate::model::DualSnapshot::from(snapshot()),
            &Changes::default(),
            true,
        )
        .unwrap_or_else(|e| panic!("{backend} sync: {e}"));
    assert_eq!(
        b.verify().unwrap(),
        Vec::<String>::new(),
        "no drift after the sync"
    );

    // (a), (b): new associations spread over both servers, through the ClusterIP and the NodePort.
    let t = Instant::now();
    let cluster = spread(CLUSTER_IP, SERVICE_PORT);
    let node_port = spread(NODE_IP, NODE_PORT);
    let took = t.elapsed();
    println!(
        "VMTEST sctp {backend} spread: ClusterIP {CLUSTER_IP}:{SERVICE_PORT} {ASSOCIATIONS} associations -> {}; NodePort {NODE_IP}:{NODE_PORT} {ASSOCIATIONS} associations -> {} ({} per association; {} rules)",
        counts_text(&cluster),
        counts_text(&node_port),
        ms(took / (2 * ASSOCIATIONS as u32)),
        stats.rules_total,
    );

    // (c): no endpoints: refused at once. The node answers every INIT with ICMP protocol
    // unreachable, which SCTP handles as an ABORT of the starting association (RFC 4960 appendix
    // C; one arriving while connect() holds the socket is retried 50 ms later by the kernel):
    // connect() fails with ENOPROTOOPT. The
    // node's ICMP rate limit (a burst of 6, then one a second per host) is off meanwhile, so that
    // every INIT gets its answer.
    let ratelimit = Sysctl::set("/proc/sys/net/ipv4/icmp_ratelimit", "0");
    let (icmp0, _) = client_icmp();
    let refused_ip = attempt(NONE_IP, SERVICE_PORT);
    let refused_np = attempt(NODE_IP, NONE_NODE_PORT);
    let (icmp1, _) = client_icmp();
    drop(ratelimit);
    println!(
        "VMTEST sctp {backend} no endpoints: ClusterIP {:?} in {}, NodePort {:?} in {} ({} ICMP received)",
        refused_ip.0,
        ms(refused_ip.1),
        refused_np.0,
        ms(refused_np.1),
        icmp1 - icmp0,
    );

    // (d): cleanup leaves nothing of ours.
    b.cleanup().unwrap();
    let left = leftovers();
    println!(
        "VMTEST sctp {backend} cleanup: {} switchyard objects left{}",
        left.len(),
        if left.is_empty() {
            String::new()
        } else {
            format!(": {left:?}")
        }
    );

    for (ns, _) in SERVERS {
        assert!(cluster[ns] > 0, "ClusterIP spread: {cluster:?}");
        assert!(node_port[ns] > 0, "NodePort spread: {node_port:?}");
    }
    assert_eq!(cluster.values().sum::<usize>(), ASSOCIATIONS, "{cluster:?}");
    assert_eq!(node_port.values().sum::<usize>(), ASSOCIATIONS, "{node_port:?}");
    let refused = Err(Refusal::Os(nix::errno::Errno::ENOPROTOOPT));
    assert_eq!(
        (refused_ip.0, refused_np.0),
        (refused.clone(), refused),
        "default sockets are refused"
    );
    assert!(
        icmp1 - icmp0 >= 2,
        "the node rejected each INIT: {} ICMP",
        icmp1 - icmp0
    );
    assert!(left.is_empty(), "{left:?}");
}

#[test]
#[ignore = "needs the VM's SCTP kernel: scripts/ipvs-vm.sh"]
fn vm_sctp_nftables() {
    let mut b = NftablesBackend::new(settings());
    exercise("nftables", &mut b, || {
        crate::model::IpFamily::ALL
            .into_iter()
            .filter(|f| crate::sys::nft::table_exists(*f).unwrap())
            .map(|f| format!("nft table {} switchyard", super::nftables::ir::family_name(f)))
            .collect()
    });
}

#[test]
#[ignore = "needs the VM's SCTP kernel: scripts/ipvs-vm.sh"]
fn vm_sctp_iptables_legacy() {
    let mut b = IptablesBackend::new(Variant::Legacy, settings());
    exercise("iptables", &mut b, || {
        [sh(&["iptables-legacy-save"]), sh(&["ip6tables-legacy-save"])]
            .concat()
            .lines()
            .filter(|l| l.contains("SWY-") || l.contains("switchyard"))
            .map(str::to_owned)
            .collect()
    });
}
