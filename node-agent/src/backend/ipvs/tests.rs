//! Tests of the IPVS backend.
//!
//! - Pure (host): the render of a scenario covering every service shape is compared with
//!   `testdata/scenario.txt`, and the VM scenario's IPVS table with `testdata/vm.ipvsadm`
//!   (`SWITCHYARD_UPDATE_GOLDEN=1` rewrites both), plus table tests of render details.
//! - Kernel (`vm` module, ignored on the host): run by `scripts/ipvs-vm.sh` inside a Debian
//!   kernel with `ip_vs`, with real TCP and UDP between network namespaces (client, director =
//!   the VM's root namespace, real servers).
//! - Conformance: the generic backend suite on fake adapters (`conformance_fake`, no root) and on
//!   the VM's kernel (`vm::conformance`, a network namespace per case), the fake checked against
//!   the kernel (same state after full and partial syncs, same typed IPVS refusals), and graceful
//!   termination on the fake IPVS table.
//! - Settings (`settings_fake`, `vm::settings`): every `proxy.ipvs` field taken in place reaches
//!   the fake table and the kernel's (schedulers, timeouts, excludeCIDRs).

use std::net::Ipv4Addr;

use super::render::{self, normalize_ipvsadm, render};
use super::*;
use crate::model::{Endpoint, NodeInfo, Protocol, ServiceName, ServicePort, ServicePortName};

const NODE: &str = "node-a";
const REMOTE: &str = "node-b";

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

fn spn(svc: &str, port_name: &str, protocol: Protocol) -> ServicePortName {
    fixtures::port_name("ns", svc, port_name, protocol)
}

fn port(svc: &str, protocol: Protocol, cluster_ip: &str, port: u16) -> ServicePort {
    fixtures::cluster_ip(spn(svc, "p", protocol), ip(cluster_ip), port)
}

fn ep(addr: &str, port: u16, node: &str) -> Endpoint {
    fixtures::ready(ip(addr), port, node)
}

use crate::model::fixtures::{self, add};

fn settings() -> Settings {
    Settings {
        node: NodeInfo {
            name: NODE.into(),
            addresses: vec![ip("192.168.0.10").into()],
            zone: None,
        },
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..Settings::default()
    }
}

/// Every service shape the backend handles.
fn scenario() -> Snapshot {
    let mut s = Snapshot::default();
    let (tcp, udp, sctp) = (Protocol::Tcp, Protocol::Udp, Protocol::Sctp);
    add(
        &mut s,
        port("one", tcp, "10.96.0.11", 80),
        vec![ep("10.244.1.11", 8080, REMOTE)],
    );
    add(
        &mut s,
        port("three", tcp, "10.96.0.13", 80),
        vec![
            ep("10.244.0.13", 8080, NODE),
            ep("10.244.1.13", 8080, REMOTE),
            ep("10.244.2.13", 8080, REMOTE),
        ],
    );
    add(
        &mut s,
        port("dns", udp, "10.96.0.10", 53),
        vec![ep("10.244.1.53", 53, REMOTE), ep("10.244.2.53", 53, REMOTE)],
    );
    add(
        &mut s,
        port("assoc", sctp, "10.96.0.14", 9999),
        vec![ep("10.244.1.14", 9999, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            node_port: Some(30020),
            ..port("np", tcp, "10.96.0.20", 80)
        },
        vec![ep("10.244.1.20", 8080, REMOTE), ep("10.244.2.20", 8080, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            node_port: Some(30021),
            ..port("np-udp", udp, "10.96.0.22", 53)
        },
        vec![ep("10.244.1.22", 53, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            external_ips: vec![ip("203.0.113.21").into()],
            ..port("ext", tcp, "10.96.0.21", 443)
        },
        vec![ep("10.244.1.21", 8443, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            node_port: Some(30030),
            load_balancer_ips: vec![ip("198.51.100.30").into()],
            load_balancer_source_ranges: vec![
                "192.168.0.0/24".parse().unwrap(),
                "203.0.113.0/24".parse().unwrap(),
            ],
            ..port("lb", tcp, "10.96.0.30", 80)
        },
        vec![ep("10.244.1.30", 8080, REMOTE), ep("10.244.2.30", 8080, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            affinity_timeout_seconds: Some(10800),
            ..port("sticky", tcp, "10.96.0.31", 80)
        },
        vec![ep("10.244.1.31", 8080, REMOTE), ep("10.244.2.31", 8080, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            node_port: Some(30040),
            load_balancer_ips: vec![ip("198.51.100.40").into()],
            external_policy_local: true,
            health_check_node_port: Some(32000),
            ..port("etp-local", tcp, "10.96.0.40", 80)
        },
        vec![ep("10.244.0.40", 8080, NODE), ep("10.244.1.40", 8080, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            internal_policy_local: true,
            ..port("itp-local", tcp, "10.96.0.41", 80)
        },
        vec![ep("10.244.1.41", 8080, REMOTE)],
    );
    add(
        &mut s,
        ServicePort {
            node_port: Some(30050),
            ..port("sctp-np", sctp, "10.96.0.42", 7777)
        },
        vec![ep("10.244.1.42", 7777, REMOTE)],
    );
    add(&mut s, port("empty", tcp, "10.96.0.50", 80), vec![]);
    add(
        &mut s,
        port("terminating", tcp, "10.96.0.51", 80),
        vec![Endpoint {
            ready: false,
            terminating: true,
            ..ep("10.244.1.51", 8080, REMOTE)
        }],
    );
    s
}

/// Compares `actual` with golden `name` (the kit's helper; `SWITCHYARD_UPDATE_GOLDEN=1` rewrites).
fn check_golden(name: &str, actual: &str) {
    crate::backend::conformance::golden::check("ipvs", name, actual);
}

#[test]
fn ipvs_render_is_golden() {
    let d = render(&scenario(), &settings(), &[ip("192.168.0.10")]);
    check_golden("scenario.txt", &d.text());
}

#[test]
fn ipvs_vm_scenario_listing_is_golden() {
    check_golden(
        "vm.ipvsadm",
        &render(&vm_scenario(), &vm_settings("rr"), &[ip(VM_NODE_IP)]).ipvsadm_text(),
    );
}

#[test]
fn ipvs_render_semantics() {
    let d = render(
        &scenario(),
        &settings(),
        &[ip("192.168.0.10"), ip("192.168.1.10")],
    );
    let vs = |proto: crate::sys::ipvs::Protocol, a: &str, port: u16| {
        d.virtual_servers
            .get(&VirtualAddr {
                protocol: proto,
                addr: IpAddr::V4(ip(a)),
                port,
            })
            .unwrap_or_else(|| panic!("no virtual server {a}:{port}"))
    };
    use crate::sys::ipvs::Protocol as P;
    // No endpoints: the virtual server stays, without real servers (IPVS rejects).
    assert!(vs(P::Tcp, "10.96.0.50", 80).reals.is_empty());
    // Terminating-only endpoints are the fallback.
    assert_eq!(vs(P::Tcp, "10.96.0.51", 80).reals.len(), 1);
    // ETP=Local: external destinations only get the local endpoint; the ClusterIP gets both.
    assert_eq!(
        vs(P::Tcp, "192.168.1.10", 30040).reals,
        [(ip("10.244.0.40"), 8080)].into()
    );
    assert_eq!(vs(P::Tcp, "198.51.100.40", 80).reals.len(), 1);
    assert_eq!(vs(P::Tcp, "10.96.0.40", 80).reals.len(), 2);
    // ITP=Local without a local endpoint: no real server for the ClusterIP.
    assert!(vs(P::Tcp, "10.96.0.41", 80).reals.is_empty());
    // Affinity: persistence with the timeout.
    let sticky = &vs(P::Tcp, "10.96.0.31", 80).service;
    assert_eq!(
        (sticky.flags, sticky.timeout, sticky.scheduler.as_str()),
        (crate::sys::ipvs::FLAG_PERSISTENT, 10800, "rr")
    );
    // Load-balancer and external IPs are bound unless they are node addresses.
    assert!(d.bind.contains(&ip("198.51.100.30")) && d.bind.contains(&ip("203.0.113.21")));
    assert!(!d.bind.contains(&ip("192.168.0.10")));
    assert_eq!(d.sets[render::IPVS_IPS].entries.len(), d.bind.len());
    // mh gets mh-port (kube-proxy's FlagSourceHash).
    let mut mh = settings();
    mh.ipvs.scheduler = "mh".into();
    let d = render(&scenario(), &mh, &[]);
    assert!(
        d.virtual_servers
            .values()
            .all(|v| v.service.flags & crate::sys::ipvs::FLAG_SCHED2 != 0)
    );
    assert!(d.ipvsadm_text().contains("TCP  10.96.0.11:80 mh (mh-port)"));
}

#[test]
fn ipvs_normalize_sorts_and_zeroes_counters() {
    let listed = "IP Virtual Server version 1.2.1 (size=4096)\n\
Prot LocalAddress:Port Scheduler Flags\n  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n\
UDP  10.96.0.10:53 rr\n  -> 10.244.2.53:53                Masq    1      0          3         \n  -> 10.244.1.53:53                Masq    1      0          0         \n\
TCP  192.0.2.1:80 wlc\n\
TCP  10.96.0.11:80 rr\n  -> 10.244.1.11:8080              Masq    1      2          7         \n";
    let want = "IP Virtual Server version 1.2.1 (size=4096)\n\
Prot LocalAddress:Port Scheduler Flags\n  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n\
TCP  10.96.0.11:80 rr\n  -> 10.244.1.11:8080             Masq    1      0          0\n\
UDP  10.96.0.10:53 rr\n  -> 10.244.1.53:53               Masq    1      0          0\n  -> 10.244.2.53:53               Masq    1      0          0\n";
    assert_eq!(normalize_ipvsadm(listed, |l| !l.contains("192.0.2.1")), want);
}

#[test]
fn ipvs_ownership_respects_excluded_cidrs() {
    let mut s = settings();
    s.ipvs.exclude_cidrs = vec!["10.96.9.0/24".parse().unwrap()];
    let b = IpvsBackend::new(Variant::Legacy, s);
    let d = Desired::default();
    let linked: BTreeSet<Ipv4Addr> = [ip("10.96.0.1"), ip("10.96.9.9")].into();
    let node = [ip("192.168.0.10")];
    let v = |a: &str, port: u16| VirtualAddr {
        protocol: crate::sys::ipvs::Protocol::Tcp,
        addr: IpAddr::V4(ip(a)),
        port,
    };
    assert!(b.owns(&v("10.96.0.1", 80), &d, &linked, &node));
    assert!(!b.owns(&v("10.96.9.9", 80), &d, &linked, &node), "excluded CIDR");
    assert!(
        !b.owns(&v("192.0.2.7", 80), &d, &linked, &node),
        "foreign address"
    );
    assert!(
        b.owns(&v("192.168.0.10", 30001), &d, &linked, &node),
        "node port on a node address"
    );
    assert!(
        !b.owns(&v("192.168.0.10", 8080), &d, &linked, &node),
        "other port on a node address"
    );
}

#[test]
fn ipvs_bypass_jump_edits_follow_the_state() {
    use render::{BYPASS, JumpEdits, all_jumps};
    let save = |lines: &[String]| {
        let mut out = String::from("# Generated by iptables-save\n*t\n:INPUT ACCEPT [0:0]\n");
        for l in lines {
            out.push_str(l);
            out.push('\n');
        }
        out + "COMMIT\n"
    };
    let lines = |nat: bool, bypassed: bool| -> Vec<String> {
        all_jumps()
            .into_iter()
            .filter(|j| j.nat == nat && j.when_bypassed == bypassed)
            .map(|j| j.line(&format!("-A {}", j.chain)))
            .collect()
    };
    // Nothing programmed yet, not bypassed: every normal jump inserted at the top, in order.
    let e = JumpEdits::compute(false, &save(&[]), &save(&[]));
    assert_eq!(
        e.nat,
        vec![
            "-I POSTROUTING 1 -m comment --comment \"switchyard IPVS mode\" -j SWY-IPVS-POSTROUTING",
            "-I OUTPUT 1 -m comment --comment \"switchyard IPVS mode\" -j SWY-IPVS-SERVICES",
            "-I PREROUTING 1 -m comment --comment \"switchyard IPVS mode\" -j SWY-IPVS-SERVICES",
        ]
    );
    assert_eq!(e.filter.len(), 5);
    assert!(e.filter.iter().all(|l| !l.contains(BYPASS)));
    // Programmed and serving: bypass removes the 8 normal jumps and inserts the bypass jump.
    let (f, n) = (save(&lines(false, false)), save(&lines(true, false)));
    assert!(JumpEdits::compute(false, &f, &n).is_empty(), "already in state");
    let e = JumpEdits::compute(true, &f, &n);
    assert_eq!(e.len(), 9);
    assert_eq!(e.filter.iter().filter(|l| l.starts_with("-D ")).count(), 5);
    assert_eq!(
        e.filter.first().map(String::as_str),
        Some("-I INPUT 1 -m comment --comment \"switchyard IPVS mode bypassed\" -j SWY-IPVS-BYPASS")
    );
    assert!(e.nat.iter().all(|l| l.starts_with("-D ")));
    // Closing commits filter (the reject) before nat; opening the reverse.
    let closing = e.restore_input(true);
    assert!(closing.starts_with("*filter\n-I INPUT 1 "), "{closing}");
    assert!(closing.find("*nat").unwrap() > closing.find("*filter").unwrap());
    let opening = JumpEdits::compute(false, &save(&lines(false, true)), &save(&[])).restore_input(false);
    assert!(opening.starts_with("*nat\n"), "{opening}");
    assert!(
        opening
            .contains("-D INPUT -m comment --comment \"switchyard IPVS mode bypassed\" -j SWY-IPVS-BYPASS")
    );
    // Duplicates are all removed.
    let mut twice = lines(false, true);
    twice.extend(lines(false, true));
    let e = JumpEdits::compute(false, &save(&twice), &save(&lines(true, false)));
    assert_eq!(e.filter.iter().filter(|l| l.starts_with("-D INPUT")).count(), 2);
    assert!(e.nat.is_empty());
}

#[test]
fn ipvs_cleanup_input_removes_jumps_then_chains_in_one_commit() {
    let save = "*filter\n:INPUT ACCEPT [0:0]\n:SWY-FORWARD - [0:0]\n:SWY-IPVS-BYPASS - [0:0]\n\
                :SWY-IPVS-FILTER - [0:0]\n\
                -A INPUT -m comment --comment \"switchyard IPVS mode bypassed\" -j SWY-IPVS-BYPASS\n\
                -A INPUT -j SWY-FORWARD\nCOMMIT\n";
    assert_eq!(
        render::cleanup_input(false, save).unwrap(),
        "*filter\n:SWY-IPVS-BYPASS - [0:0]\n:SWY-IPVS-FILTER - [0:0]\n\
         -D INPUT -m comment --comment \"switchyard IPVS mode bypassed\" -j SWY-IPVS-BYPASS\n\
         -X SWY-IPVS-BYPASS\n-X SWY-IPVS-FILTER\nCOMMIT\n"
    );
    assert_eq!(
        render::cleanup_input(true, "*nat\n:SWY-SERVICES - [0:0]\nCOMMIT\n"),
        None
    );
}

#[test]
fn ipvs_chains_lists_every_chain_the_render_writes() {
    // The cleanup looks for `render::CHAINS` by name: a rendered chain missing from it would
    // outlive a cleanup on the nft variant.
    let desired = render(&scenario(), &settings(), &[ip("192.168.0.10")]);
    for (nat, chains) in [(false, &desired.filter), (true, &desired.nat)] {
        let rendered: BTreeSet<&str> = chains.chains.keys().copied().collect();
        let listed: BTreeSet<&str> = render::chains(nat).into_iter().collect();
        assert_eq!(rendered, listed, "nat={nat}");
    }
}

#[test]
fn ipvs_cleanup_reads_a_table_whole_only_when_a_chain_of_ours_is_in_it() {
    let mut b = fake_backend(settings());
    b.cleanup().expect("cleanup of nothing");
    assert_eq!(
        b.iptables().inner().saves(),
        0,
        "nothing of ours: no whole-table read"
    );

    b.sync(&DualSnapshot::from(scenario()), &Changes::default(), true)
        .expect("sync");
    let before = b.iptables().inner().saves();
    b.cleanup().expect("cleanup");
    let ipt = b.iptables().inner();
    assert!(
        ipt.saves() > before,
        "our chains were there: the tables were read whole"
    );
    for table in [Table::Filter, Table::Nat] {
        let save = ipt.save(table).expect("save");
        assert!(!save.contains("SWY-IPVS-"), "{table:?} after cleanup:\n{save}");
    }
}

#[test]
fn ipvs_bypass_chain_rejects_only_new_connections_to_ipvs_destinations() {
    let d = render(&scenario(), &settings(), &[ip("192.168.0.10")]);
    let rules = &d.filter.chains[render::BYPASS];
    assert!(!rules.is_empty());
    for r in rules {
        assert!(
            r.contains("--ctstate NEW") && r.ends_with("-j REJECT --reject-with icmp-port-unreachable"),
            "{r}"
        );
    }
    for set in [
        render::IPVS_IPS,
        render::EXTERNAL_IP,
        render::LB,
        render::NODE_PORT_TCP,
        render::NODE_PORT_UDP,
        render::NODE_PORT_SCTP,
    ] {
        assert!(
            rules.iter().any(|r| r.contains(&format!("--match-set {set} "))),
            "{set}: {rules:?}"
        );
    }
    // Restricted NodePort addresses: the node-port rules name them.
    let d = render(&vm_scenario(), &vm_settings("rr"), &[ip(VM_NODE_IP)]);
    assert!(
        d.filter.chains[render::BYPASS]
            .iter()
            .any(|r| r.starts_with("-A SWY-IPVS-BYPASS -d 10.0.1.1/32 -p tcp "))
    );
    // Bypass state is kept in the backend before anything is programmed.
    let mut b = IpvsBackend::new(Variant::Legacy, vm_settings("rr"));
    b.set_bypass(true).unwrap();
    assert!(b.bypassed());
    assert_eq!(
        b.verify().unwrap(),
        vec!["not programmed (the last sync did not succeed)".to_owned()]
    );
}

// ---------------------------------------------------------------------------------------------
// The VM scenario (also used on the host for the golden listing)

/// The director's address facing the client namespace (the "node IP").
const VM_NODE_IP: &str = "10.0.1.1";
/// Real servers: (namespace, address).
const VM_REALS: [(&str, &str); 3] = [
    ("rs1", "10.244.1.11"),
    ("rs2", "10.244.2.12"),
    ("rs3", "10.244.3.13"),
];
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 8053;

fn vm_settings(scheduler: &str) -> Settings {
    let mut s = Settings {
        node: NodeInfo {
            name: "vm".into(),
            addresses: vec![ip(VM_NODE_IP).into()],
            zone: None,
        },
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        node_port_addresses: crate::backend::NodePortIps::of_addresses(&[ip(VM_NODE_IP).into()]),
        ..Settings::default()
    };
    s.ipvs.scheduler = scheduler.into();
    s
}

fn vm_eps(n: usize, port: u16) -> Vec<Endpoint> {
    VM_REALS
        .iter()
        .take(n)
        .map(|(_, a)| ep(a, port, "other"))
        .collect()
}

fn vm_scenario() -> Snapshot {
    let mut s = Snapshot::default();
    add(
        &mut s,
        port("web", Protocol::Tcp, "10.96.0.10", 80),
        vm_eps(2, TCP_PORT),
    );
    add(
        &mut s,
        port("dns", Protocol::Udp, "10.96.0.53", 53),
        vm_eps(2, UDP_PORT),
    );
    add(
        &mut s,
        ServicePort {
            node_port: Some(30080),
            ..port("np", Protocol::Tcp, "10.96.0.30", 80)
        },
        vm_eps(3, TCP_PORT),
    );
    add(
        &mut s,
        ServicePort {
            affinity_timeout_seconds: Some(60),
            ..port("sticky", Protocol::Tcp, "10.96.0.40", 80)
        },
        vm_eps(3, TCP_PORT),
    );
    add(&mut s, port("empty", Protocol::Tcp, "10.96.0.50", 80), vec![]);
    add(&mut s, port("empty-udp", Protocol::Udp, "10.96.0.51", 53), vec![]);
    s
}

mod settings_fake;

/// Tests that need the IPVS kernel, run inside the VM by `scripts/ipvs-vm.sh` (which sets
/// `SWITCHYARD_IPVS_VM=1` and passes `--ignored --test-threads=1`). The VM's root namespace is the
/// director (the node); `client` and `rs1..rs3` are namespaces joined to it by veth pairs.
mod vm {
    use std::fs::File;
    use std::io::{BufRead, BufReader, Write};
    use std::net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
    use std::os::fd::AsFd;
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    use nix::sched::{CloneFlags, setns};

    use super::*;
    use crate::backend::Backend;
    use crate::backend::vm_support::{in_netns, ipcmd, require_vm, sh, wired_netns};

    const IGNORE: &str = "needs the IPVS kernel: scripts/ipvs-vm.sh";
    const TIMEOUT: Duration = Duration::from_secs(3);

    mod settings;

    /// The conformance suite on the VM's kernel, each case in a throwaway network namespace (its
    /// own IPVS table, ipsets, iptables, links and `net/` sysctls), plus the fake against it.
    mod conformance {
        use super::super::*;
        use crate::backend::conformance::netns::TestNetns;
        use crate::backend::vm_support::require_vm;
        use crate::sys::ipset::KernelIpsets;
        use crate::sys::ipvs::KernelIpvs;
        use crate::sys::link::KernelLinks;
        use crate::sys::sysctl::HostSysctl;

        type KernelBackend = SuiteBackend<Iptables, KernelIpvs, KernelIpsets, KernelLinks, HostSysctl>;

        /// Runs `args` (in the calling thread's network namespace); it must succeed.
        fn run(args: &[&str]) -> String {
            let out = std::process::Command::new(args[0])
                .args(&args[1..])
                .output()
                .unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert!(out.status.success(), "{args:?}: {out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        }

        /// The IPVS backend on the kernel, inside the subject's network namespace; `owned` reads
        /// the kernel with its own tools (`ipvsadm -Ln`, `ip`, `ipset save`, `iptables-legacy-save`).
        struct KernelSubject(KernelBackend);

        impl Subject for KernelSubject {
            type B = KernelBackend;
            fn backend(&mut self) -> &mut Self::B {
                &mut self.0
            }
            fn owned(&self) -> String {
                let link = std::process::Command::new("ip")
                    .args(["link", "show", "dev", LINK])
                    .output()
                    .expect("ip link")
                    .status
                    .success()
                    .then(|| {
                        let text = run(&["ip", "-o", "-4", "addr", "show", "dev", LINK]);
                        crate::sys::link::parse_addresses(&text)
                            .into_iter()
                            .map(|(_, a)| a)
                            .collect::<BTreeSet<Ipv4Addr>>()
                    });
                let sets = crate::sys::ipset::parse_save(&run(&["ipset", "save"]), "SWY-");
                let filter = run(&["iptables-legacy-save", "-t", "filter"]);
                let nat = run(&["iptables-legacy-save", "-t", "nat"]);
                owned_text(
                    &run(&["ipvsadm", "-Ln"]),
                    link.as_ref(),
                    &sets,
                    [("filter", &filter), ("nat", &nat)],
                )
            }
            fn fail_writes(&mut self, n: usize) {
                fail_parts(&mut self.0, n);
            }
        }

        struct KernelKit;

        static NETNS_SERIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

        /// A fresh network namespace with the node's address on its own link, up.
        fn node_netns() -> TestNetns {
            require_vm();
            let n = NETNS_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let ns = TestNetns::new(&format!("ipvs-suite{n}"));
            ns.sh(&["ip", "link", "add", NODE_LINK, "type", "dummy"]);
            ns.sh(&[
                "ip",
                "addr",
                "add",
                &format!("{}/24", fixtures_addr()),
                "dev",
                NODE_LINK,
            ]);
            ns.sh(&["ip", "link", "set", NODE_LINK, "up"]);
            ns
        }

        impl Kit for KernelKit {
            type S = KernelSubject;
            fn with_subject<T: Send>(&self, f: impl FnOnce(&mut Self::S) -> T + Send) -> T {
                let ns = node_netns();
                ns.run(move || {
                    f(&mut KernelSubject(IpvsBackend::with_adapters(
                        crate::backend::conformance::fixtures::settings(),
                        FaultyIptables::new(Iptables::new(Variant::Legacy, None)),
                        FaultyIpvs::new(KernelIpvs::new()),
                        FaultyIpsets::new(KernelIpsets),
                        FaultyLinks::new(KernelLinks),
                        HostSysctl::new(None),
                    )))
                })
            }
            fn cleanup_parts(&self) -> usize {
                CLEANUP_PARTS
            }
        }

        crate::backend::conformance::suite::conformance_suite!(
            KernelKit,
            ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"
        );

        /// The fake and the kernel end in the same state after the suite's full and partial syncs.
        #[test]
        #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
        fn fake_and_kernel_agree_after_full_and_partial_syncs() {
            crate::backend::conformance::suite::kits_agree(&FakeKit, &KernelKit);
            println!("VMTEST conformance: fake and kernel IPVS agree after full and partial syncs");
        }

        /// The kernel's IPVS table refuses as the fake does, with the same typed errors, and
        /// lists the same state after the probe.
        #[test]
        #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
        fn ipvs_table_refuses_as_the_fake_does() {
            let want: Vec<i32> = refusal_script().into_iter().map(|(_, errno)| errno).collect();
            let (kernel, kernel_state) = node_netns().run(|| run_refusal_script(&mut KernelIpvs::new()));
            let (fake, fake_state) = run_refusal_script(&mut FakeIpvs::new());
            assert_eq!(kernel, want, "the kernel's refusals");
            assert_eq!(fake, kernel);
            assert_eq!(fake_state, kernel_state);
            println!("VMTEST conformance: IPVS table refusals {kernel:?} equal the fake's");
        }
    }

    /// Builds the namespaces and starts the real servers once per process.
    fn topology() {
        static DONE: OnceLock<()> = OnceLock::new();
        DONE.get_or_init(|| {
            require_vm();
            ipcmd("link set lo up");
            wired_netns("client", "d-", "10.0.1.2", "10.0.1.1");
            for i in 3..=9 {
                ipcmd(&format!("-n client addr add 10.0.1.{i}/24 dev eth0"));
            }
            for (i, (ns, addr)) in VM_REALS.iter().enumerate() {
                wired_netns(ns, "d-", addr, &format!("10.244.{}.1", i + 1));
                start_servers(ns);
            }
        });
    }

    /// A TCP server answering every line with the namespace's name, and a UDP one answering
    /// every datagram the same way.
    fn start_servers(ns: &'static str) {
        let (tx, rx) = std::sync::mpsc::channel();
        let path = format!("/run/netns/{ns}");
        std::thread::spawn(move || {
            let file = File::open(&path).unwrap();
            setns(file.as_fd(), CloneFlags::CLONE_NEWNET).unwrap();
            let tcp = TcpListener::bind(("0.0.0.0", TCP_PORT)).unwrap();
            let udp = UdpSocket::bind(("0.0.0.0", UDP_PORT)).unwrap();
            std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while let Ok((_, peer)) = udp.recv_from(&mut buf) {
                    let _ = udp.send_to(ns.as_bytes(), peer);
                }
            });
            tx.send(()).unwrap();
            for conn in tcp.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut writer = conn.try_clone().unwrap();
                    for line in BufReader::new(conn).lines() {
                        if line.is_err() || writer.write_all(format!("{ns}\n").as_bytes()).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
    }

    fn sock(dst: &str, port: u16) -> SocketAddr {
        SocketAddr::new(dst.parse().unwrap(), port)
    }

    /// Opens a TCP connection from the client namespace.
    fn connect(dst: &str, port: u16) -> std::io::Result<TcpStream> {
        let to = sock(dst, port);
        in_netns("client", move || {
            let stream = TcpStream::connect_timeout(&to, TIMEOUT)?;
            stream.set_read_timeout(Some(TIMEOUT))?;
            Ok(stream)
        })
    }

    /// Asks an open connection who answers.
    fn who(stream: &mut TcpStream) -> std::io::Result<String> {
        stream.write_all(b"who\n")?;
        let mut line = String::new();
        BufReader::new(stream.try_clone()?).read_line(&mut line)?;
        if line.is_empty() {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed"));
        }
        Ok(line.trim().to_owned())
    }

    fn tcp_ask(dst: &str, port: u16) -> std::io::Result<String> {
        who(&mut connect(dst, port)?)
    }

    fn udp_ask(dst: &str, port: u16) -> std::io::Result<String> {
        udp_ask_from(Ipv4Addr::UNSPECIFIED, dst, port)
    }

    /// One datagram from a fresh socket (a new IPVS connection) bound to source address `src`.
    fn udp_ask_from(src: Ipv4Addr, dst: &str, port: u16) -> std::io::Result<String> {
        let to = sock(dst, port);
        in_netns("client", move || {
            let s = UdpSocket::bind(SocketAddrV4::new(src, 0))?;
            s.connect(to)?;
            s.set_read_timeout(Some(TIMEOUT))?;
            s.send(b"who")?;
            let mut buf = [0u8; 64];
            let n = s.recv(&mut buf)?;
            Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
        })
    }

    fn asks(n: usize, f: impl Fn() -> std::io::Result<String>) -> Vec<String> {
        (0..n).map(|_| f().unwrap()).collect()
    }

    /// rr: the answers cycle through `n` distinct real servers, exactly.
    fn assert_round_robin(answers: &[String], n: usize) {
        let first: BTreeSet<&String> = answers.iter().take(n).collect();
        assert_eq!(first.len(), n, "first {n} answers distinct: {answers:?}");
        for i in n..answers.len() {
            assert_eq!(answers[i], answers[i - n], "exact alternation: {answers:?}");
        }
    }

    fn fresh(scheduler: &str) -> IpvsBackend {
        topology();
        let mut b = IpvsBackend::new(Variant::Legacy, vm_settings(scheduler));
        b.cleanup().unwrap();
        b
    }

    fn sync(b: &mut IpvsBackend, snap: &Snapshot, full: bool) -> SyncStats {
        b.sync(&DualSnapshot::from(snap.clone()), &Changes::default(), full)
            .unwrap_or_else(|e| panic!("sync: {e}"))
    }

    fn listing() -> String {
        sh(&["ipvsadm", "-Ln"])
    }

    /// The lines of one virtual server's block (`TCP  10.96.0.10:80`) in a raw listing.
    fn block(listing: &str, service: &str) -> Vec<String> {
        let mut lines = listing
            .lines()
            .skip_while(|l| !l.starts_with(&format!("{service} ")));
        let head = lines.next().map(str::to_owned);
        head.into_iter()
            .chain(lines.take_while(|l| l.starts_with(' ')).map(str::to_owned))
            .collect()
    }

    /// The `-> addr:port ...` line of real server `real` of virtual server `service`, blanks
    /// collapsed.
    fn real_line(listing: &str, service: &str, real: &str) -> Option<String> {
        block(listing, service)
            .into_iter()
            .find(|l| l.contains(&format!("-> {real}:")))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
    }

    fn real_addr(name: &str) -> &'static str {
        VM_REALS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, a)| *a)
            .unwrap()
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_a_probe_reports_ipvs_usable_with_schedulers() {
        topology();
        let caps = crate::probe::decide(&crate::probe::HostFacts::gather());
        println!(
            "VMTEST probe: kernel {} ipvs usable={} ({}) schedulers={:?} modes={:?}",
            caps.kernel_version,
            caps.ipvs.usable,
            caps.ipvs.detail.clone().unwrap_or_default(),
            caps.ipvs_schedulers,
            caps.supported_modes
        );
        assert!(caps.ipvs.usable, "{caps:?}");
        for s in ["rr", "wrr", "lc", "wlc", "sh", "dh", "sed", "nq", "mh"] {
            assert!(
                caps.ipvs_schedulers.iter().any(|x| x == s),
                "scheduler {s}: {:?}",
                caps.ipvs_schedulers
            );
        }
        assert!(
            caps.supported_modes
                .contains(&switchyard_crds::v1alpha1::ProxyMode::Ipvs)
        );
        let _ = IGNORE;
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_b_listing_matches_golden_and_cluster_ip_round_robins() {
        let mut b = fresh("rr");
        let snap = vm_scenario();
        let stats = sync(&mut b, &snap, true);
        println!("VMTEST sync: {stats:?}");
        let listed = listing();
        print!("{listed}");
        assert_eq!(
            normalize_ipvsadm(&listed, |_| true),
            include_str!("testdata/vm.ipvsadm"),
            "ipvsadm -Ln vs golden"
        );
        println!("VMTEST ipvsadm -Ln matches testdata/vm.ipvsadm");
        let desired = render(&snap, &vm_settings("rr"), &[ip(VM_NODE_IP)]);
        let bound: BTreeSet<Ipv4Addr> = crate::sys::link::addresses(render::LINK).unwrap();
        assert_eq!(bound, desired.bind);
        let cluster: BTreeSet<String> = crate::sys::ipset::entries(render::CLUSTER_IP)
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(cluster, desired.sets[render::CLUSTER_IP].entries);

        let tcp = asks(6, || tcp_ask("10.96.0.10", 80));
        println!("VMTEST ClusterIP TCP rr: {tcp:?}");
        assert_round_robin(&tcp, 2);
        let udp = asks(6, || udp_ask("10.96.0.53", 53));
        println!("VMTEST ClusterIP UDP rr: {udp:?}");
        assert_round_robin(&udp, 2);
        // Masquerade: the real server saw the director, not the client (conntrack entry via IPVS).
        b.cleanup().unwrap();
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_c_node_port_reaches_real_servers() {
        let mut b = fresh("rr");
        sync(&mut b, &vm_scenario(), true);
        let np = asks(6, || tcp_ask(VM_NODE_IP, 30080));
        println!("VMTEST NodePort {VM_NODE_IP}:30080 rr over 3: {np:?}");
        assert_round_robin(&np, 3);
        b.cleanup().unwrap();
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_d_session_affinity_pins_a_client() {
        let mut b = fresh("rr");
        sync(&mut b, &vm_scenario(), true);
        let answers = asks(6, || tcp_ask("10.96.0.40", 80));
        println!("VMTEST ClientIP affinity (persistent 60): {answers:?}");
        assert!(answers.iter().all(|a| *a == answers[0]), "{answers:?}");
        assert!(listing().contains("TCP  10.96.0.40:80 rr persistent 60"));
        b.cleanup().unwrap();
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_e_sh_keeps_each_source_on_one_real_server() {
        let mut b = fresh("rr");
        sync(&mut b, &vm_scenario(), true);
        // A new backend with another scheduler edits the existing services (SET_SERVICE).
        let mut b = IpvsBackend::new(Variant::Legacy, vm_settings("sh"));
        sync(&mut b, &vm_scenario(), true);
        assert!(listing().contains("TCP  10.96.0.30:80 sh"), "{}", listing());
        let np = asks(3, || tcp_ask(VM_NODE_IP, 30080));
        assert!(
            np.iter().all(|a| *a == np[0]),
            "one source, one real server: {np:?}"
        );
        // UDP: every datagram below comes from a fresh socket, so each one is a new IPVS
        // connection scheduled by source address alone.
        sync(&mut b, &sh_snapshot(), true);
        let mut per_source = BTreeMap::new();
        for i in 2..=9u8 {
            let src = Ipv4Addr::new(10, 0, 1, i);
            let answers = asks(4, || udp_ask_from(src, "10.96.0.60", 53));
            assert!(
                answers.iter().all(|a| *a == answers[0]),
                "source {src}: {answers:?}"
            );
            per_source.insert(src, answers[0].clone());
        }
        println!("VMTEST sh: source -> real server {per_source:?}");
        let distinct: BTreeSet<&String> = per_source.values().collect();
        assert!(distinct.len() >= 2, "sh spreads sources: {per_source:?}");
        b.cleanup().unwrap();
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_f_no_endpoints_rejects() {
        let mut b = fresh("rr");
        sync(&mut b, &vm_scenario(), true);
        let tcp = tcp_ask("10.96.0.50", 80).map_err(|e| e.kind());
        let udp = udp_ask("10.96.0.51", 53).map_err(|e| e.kind());
        println!("VMTEST no endpoints: TCP {tcp:?}, UDP {udp:?}");
        assert_eq!(tcp, Err(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(udp, Err(std::io::ErrorKind::ConnectionRefused));
        // A service address on a port that is no service is rejected too (SWY-IPVS-FILTER), even
        // though the node listens on it; the node address itself still answers.
        let listener = TcpListener::bind(("0.0.0.0", 9999)).unwrap();
        let stray = tcp_ask("10.96.0.10", 9999).map_err(|e| e.kind());
        let node = connect(VM_NODE_IP, 9999).map(|_| ()).map_err(|e| e.kind());
        drop(listener);
        println!("VMTEST service IP on a non-service port: {stray:?}; node IP: {node:?}");
        assert_eq!(stray, Err(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(node, Ok(()));
        b.cleanup().unwrap();
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_g_endpoint_removal_drains_gracefully() {
        let mut b = fresh("rr");
        let mut snap = vm_scenario();
        sync(&mut b, &snap, true);
        let mut open = connect("10.96.0.10", 80).unwrap();
        let victim = who(&mut open).unwrap();
        let survivor = if victim == "rs1" { "rs2" } else { "rs1" };
        let web = spn("web", "p", Protocol::Tcp);
        snap.endpoints
            .insert(web.clone(), vec![ep(real_addr(survivor), TCP_PORT, "other")]);
        sync(&mut b, &snap, false);
        let line = real_line(&listing(), "TCP  10.96.0.10:80", real_addr(&victim)).unwrap_or_default();
        println!("VMTEST after removing {victim}: {line}");
        assert!(
            line.contains("Masq 0 1"),
            "weight 0 with 1 active connection: {line}"
        );
        assert_eq!(b.terminating().len(), 1);
        assert_eq!(who(&mut open).unwrap(), victim, "the open connection survives");
        let fresh_answers = asks(4, || tcp_ask("10.96.0.10", 80));
        println!("VMTEST open connection still answered by {victim}; new connections: {fresh_answers:?}");
        assert!(fresh_answers.iter().all(|a| a == survivor), "{fresh_answers:?}");
        drop(open);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            sync(&mut b, &snap, false);
            if real_line(&listing(), "TCP  10.96.0.10:80", real_addr(&victim)).is_none() {
                break;
            }
            assert!(Instant::now() < deadline, "{victim} never deleted: {}", listing());
            std::thread::sleep(Duration::from_millis(200));
        }
        assert!(b.terminating().is_empty());
        println!("VMTEST connection closed -> {victim} deleted");
        // UDP real servers go at once.
        let dns = spn("dns", "p", Protocol::Udp);
        udp_ask("10.96.0.53", 53).unwrap();
        snap.endpoints
            .insert(dns, vec![ep(real_addr("rs2"), UDP_PORT, "other")]);
        sync(&mut b, &snap, false);
        let udp_block = block(&listing(), "UDP  10.96.0.53:53").join("\n");
        println!("VMTEST UDP endpoint removed at once:\n{udp_block}");
        assert!(
            udp_block.contains(real_addr("rs2")) && !udp_block.contains(real_addr("rs1")),
            "{udp_block}"
        );
        b.cleanup().unwrap();
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_h_service_deletion_removes_virtual_service_address_and_set_entries() {
        let mut b = fresh("rr");
        let mut snap = vm_scenario();
        sync(&mut b, &snap, true);
        assert_eq!(
            tcp_ask("10.96.0.10", 80).map(|a| a.starts_with("rs")).ok(),
            Some(true)
        );
        let web = spn("web", "p", Protocol::Tcp);
        snap.services.remove(&web);
        snap.endpoints.remove(&web);
        let stats = sync(&mut b, &snap, false);
        let l = listing();
        assert!(!l.contains("10.96.0.10:80"), "{l}");
        assert!(
            !crate::sys::link::addresses(render::LINK)
                .unwrap()
                .contains(&ip("10.96.0.10"))
        );
        let cluster = crate::sys::ipset::entries(render::CLUSTER_IP).unwrap();
        assert!(
            !cluster.iter().any(|e| e.starts_with("10.96.0.10,")),
            "{cluster:?}"
        );
        let ips = crate::sys::ipset::entries(render::IPVS_IPS).unwrap();
        assert!(!ips.iter().any(|e| e == "10.96.0.10"), "{ips:?}");
        println!(
            "VMTEST service deleted (partial sync {stats:?}): virtual service, swy-ipvs0 address and set entries gone; {} services left",
            l.lines()
                .filter(|x| !x.starts_with(' ') && x.contains(':'))
                .count()
                - 1
        );
        b.cleanup().unwrap();
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_i_foreign_services_survive_and_cleanup_removes_everything_ours() {
        let mut b = fresh("rr");
        sh(&["ipvsadm", "-A", "-t", "192.0.2.10:80", "-s", "wlc"]);
        sh(&[
            "ipvsadm",
            "-a",
            "-t",
            "192.0.2.10:80",
            "-r",
            "10.244.1.11:8080",
            "-m",
        ]);
        sh(&["ipvsadm", "-A", "-u", "10.0.1.1:5353", "-s", "rr"]);
        sync(&mut b, &vm_scenario(), true);
        sync(&mut b, &Snapshot::default(), true);
        let l = listing();
        assert!(
            l.contains("TCP  192.0.2.10:80 wlc") && l.contains("UDP  10.0.1.1:5353 rr"),
            "{l}"
        );
        sync(&mut b, &vm_scenario(), true);
        b.cleanup().unwrap();
        let l = listing();
        let services: Vec<&str> = l.lines().skip(3).filter(|x| !x.starts_with(' ')).collect();
        assert_eq!(
            services,
            vec!["TCP  192.0.2.10:80 wlc", "UDP  10.0.1.1:5353 rr"],
            "{l}"
        );
        assert!(!crate::sys::link::exists(render::LINK).unwrap());
        assert!(crate::sys::ipset::list_names("SWY-").unwrap().is_empty());
        for table in ["filter", "nat"] {
            let save = sh(&["iptables-legacy-save", "-t", table]);
            assert!(!save.contains("SWY-"), "{save}");
        }
        b.cleanup().unwrap();
        println!(
            "VMTEST cleanup: foreign services kept ({services:?}); no swy-ipvs0, SWY sets or SWY chains; idempotent"
        );
        sh(&["ipvsadm", "-D", "-t", "192.0.2.10:80"]);
        sh(&["ipvsadm", "-D", "-u", "10.0.1.1:5353"]);
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_j_bypass_refuses_new_connections_keeps_objects_and_open_ones() {
        let mut b = fresh("rr");
        let snap = vm_scenario();
        sync(&mut b, &snap, true);
        assert_eq!(b.verify().unwrap(), Vec::<String>::new(), "no drift after a sync");
        let mut open = connect("10.96.0.10", 80).unwrap();
        let first = who(&mut open).unwrap();
        let before = normalize_ipvsadm(&listing(), |_| true);
        let bound = crate::sys::link::addresses(render::LINK).unwrap();

        let t = Instant::now();
        b.set_bypass(true).unwrap();
        let closing = t.elapsed();
        // A node-local listener on the service port must not answer for the service address.
        let listener = TcpListener::bind(("0.0.0.0", 80)).unwrap();
        let tcp = tcp_ask("10.96.0.10", 80).map_err(|e| e.kind());
        drop(listener);
        let node_port = tcp_ask(VM_NODE_IP, 30080).map_err(|e| e.kind());
        let udp = udp_ask("10.96.0.53", 53).map_err(|e| e.kind());
        let kept = who(&mut open);
        println!(
            "VMTEST bypass on ({:.0} ms): new TCP {tcp:?}, NodePort {node_port:?}, UDP {udp:?}; open connection -> {kept:?}",
            closing.as_secs_f64() * 1e3
        );
        let refused = || Err::<String, _>(std::io::ErrorKind::ConnectionRefused);
        assert_eq!((tcp, node_port, udp), (refused(), refused(), refused()));
        assert_eq!(
            kept.unwrap(),
            first,
            "an established IPVS connection survives the bypass"
        );
        assert_eq!(
            normalize_ipvsadm(&listing(), |_| true),
            before,
            "virtual servers kept"
        );
        assert_eq!(
            crate::sys::link::addresses(render::LINK).unwrap(),
            bound,
            "addresses kept"
        );
        assert_eq!(
            b.verify().unwrap(),
            Vec::<String>::new(),
            "bypassed state verifies"
        );
        let save = sh(&["iptables-legacy-save"]);
        let jumps: Vec<&str> = save
            .lines()
            .filter(|l| l.contains("-j SWY-IPVS-") && !l.starts_with("-A SWY-"))
            .collect();
        assert_eq!(jumps.len(), 1, "only the bypass jump: {jumps:?}");
        // The bypass survives full and partial syncs.
        sync(&mut b, &snap, true);
        sync(&mut b, &snap, false);
        assert_eq!(tcp_ask("10.96.0.10", 80).map_err(|e| e.kind()), refused());
        assert_eq!(b.verify().unwrap(), Vec::<String>::new());

        let t = Instant::now();
        b.set_bypass(false).unwrap();
        let opening = t.elapsed();
        let answers = asks(4, || tcp_ask("10.96.0.10", 80));
        println!(
            "VMTEST bypass off ({:.0} ms): new connections {answers:?}; open connection -> {:?}",
            opening.as_secs_f64() * 1e3,
            who(&mut open)
        );
        assert_eq!(b.verify().unwrap(), Vec::<String>::new());
        drop(open);
        // Link state is no bypass: the local routes of a down dummy link's addresses stay.
        ipcmd(&format!("link set dev {} down", render::LINK));
        let down = tcp_ask("10.96.0.10", 80).map_err(|e| e.kind());
        ipcmd(&format!("link set dev {} up", render::LINK));
        println!("VMTEST swy-ipvs0 down: new connection -> {down:?} (link state does not stop IPVS)");
        b.cleanup().unwrap();
    }

    /// A client in the `client` namespace making bounded TCP connections (connect, one line,
    /// close; 1 s timeouts) to `targets` in turn until stopped. Records (seconds since `t0`,
    /// target, error) for every failure and counts the attempts.
    struct Load {
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
        handle: std::thread::JoinHandle<LoadResult>,
    }

    /// Attempts, and (seconds since start, target, error) per failed connection.
    type LoadResult = (usize, Vec<(f64, String, String)>);

    impl Load {
        fn start(targets: Vec<(&'static str, u16)>, t0: Instant) -> Self {
            use std::sync::atomic::{AtomicBool, Ordering};
            let stop = std::sync::Arc::new(AtomicBool::new(false));
            let flag = stop.clone();
            let handle = std::thread::spawn(move || {
                let file = File::open("/run/netns/client").unwrap();
                setns(file.as_fd(), CloneFlags::CLONE_NEWNET).unwrap();
                let (mut attempts, mut failures) = (0, Vec::new());
                let limit = Duration::from_secs(1);
                while !flag.load(Ordering::Relaxed) {
                    for (dst, port) in &targets {
                        attempts += 1;
                        let result =
                            TcpStream::connect_timeout(&sock(dst, *port), limit).and_then(|mut s| {
                                s.set_read_timeout(Some(limit))?;
                                who(&mut s)
                            });
                        match result {
                            Ok(a) if a.starts_with("rs") => {}
                            Ok(a) => failures.push((t0.elapsed().as_secs_f64(), format!("{dst}:{port}"), a)),
                            Err(e) => failures.push((
                                t0.elapsed().as_secs_f64(),
                                format!("{dst}:{port}"),
                                e.to_string(),
                            )),
                        }
                        std::thread::sleep(Duration::from_millis(3));
                    }
                }
                (attempts, failures)
            });
            Self { stop, handle }
        }

        fn stop(self) -> LoadResult {
            self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
            self.handle.join().unwrap()
        }
    }

    /// Durations of one switch's steps.
    #[derive(Debug, Default)]
    struct SwitchTimes {
        prepare: Duration,
        cut_over: Duration,
        verifying: Duration,
        cleaning: Duration,
        total: Duration,
        /// Health-gate probe rounds (from the node) and how many of them failed.
        rounds: usize,
        failed_rounds: usize,
    }

    /// Runs the driver from its current mode to `to` the way the runtime does (steps while
    /// they ask for more, otherwise a partial sync of both backends and a short tick), calling
    /// `after_cut_over` once right after the cut-over.
    fn drive(
        d: &mut crate::driver::Driver,
        to: switchyard_crds::v1alpha1::ProxyMode,
        snap: &DualSnapshot,
        mut after_cut_over: impl FnMut(),
    ) -> SwitchTimes {
        use crate::switch::{Desired as Wish, Phase};
        use switchyard_crds::v1alpha1::{HealthGate, ProxyMode};
        let wish = Wish {
            mode: to,
            token: Some(format!("to-{to}")),
        };
        let supported = [ProxyMode::Iptables, ProxyMode::Ipvs, ProxyMode::Nftables];
        let gate = HealthGate {
            min_healthy_seconds: 1,
            timeout_seconds: 30,
            failure_threshold: 3,
            ..HealthGate::default()
        };
        let targets = [
            ServiceName {
                namespace: "ns".into(),
                name: "web".into(),
            },
            ServiceName {
                namespace: "ns".into(),
                name: "np".into(),
            },
        ];
        let mut times = SwitchTimes::default();
        let t0 = Instant::now();
        let mut verifying_since = None;
        loop {
            let before = d.state.phase;
            let t = Instant::now();
            let more = d.step(Some(&wish), &supported, &gate, snap, &targets);
            let took = t.elapsed();
            let after = d.state.phase;
            match (before, after) {
                (Phase::Active, Phase::Preparing) => times.prepare = took,
                (Phase::Preparing, Phase::Verifying) => {
                    times.cut_over = took;
                    verifying_since = Some(Instant::now());
                    after_cut_over();
                }
                (Phase::Verifying, Phase::Verifying) => {
                    times.rounds += 1;
                    if d.probes.iter().any(|p| !p.ok) {
                        times.failed_rounds += 1;
                        println!("VMTEST probe round failed: {:?}", d.probes);
                    }
                }
                (Phase::Verifying, Phase::Active) | (Phase::Verifying, Phase::Cleaning) => {
                    times.verifying = verifying_since.map(|v| v.elapsed() - took).unwrap_or_default();
                    times.cleaning = took;
                }
                _ => {}
            }
            if after == Phase::Active && before != Phase::Active {
                break;
            }
            assert!(
                after != Phase::RollingBack,
                "rolled back: {:?} {:?}",
                d.last,
                d.probes
            );
            if !more {
                d.sync(snap, &Changes::default(), false).unwrap();
                std::thread::sleep(Duration::from_millis(100));
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "switch stuck in {after:?}: {:?}",
                d.probes
            );
        }
        times.total = t0.elapsed();
        let last = d.last.clone().unwrap();
        assert_eq!(
            (last.result.clone(), d.state.active),
            (switchyard_crds::v1alpha1::SwitchOutcome::Succeeded, to),
            "{last:?}; probes {:?}",
            d.probes
        );
        times
    }

    fn ms(d: Duration) -> String {
        format!("{:.0} ms", d.as_secs_f64() * 1e3)
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_k_switch_driver_moves_ipvs_to_nftables_and_back_under_load() {
        use crate::driver::Driver;
        use crate::state_store::StateFile;
        use switchyard_crds::v1alpha1::ProxyMode;
        fresh("rr");
        crate::backend::nftables::NftablesBackend::new(Settings::default())
            .cleanup()
            .unwrap();
        let dir = std::env::temp_dir().join(format!("swy-switch-{}", std::process::id()));
        let file = StateFile(dir.join("switch.json"));
        let snap = DualSnapshot::from(vm_scenario());
        // The driver runs here, in the director (the node): it programs this namespace and its
        // health-gate probes connect to the ClusterIPs from it (node-local clients); the load
        // comes from the client namespace through the director (remote clients).
        let mut d = Driver::new(
            Box::new(file.clone()),
            ProxyMode::Ipvs,
            vm_settings("rr"),
            "legacy".into(),
        );
        d.sync(&snap, &Changes::default(), true).unwrap();
        assert_eq!(
            tcp_ask("10.96.0.10", 80).map(|a| a.starts_with("rs")).ok(),
            Some(true)
        );

        let t0 = Instant::now();
        let load = Load::start(
            vec![("10.96.0.10", 80), ("10.96.0.30", 80), (VM_NODE_IP, 30080)],
            t0,
        );
        std::thread::sleep(Duration::from_millis(500));

        // ipvs -> nftables, with a connection opened through IPVS before.
        let mut via_ipvs = connect("10.96.0.10", 80).unwrap();
        let ipvs_rs = who(&mut via_ipvs).unwrap();
        let mut after_cut = None;
        let start1 = t0.elapsed().as_secs_f64();
        let out = drive(&mut d, ProxyMode::Nftables, &snap, || {
            after_cut = Some(who(&mut via_ipvs))
        });
        let end1 = t0.elapsed().as_secs_f64();
        let after_clean = who(&mut via_ipvs).map_err(|e| e.kind());
        println!(
            "VMTEST established through ipvs ({ipvs_rs}): after cut-over -> {after_cut:?}, after cleaning -> {after_clean:?}"
        );
        assert_eq!(after_cut.unwrap().unwrap(), ipvs_rs, "survives the cut-over");
        drop(via_ipvs);
        assert!(!crate::sys::link::exists(render::LINK).unwrap(), "swy-ipvs0 left");
        let sets = crate::sys::ipset::list_names("SWY-").unwrap();
        assert!(sets.is_empty(), "SWY-* sets left: {sets:?}");
        let services: Vec<String> = listing().lines().skip(3).map(str::to_owned).collect();
        assert!(services.is_empty(), "IPVS services left: {services:?}");
        let save = sh(&["iptables-legacy-save"]);
        assert!(!save.contains("SWY-"), "SWY chains left: {save}");
        for family in crate::model::IpFamily::ALL {
            assert!(
                crate::sys::nft::table_exists(family).unwrap(),
                "{family} switchyard table after the switch to nftables"
            );
        }
        println!(
            "VMTEST after leaving ipvs: no swy-ipvs0, no SWY-* ipsets, no IPVS services, no SWY-IPVS chains"
        );
        std::thread::sleep(Duration::from_millis(500));

        // nftables -> ipvs, with a connection opened through nftables before.
        let mut via_nft = connect("10.96.0.10", 80).unwrap();
        let nft_rs = who(&mut via_nft).unwrap();
        let mut after_cut = None;
        let start2 = t0.elapsed().as_secs_f64();
        let back = drive(&mut d, ProxyMode::Ipvs, &snap, || {
            after_cut = Some(who(&mut via_nft))
        });
        let end2 = t0.elapsed().as_secs_f64();
        let after_clean = who(&mut via_nft);
        println!(
            "VMTEST established through nftables ({nft_rs}): after cut-over -> {after_cut:?}, after cleaning -> {after_clean:?}"
        );
        assert_eq!(after_cut.unwrap().unwrap(), nft_rs, "survives the cut-over");
        assert_eq!(
            after_clean.unwrap(),
            nft_rs,
            "survives the nftables table's removal"
        );
        drop(via_nft);
        for family in crate::model::IpFamily::ALL {
            assert!(
                !crate::sys::nft::table_exists(family).unwrap(),
                "{family} switchyard nft table left"
            );
        }
        println!("VMTEST after leaving nftables: no switchyard nft table (ip, ip6)");
        assert_eq!(
            normalize_ipvsadm(&listing(), |_| true),
            include_str!("testdata/vm.ipvsadm"),
            "back on ipvs: the golden IPVS table"
        );
        std::thread::sleep(Duration::from_millis(500));
        let (attempts, failures) = load.stop();

        let window = |a: f64, b: f64| failures.iter().filter(|f| f.0 >= a && f.0 <= b).count();
        for (name, t, a, b) in [
            ("ipvs -> nftables", &out, start1, end1),
            ("nftables -> ipvs", &back, start2, end2),
        ] {
            println!(
                "VMTEST switch {name}: Succeeded in {} (prepare {}, cut-over {}, verifying {} with {} probe rounds from the node, {} failed, cleaning {}); {} failed connections during it",
                ms(t.total),
                ms(t.prepare),
                ms(t.cut_over),
                ms(t.verifying),
                t.rounds,
                t.failed_rounds,
                ms(t.cleaning),
                window(a, b)
            );
        }
        println!(
            "VMTEST switch load: {attempts} connections (TCP 10.96.0.10:80, 10.96.0.30:80, {VM_NODE_IP}:30080 from the client netns) over {:.1} s, {} failed{}",
            t0.elapsed().as_secs_f64(),
            failures.len(),
            if failures.is_empty() {
                String::new()
            } else {
                format!(": {failures:?}")
            }
        );
        assert!(attempts > 100, "the load ran: {attempts}");
        assert!(failures.is_empty(), "failed connections: {failures:?}");
        IpvsBackend::new(Variant::Legacy, vm_settings("rr"))
            .cleanup()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The VM scenario plus a UDP service on all three real servers.
    fn sh_snapshot() -> Snapshot {
        let mut s = vm_scenario();
        add(
            &mut s,
            port("spread", Protocol::Udp, "10.96.0.60", 53),
            vm_eps(3, UDP_PORT),
        );
        s
    }

    fn bench_snapshot(n: usize, shift: usize) -> Snapshot {
        let mut s = Snapshot::default();
        for i in 0..n {
            let name = format!("svc{i}");
            let cip = format!("10.100.{}.{}", i / 256, i % 256);
            let eps = vec![
                ep(&format!("10.244.1.{}", 10 + (i + shift) % 200), 8080, "other"),
                ep(&format!("10.244.2.{}", 10 + i % 200), 8080, "other"),
            ];
            add(&mut s, port(&name, Protocol::Tcp, &cip, 80), eps);
        }
        s
    }

    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_z_bench_sync_1k_and_10k_services() {
        let mut rows = Vec::new();
        for n in [1_000usize, 10_000] {
            let mut b = fresh("rr");
            let snap = bench_snapshot(n, 0);
            let t = Instant::now();
            let first = sync(&mut b, &snap, true);
            let initial = t.elapsed();
            let t = Instant::now();
            sync(&mut b, &snap, false);
            let noop = t.elapsed();
            // 1% of the services change one endpoint.
            let mut changed = snap.clone();
            for (k, eps) in changed.endpoints.iter_mut().take(n / 100) {
                let _ = k;
                eps[0].ip = Ipv4Addr::new(10, 244, 3, 1).into();
            }
            let t = Instant::now();
            let partial = sync(&mut b, &changed, false);
            let update = t.elapsed();
            let t = Instant::now();
            sync(&mut b, &changed, true);
            let resync = t.elapsed();
            let listed = listing().lines().filter(|l| l.starts_with("TCP ")).count();
            assert_eq!(listed, n);
            let t = Instant::now();
            b.cleanup().unwrap();
            let cleanup = t.elapsed();
            rows.push((
                n,
                first.objects_written,
                initial,
                noop,
                partial.objects_written,
                update,
                resync,
                cleanup,
            ));
        }
        println!("VMTEST bench (TCG guest, 1 vCPU; 2 real servers per service):");
        println!(
            "| services | initial sync | objects | no-op sync | 1% update | requests | full resync | cleanup |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for (n, objects, initial, noop, requests, update, resync, cleanup) in rows {
            println!(
                "| {n} | {:.2} s | {objects} | {:.0} ms | {:.0} ms | {requests} | {:.2} s | {:.2} s |",
                initial.as_secs_f64(),
                noop.as_secs_f64() * 1e3,
                update.as_secs_f64() * 1e3,
                resync.as_secs_f64(),
                cleanup.as_secs_f64()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Conformance: the generic suite on fake adapters (here, no root) and on the VM's kernel
// (`vm::conformance`), and the fake IPVS table against the kernel's answers.

use crate::backend::conformance::suite::{Kit, Subject};
use crate::model::IpFamily;
use crate::sys::KernelError;
use crate::sys::ipset::{FakeIpsets, IpsetError, SetSpec};
use crate::sys::iptables::fake::{FakeIptables, Faulty as FaultyIptables};
use crate::sys::ipvs::fake::{FakeIpvs, Faulty as FaultyIpvs};
use crate::sys::link::{FakeLinks, LinkError};
use crate::sys::sysctl::FakeSysctl;

/// Links with injected faults: the next `n` writes that change something fail.
#[derive(Debug)]
struct FaultyLinks<L> {
    inner: L,
    failing: usize,
}

impl<L: Links> FaultyLinks<L> {
    fn new(inner: L) -> Self {
        Self { inner, failing: 0 }
    }

    fn injected(&mut self, what: &str) -> Result<(), LinkError> {
        if self.failing == 0 {
            return Ok(());
        }
        self.failing -= 1;
        Err(LinkError {
            args: what.to_owned(),
            detail: "injected fault".into(),
        })
    }
}

impl<L: Links> Links for FaultyLinks<L> {
    fn exists(&self, name: &str) -> Result<bool, LinkError> {
        self.inner.exists(name)
    }

    fn ensure_dummy(&mut self, name: &str) -> Result<bool, LinkError> {
        self.injected("link add")?;
        self.inner.ensure_dummy(name)
    }

    fn delete(&mut self, name: &str) -> Result<bool, LinkError> {
        self.injected("link del")?;
        self.inner.delete(name)
    }

    fn addresses(&self, name: &str) -> Result<BTreeSet<Ipv4Addr>, LinkError> {
        self.inner.addresses(name)
    }

    fn all_addresses(&self) -> Result<Vec<(String, Ipv4Addr)>, LinkError> {
        self.inner.all_addresses()
    }

    fn update_addresses(
        &mut self,
        name: &str,
        add: &BTreeSet<Ipv4Addr>,
        remove: &BTreeSet<Ipv4Addr>,
    ) -> Result<(), LinkError> {
        if !add.is_empty() || !remove.is_empty() {
            self.injected("-batch")?;
        }
        self.inner.update_addresses(name, add, remove)
    }
}

/// ipsets with injected faults: the next `n` writes that change something fail.
#[derive(Debug)]
struct FaultyIpsets<P> {
    inner: P,
    failing: usize,
}

impl<P: Ipsets> FaultyIpsets<P> {
    fn new(inner: P) -> Self {
        Self { inner, failing: 0 }
    }

    fn injected(&mut self) -> Result<(), IpsetError> {
        if self.failing == 0 {
            return Ok(());
        }
        self.failing -= 1;
        Err(IpsetError::Failed {
            args: "restore".into(),
            stderr: "injected fault".into(),
        })
    }
}

impl<P: Ipsets> Ipsets for FaultyIpsets<P> {
    fn restore(&mut self, sets: &[&SetSpec]) -> Result<(), IpsetError> {
        if !sets.is_empty() {
            self.injected()?;
        }
        self.inner.restore(sets)
    }

    fn save_all(&self, prefix: &str) -> Result<BTreeMap<String, BTreeSet<String>>, IpsetError> {
        self.inner.save_all(prefix)
    }

    fn destroy(&mut self, names: &[String]) -> Result<(), IpsetError> {
        if !names.is_empty() {
            self.injected()?;
        }
        self.inner.destroy(names)
    }
}

/// The IPVS backend on adapters of one kind (fake or kernel), each with injected faults.
type SuiteBackend<I, T, P, L, S> =
    IpvsBackend<FaultyIptables<I>, FaultyIpvs<T>, FaultyIpsets<P>, FaultyLinks<L>, S>;

/// The independent parts of the IPVS cleanup, in its order: the virtual servers, the link, the
/// iptables chains (the ipsets go after them: the chains' references keep them while the chains
/// stay, so they are no part of their own when every part fails).
const CLEANUP_PARTS: usize = 3;

/// Writes the iptables part of the cleanup makes before it gives up: a refused restore is
/// retried jump rule by jump rule.
const IPTABLES_CLEANUP_WRITES: usize = 2;

/// Makes the next `n` parts of the backend's work fail, in the cleanup's order (see
/// [`CLEANUP_PARTS`]); one failure (`n == 1`) is the IPVS batch's.
fn fail_parts<I: SaveRestore, T: IpvsTable, P: Ipsets, L: Links, S: Sysctl>(
    b: &mut SuiteBackend<I, T, P, L, S>,
    n: usize,
) {
    assert!(
        n <= CLEANUP_PARTS,
        "the IPVS backend has {CLEANUP_PARTS} cleanup parts"
    );
    if n >= 1 {
        b.ipvs_table_mut().fail_next(1);
    }
    if n >= 2 {
        b.links_mut().failing = 1;
    }
    if n >= 3 {
        b.iptables_mut().fail_next(IPTABLES_CLEANUP_WRITES);
    }
}

/// The node's own address (the fixture's), on a link of its own, where NodePorts go.
const NODE_LINK: &str = "node0";

/// What the backend owns, normalised alike for the fake and the kernel: the IPVS listing
/// (`ipvsadm -Ln` text, canonical order, counters zeroed, without its header), the link and its
/// addresses, the `SWY-*` ipsets with their entries, and per iptables table our chains with
/// their rule counts and the jump rules into them.
fn owned_text(
    ipvsadm: &str,
    link: Option<&BTreeSet<Ipv4Addr>>,
    sets: &BTreeMap<String, BTreeSet<String>>,
    saves: [(&str, &str); 2],
) -> String {
    let mut out = String::new();
    for line in normalize_ipvsadm(ipvsadm, |_| true).lines().skip(3) {
        out.push_str(&format!("ipvs {line}\n"));
    }
    if let Some(addresses) = link {
        out.push_str(&format!("link {LINK}\n"));
        for a in addresses {
            out.push_str(&format!("link {LINK} {a}\n"));
        }
    }
    for (name, entries) in sets {
        out.push_str(&format!("ipset {name}\n"));
        for e in entries {
            out.push_str(&format!("ipset {name} {e}\n"));
        }
    }
    for (table, save) in saves {
        let mut chains: BTreeMap<&str, usize> = BTreeMap::new();
        let mut jumps: Vec<String> = Vec::new();
        for line in save.lines() {
            let mut words = line.split_whitespace();
            match words.next() {
                Some(decl) if decl.starts_with(":SWY-") => {
                    chains.entry(&decl[1..]).or_insert(0);
                }
                Some("-A") => {
                    let chain = words.next().unwrap_or_default();
                    let target = words.skip_while(|w| *w != "-j").nth(1).unwrap_or_default();
                    if chain.starts_with("SWY-") {
                        *chains.entry(chain).or_insert(0) += 1;
                    } else if target.starts_with("SWY-") {
                        jumps.push(format!("iptables {table} jump {chain} -> {target}"));
                    }
                }
                _ => {}
            }
        }
        jumps.sort();
        for (chain, rules) in chains {
            out.push_str(&format!("iptables {table} chain {chain} {rules} rules\n"));
        }
        for j in jumps {
            out.push_str(&j);
            out.push('\n');
        }
    }
    out
}

/// The fake table as `ipvsadm -Ln` lists it.
fn fake_listing(table: &FakeIpvs) -> String {
    let mut out = String::from(render::IPVSADM_HEADER);
    for (svc, dests) in table.table() {
        out.push_str(&render::service_line(svc));
        out.push('\n');
        for d in dests {
            let addr = std::net::SocketAddr::new(d.addr, d.port).to_string();
            out.push_str(&render::dest_line(&addr, "Masq", d.weight));
            out.push('\n');
        }
    }
    out
}

type FakeBackend = SuiteBackend<FakeIptables, FakeIpvs, FakeIpsets, FakeLinks, FakeSysctl>;

/// The IPVS backend on fakes, with the node's address on [`NODE_LINK`].
fn fake_backend(settings: Settings) -> FakeBackend {
    let mut links = FakeLinks::new();
    let node = fixtures_addr();
    links.ensure_dummy(NODE_LINK).expect("node link");
    links
        .update_addresses(NODE_LINK, &[node].into(), &BTreeSet::new())
        .expect("node address");
    IpvsBackend::with_adapters(
        settings,
        FaultyIptables::new(FakeIptables::new(IpFamily::V4)),
        FaultyIpvs::new(FakeIpvs::new()),
        FaultyIpsets::new(FakeIpsets::new()),
        FaultyLinks::new(links),
        FakeSysctl::new(),
    )
}

/// The conformance fixture's IPv4 node address.
fn fixtures_addr() -> Ipv4Addr {
    match crate::backend::conformance::fixtures::addr(IpFamily::V4, [10, 250, 0, 11]) {
        IpAddr::V4(a) => a,
        IpAddr::V6(_) => unreachable!("an IPv4 fixture address"),
    }
}

/// The IPVS backend on fakes.
struct FakeSubject(FakeBackend);

impl Subject for FakeSubject {
    type B = FakeBackend;
    fn backend(&mut self) -> &mut Self::B {
        &mut self.0
    }
    fn owned(&self) -> String {
        let b = &self.0;
        let links = &b.links().inner;
        let link = links
            .exists(LINK)
            .expect("links")
            .then(|| links.addresses(LINK).expect("addresses"));
        let sets = b.ipsets().inner.save_all("SWY-").expect("ipsets");
        let ipt = b.iptables().inner();
        let (filter, nat) = (
            ipt.save(Table::Filter).expect("save"),
            ipt.save(Table::Nat).expect("save"),
        );
        owned_text(
            &fake_listing(b.ipvs_table().inner()),
            link.as_ref(),
            &sets,
            [("filter", &filter), ("nat", &nat)],
        )
    }
    fn fail_writes(&mut self, n: usize) {
        fail_parts(&mut self.0, n);
    }
}

struct FakeKit;

impl Kit for FakeKit {
    type S = FakeSubject;
    fn with_subject<T: Send>(&self, f: impl FnOnce(&mut Self::S) -> T + Send) -> T {
        f(&mut FakeSubject(fake_backend(
            crate::backend::conformance::fixtures::settings(),
        )))
    }
    fn cleanup_parts(&self) -> usize {
        CLEANUP_PARTS
    }
}

/// The conformance suite on fake adapters (no root).
mod conformance_fake {
    crate::backend::conformance::suite::conformance_suite!(super::FakeKit);
}

/// One probe of how an IPVS table refuses requests: each op alone, in order, with the errno of
/// its typed refusal (0: applied). The same script runs on the kernel in the VM
/// (`vm::conformance::ipvs_table_refuses_as_the_fake_does`).
fn refusal_script() -> Vec<(Op, i32)> {
    use crate::sys::error::{EEXIST, ENOENT};
    let vaddr = |port: u16| VirtualAddr {
        protocol: crate::sys::ipvs::Protocol::Tcp,
        addr: IpAddr::V4(ip("10.96.7.1")),
        port,
    };
    let svc = |port: u16, scheduler: &str| crate::sys::ipvs::Service {
        addr: vaddr(port),
        scheduler: scheduler.into(),
        flags: 0,
        timeout: 0,
    };
    let (a, b) = (vaddr(80), vaddr(81));
    let real =
        |last: u8, weight: u32| Destination::masq(IpAddr::V4(Ipv4Addr::new(10, 244, 7, last)), 8080, weight);
    let sticky = crate::sys::ipvs::Service {
        flags: crate::sys::ipvs::FLAG_PERSISTENT,
        timeout: 300,
        ..svc(80, "wrr")
    };
    vec![
        (Op::AddService(svc(80, "rr")), 0),
        (Op::AddService(svc(80, "rr")), EEXIST),
        (Op::AddService(svc(81, "nope")), ENOENT),
        (Op::UpdateService(svc(81, "rr")), ENOENT),
        (Op::DeleteService(b), ENOENT),
        (Op::AddDest(b, real(1, 1)), ENOENT),
        (Op::AddDest(a, real(1, 1)), 0),
        (Op::AddDest(a, real(1, 1)), EEXIST),
        (Op::UpdateDest(a, real(2, 1)), ENOENT),
        (Op::DeleteDest(a, real(2, 1).addr, 8080), ENOENT),
        (Op::UpdateDest(a, real(1, 0)), 0),
        (Op::AddDest(a, real(3, 1)), 0),
        (Op::DeleteDest(a, real(3, 1).addr, 8080), 0),
        (Op::UpdateService(svc(80, "nope")), ENOENT),
        (Op::UpdateService(sticky), 0),
    ]
}

/// Runs [`refusal_script`] on `table`: the errno of each op (0: applied), then the table's
/// services and the real servers of the probed services (the missing one has none), and finally
/// deletes what it made.
fn run_refusal_script(table: &mut impl IpvsTable) -> (Vec<i32>, String) {
    let errnos = refusal_script()
        .into_iter()
        .map(|(op, _)| match table.apply(&[op]).expect("apply").pop() {
            Some((_, e)) => e.errno().unwrap_or(-1),
            None => 0,
        })
        .collect();
    let mut state = String::new();
    for (key, svc) in table.services().expect("services") {
        state.push_str(&format!("{key:?} {svc:?}\n"));
        if let ServiceKey::Addr(v) = key {
            for d in table.destinations(&v).expect("destinations") {
                state.push_str(&format!("  {d:?}\n"));
            }
        }
    }
    let missing = VirtualAddr {
        protocol: crate::sys::ipvs::Protocol::Tcp,
        addr: IpAddr::V4(ip("10.96.7.1")),
        port: 81,
    };
    assert_eq!(table.destinations(&missing).expect("dump").len(), 0);
    let first = refusal_script().remove(0).0;
    if let Op::AddService(s) = first {
        assert!(
            table
                .apply(&[Op::DeleteService(s.addr)])
                .expect("apply")
                .is_empty()
        );
    }
    (errnos, state)
}

#[test]
fn fake_ipvs_refuses_as_the_kernel_does() {
    let want: Vec<i32> = refusal_script().into_iter().map(|(_, errno)| errno).collect();
    let (got, state) = run_refusal_script(&mut FakeIpvs::new());
    assert_eq!(got, want);
    assert!(
        state.contains("scheduler: \"wrr\", flags: 1, timeout: 300")
            && state.contains("weight: 0")
            && state.lines().count() == 2,
        "{state}"
    );
    // Typed: a missing service (the kernel's ESRCH) is "not found" as a missing destination is.
    assert!(crate::sys::ipvs::refusal("DEL_SERVICE", -3).is_not_found());
    assert!(matches!(
        crate::sys::ipvs::refusal("NEW_SERVICE", -17),
        KernelError::Exists { .. }
    ));
}

/// Graceful termination on the fakes: a TCP real server that leaves with open connections stays
/// at weight 0 until they end; a UDP one goes at once.
#[test]
fn fake_ipvs_graceful_termination_waits_for_active_connections() {
    let mut b = fake_backend(settings());
    let mut snap = Snapshot::default();
    let tcp = port("web", Protocol::Tcp, "10.96.0.40", 80);
    let udp = port("dns", Protocol::Udp, "10.96.0.41", 53);
    add(
        &mut snap,
        tcp.clone(),
        vec![ep("10.244.1.40", 8080, REMOTE), ep("10.244.2.40", 8080, REMOTE)],
    );
    add(
        &mut snap,
        udp.clone(),
        vec![ep("10.244.1.41", 53, REMOTE), ep("10.244.2.41", 53, REMOTE)],
    );
    let sync = |b: &mut FakeBackend, s: &Snapshot, full: bool| {
        b.sync(&DualSnapshot::from(s.clone()), &Changes::default(), full)
            .expect("sync")
    };
    sync(&mut b, &snap, true);
    let web = VirtualAddr {
        protocol: crate::sys::ipvs::Protocol::Tcp,
        addr: IpAddr::V4(ip("10.96.0.40")),
        port: 80,
    };
    let dns = VirtualAddr {
        protocol: crate::sys::ipvs::Protocol::Udp,
        addr: IpAddr::V4(ip("10.96.0.41")),
        port: 53,
    };
    let (gone_tcp, gone_udp) = (IpAddr::V4(ip("10.244.2.40")), IpAddr::V4(ip("10.244.2.41")));
    let table = b.ipvs_table_mut().inner_mut();
    assert!(table.set_connections(&web, gone_tcp, 8080, 3, 1));
    assert!(table.set_connections(&dns, gone_udp, 53, 5, 0));
    for (name, eps) in snap.endpoints.iter_mut() {
        if *name == tcp.name || *name == udp.name {
            eps.pop();
        }
    }
    sync(&mut b, &snap, false);
    let weights = |b: &FakeBackend, v: &VirtualAddr| -> Vec<(IpAddr, u32)> {
        b.ipvs_table()
            .destinations(v)
            .expect("dump")
            .into_iter()
            .map(|d| (d.addr, d.weight))
            .collect()
    };
    assert_eq!(
        weights(&b, &web),
        [(IpAddr::V4(ip("10.244.1.40")), 1), (gone_tcp, 0)]
    );
    assert_eq!(
        weights(&b, &dns),
        [(IpAddr::V4(ip("10.244.1.41")), 1)],
        "UDP goes at once"
    );
    assert_eq!(
        b.terminating().iter().collect::<Vec<_>>(),
        [&(web, gone_tcp, 8080)]
    );
    assert_eq!(b.verify().expect("verify"), Vec::<String>::new());
    // Still open at the next sync: kept; closed: deleted at the sync after.
    sync(&mut b, &snap, false);
    assert_eq!(weights(&b, &web).len(), 2);
    b.ipvs_table_mut()
        .inner_mut()
        .set_connections(&web, gone_tcp, 8080, 0, 4);
    sync(&mut b, &snap, false);
    assert_eq!(weights(&b, &web), [(IpAddr::V4(ip("10.244.1.40")), 1)]);
    assert!(b.terminating().is_empty());
    assert_eq!(b.verify().expect("verify"), Vec::<String>::new());
}
