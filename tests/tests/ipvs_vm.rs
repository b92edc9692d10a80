//! The IPVS tier: `scripts/ipvs-vm.sh` boots a Debian kernel with `ip_vs` under qemu (TCG) and
//! runs the agent's IPVS tests inside it with real TCP and UDP between network namespaces
//! (ClusterIP, NodePort, rr and sh spreading, session affinity, no-endpoint rejects, graceful
//! termination, service deletion, cleanup that spares foreign IPVS services, the capability probe,
//! `ipvsadm -Ln` against the golden render, the bypass (new connections refused, objects and open
//! connections kept), the agent's switch driver moving the node ipvs -> nftables -> ipvs under a
//! client load with zero failed connections and no leftovers, and the 1k/10k sync benchmark).
//! The backend conformance suite runs there too on the kernel's adapters (each case in its own
//! network namespace), with the fake adapters checked against the kernel: the same end state
//! after full and partial syncs, and the same typed refusals from the IPVS table.
//!
//! The same run carries the SCTP tier (this host kernel has no SCTP): for the nftables and the
//! iptables (legacy) backends, real SCTP associations from a client namespace to an SCTP ClusterIP
//! and an SCTP NodePort, each with two server namespaces as endpoints, must reach both servers; for
//! a service without endpoints the node must answer every INIT with ICMP protocol unreachable,
//! which SCTP takes as an ABORT (RFC 4960 appendix C), so a default socket is refused well within a
//! second; cleanup must leave no switchyard objects.
//!
//! This host kernel has no IPVS, so this test never skips: when the VM cannot be prepared or
//! booted it fails with one line saying why.

use std::{collections::BTreeMap, process::Command};

use switchyard_e2e::stats::{SPREAD_2, check_uniform};

/// Lines of the VM's output that must be present when the run passes.
const MUST_SHOW: [&str; 35] = [
    "VMTEST probe: kernel 6.1.0-57-amd64 ipvs usable=true",
    "VMTEST ipvsadm -Ln matches testdata/vm.ipvsadm",
    "VMTEST ClusterIP TCP rr:",
    "VMTEST ClusterIP UDP rr:",
    "VMTEST NodePort",
    "VMTEST ClientIP affinity",
    "VMTEST sh: source -> real server",
    "VMTEST no endpoints: TCP Err(ConnectionRefused), UDP Err(ConnectionRefused)",
    "VMTEST open connection still answered by",
    "VMTEST service deleted",
    "VMTEST cleanup: foreign services kept",
    "| 10000 |",
    // The bypass (vm_j) and the live mode switch off IPVS and back (vm_k).
    "VMTEST bypass on (",
    "ms): new TCP Err(ConnectionRefused), NodePort Err(ConnectionRefused), UDP Err(ConnectionRefused); open connection -> Ok(",
    "VMTEST bypass off (",
    "VMTEST switch ipvs -> nftables: Succeeded in ",
    "VMTEST switch nftables -> ipvs: Succeeded in ",
    "VMTEST after leaving ipvs: no swy-ipvs0, no SWY-* ipsets, no IPVS services, no SWY-IPVS chains",
    "VMTEST after leaving nftables: no switchyard nft table (ip, ip6)",
    "VMTEST switch load: ",
    // SCTP through the nftables and iptables backends (the numbers are checked below).
    "VMTEST sctp nftables spread: ClusterIP ",
    "VMTEST sctp nftables no endpoints: ClusterIP Err(Os(ENOPROTOOPT)) in ",
    "VMTEST sctp nftables cleanup: 0 switchyard objects left",
    "VMTEST sctp iptables spread: ClusterIP ",
    "VMTEST sctp iptables no endpoints: ClusterIP Err(Os(ENOPROTOOPT)) in ",
    "VMTEST sctp iptables cleanup: 0 switchyard objects left",
    // The conformance suite on the kernel (libtest's line for each case: a failing case fails
    // the run's exit status, so its presence shows it ran and passed), and the fake against it.
    "test backend::ipvs::tests::vm::conformance::cleanup_before_sync ... ",
    "test backend::ipvs::tests::vm::conformance::full_equals_partial ... ",
    "test backend::ipvs::tests::vm::conformance::failure_forces_full_resync ... ",
    "test backend::ipvs::tests::vm::conformance::bypass_survives_sync ... ",
    "test backend::ipvs::tests::vm::conformance::verify_empty_after_sync ... ",
    "test backend::ipvs::tests::vm::conformance::cleanup_twice_leaves_nothing ... ",
    "test backend::ipvs::tests::vm::conformance::cleanup_collects_every_error ... ",
    "VMTEST conformance: fake and kernel IPVS agree after full and partial syncs",
    "VMTEST conformance: IPVS table refusals [0, 17, 2, 2, 2, 2, 0, 17, 2, 2, 0, 0, 0, 2, 0] equal the fake's",
];

/// Lines of the `proxy.ipvs` cases (`backend::ipvs::tests::vm::settings`, and strictARP in
/// `runtime::sysctls`): each field set through the backend's settings and read back from the kernel.
const SETTINGS_MUST_SHOW: [&str; 4] = [
    "VMTEST settings scheduler: 13 schedulers [\"rr\", \"wrr\", \"lc\", \"wlc\", \"lblc\", \"lblcr\", \"sh\", \"dh\", \"sed\", \"nq\", \"fo\", \"ovf\", \"mh\"] each on all ",
    "VMTEST settings timeouts: GET_CONFIG Timeouts { tcp: 900, tcp_fin: 120, udp: 300 } -> Timeouts { tcp: 3600, tcp_fin: 120, udp: 45 } (tcpFin 0 left alone); ipvsadm: Timeout (tcp tcpfin udp): 3600 120 45",
    "VMTEST settings excludeCIDRs: 10.96.9.9:80 unchanged after sync and cleanup",
    "VMTEST strictARP: arp_ignore/arp_announce (0, 1) -> (1, 2) while IPVS serves with it; (0, 1) again when the policy stops asking and after --cleanup",
];

/// The SCTP servers (`sctp_vm_tests::SERVERS`).
const SCTP_SERVERS: [&str; 2] = ["sctp-ep1", "sctp-ep2"];

/// One destination of an SCTP spread line: `ClusterIP 10.96.1.10:7000 24 associations ->
/// sctp-ep1=13 sctp-ep2=11`, as (kind, associations, answers per server).
type Spread = (String, usize, Vec<(String, usize)>);

/// The destinations of `VMTEST sctp <backend> spread: <dest>; <dest> (...)`.
fn sctp_spread(stdout: &str, backend: &str) -> Option<Vec<Spread>> {
    let prefix = format!("VMTEST sctp {backend} spread: ");
    // The first line of a test's output follows libtest's `test <name> ... `.
    let line = stdout
        .lines()
        .find_map(|l| l.split_once(prefix.as_str()).map(|(_, rest)| rest))?;
    let line = line.split(" (").next()?;
    line.split("; ")
        .map(|dest| {
            let (head, answers) = dest.split_once(" -> ")?;
            let mut words = head.split_whitespace();
            let kind = words.next()?.to_owned();
            let associations = words.nth(1)?.parse().ok()?;
            let answers = answers
                .split_whitespace()
                .map(|a| {
                    let (server, n) = a.split_once('=')?;
                    Some((server.to_owned(), n.parse().ok()?))
                })
                .collect::<Option<Vec<_>>>()?;
            Some((kind, associations, answers))
        })
        .collect()
}

/// The milliseconds after `what` (`ClusterIP Err(Os(ENOPROTOOPT)) in `) on the line containing
/// `prefix`.
fn millis_after(stdout: &str, prefix: &str, what: &str) -> Option<u64> {
    let line = stdout.lines().find(|l| l.contains(prefix))?;
    let rest = line.split_once(what)?.1;
    rest.split_whitespace().next()?.parse().ok()
}

/// The switch test's summary: `VMTEST switch load: N connections (...) over S s, F failed`.
fn switch_load(stdout: &str) -> Option<(usize, usize)> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("VMTEST switch load: "))?;
    let attempts = line.split_whitespace().next()?.parse().ok()?;
    let failed = line
        .split_once(" s, ")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((attempts, failed))
}

/// The SCTP spread of `backend` in the VM's output: both destinations, both servers, every
/// association answered, and the answers spread uniformly.
///
/// Each new association picks one of the 2 endpoints at random: over SPREAD_2 = 500 associations
/// `stats::check_uniform` accepts [194, 306] per endpoint, which a uniform choice leaves with
/// probability <= 1e-6 (exact binomial tails), and fails a 2:1 skew with probability >= 0.99 and
/// an endpoint never chosen always (stats unit tests). (24 associations checked for "both > 0"
/// caught only the never-chosen case.)
fn check_sctp_spread(stdout: &str, backend: &str) -> Result<(), String> {
    let spread = sctp_spread(stdout, backend);
    let kinds: Vec<&str> = spread
        .iter()
        .flatten()
        .map(|(kind, _, _)| kind.as_str())
        .collect();
    if kinds != ["ClusterIP", "NodePort"] {
        return Err(format!("sctp {backend} spread: {spread:?}"));
    }
    for (kind, associations, answers) in spread.iter().flatten() {
        let servers: Vec<&str> = answers.iter().map(|(s, _)| s.as_str()).collect();
        if servers != SCTP_SERVERS {
            return Err(format!("sctp {backend} {kind}: {answers:?}"));
        }
        if (*associations as u64) < SPREAD_2 {
            return Err(format!(
                "sctp {backend} {kind}: {associations} associations, fewer than the {SPREAD_2} the \
                 spread check is sized for"
            ));
        }
        if answers.iter().map(|(_, n)| n).sum::<usize>() != *associations {
            return Err(format!(
                "sctp {backend} {kind}: not every association answered: {answers:?}"
            ));
        }
        let tally: BTreeMap<String, usize> = answers.iter().cloned().collect();
        check_uniform(&tally, &SCTP_SERVERS).map_err(|e| format!("sctp {backend} {kind}: spread: {e}"))?;
    }
    Ok(())
}

#[test]
fn ipvs_backend_in_a_debian_kernel_vm() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/ipvs-vm.sh");
    let out = match Command::new("bash").arg(script).output() {
        Ok(out) => out,
        Err(e) => panic!("IPVS VM tier: cannot run {script}: {e}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The whole console goes to the test's output (shown on failure, or with --nocapture).
    println!("{stdout}");
    eprintln!("{stderr}");
    let verdict = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("IPVS-VM"))
        .unwrap_or("IPVS-VM: no verdict line from scripts/ipvs-vm.sh")
        .to_owned();
    assert!(
        out.status.success(),
        "IPVS VM tier failed (exit {:?}): {verdict}",
        out.status.code()
    );
    let missing: Vec<&str> = MUST_SHOW
        .iter()
        .chain(&SETTINGS_MUST_SHOW)
        .copied()
        .filter(|m| !stdout.contains(m))
        .collect();
    assert!(
        missing.is_empty(),
        "IPVS VM tier passed but did not show {missing:?}: {verdict}"
    );
    // Off IPVS and back under load: every connection answered, in both directions.
    let load = switch_load(&stdout);
    assert!(
        matches!(load, Some((attempts, 0)) if attempts > 100),
        "switch under load: (connections, failed) = {load:?}"
    );
    // SCTP: every association answered, by both servers, through the ClusterIP and the NodePort;
    // a service without endpoints refuses a default socket (ENOPROTOOPT: aborted) within a second.
    for backend in ["nftables", "iptables"] {
        if let Err(e) = check_sctp_spread(&stdout, backend) {
            panic!("{e}");
        }
        let prefix = format!("VMTEST sctp {backend} no endpoints: ");
        for kind in ["ClusterIP", "NodePort"] {
            let ms = millis_after(&stdout, &prefix, &format!("{kind} Err(Os(ENOPROTOOPT)) in "));
            assert!(
                matches!(ms, Some(ms) if ms < 1000),
                "sctp {backend} no-endpoint {kind} refused in {ms:?} ms"
            );
        }
    }
    for direction in ["ipvs -> nftables", "nftables -> ipvs"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("VMTEST switch {direction}: Succeeded")))
            .unwrap_or_default();
        assert!(
            line.ends_with("; 0 failed connections during it"),
            "switch {direction}: {line}"
        );
    }
}

/// The SCTP line parsers on lines as the VM prints them (the first one after libtest's prefix).
#[test]
fn sctp_lines_parse() {
    let out = "test backend::sctp_vm_tests::vm_sctp_nftables ... VMTEST sctp nftables spread: \
        ClusterIP 10.96.1.10:7000 24 associations -> sctp-ep1=5 sctp-ep2=19; NodePort \
        10.0.2.1:30132 24 associations -> sctp-ep1=19 sctp-ep2=5 (5 ms per association; 37 rules)\n\
        VMTEST sctp nftables no endpoints: ClusterIP Err(Os(ENOPROTOOPT)) in \
        57 ms, NodePort Err(Os(ENOPROTOOPT)) in 54 ms (2 ICMP received)\n";
    let answers = |a: usize, b: usize| vec![("sctp-ep1".to_owned(), a), ("sctp-ep2".to_owned(), b)];
    assert_eq!(
        sctp_spread(out, "nftables"),
        Some(vec![
            ("ClusterIP".to_owned(), 24, answers(5, 19)),
            ("NodePort".to_owned(), 24, answers(19, 5)),
        ])
    );
    assert_eq!(sctp_spread(out, "iptables"), None);
    let prefix = "VMTEST sctp nftables no endpoints: ";
    assert_eq!(
        millis_after(out, prefix, "NodePort Err(Os(ENOPROTOOPT)) in "),
        Some(54)
    );
}

/// The host-side SCTP spread check on lines shaped as the VM prints them.
#[test]
fn sctp_spread_check_takes_uniform_answers_and_rejects_skews() {
    let line = |a: usize, b: usize, c: usize, d: usize| {
        format!(
            "VMTEST sctp nftables spread: ClusterIP 10.96.1.10:7000 {} associations -> sctp-ep1={a} \
             sctp-ep2={b}; NodePort 10.0.2.1:30132 {} associations -> sctp-ep1={c} sctp-ep2={d} (5 ms \
             per association; 37 rules)\n",
            a + b,
            c + d
        )
    };
    assert_eq!(check_sctp_spread(&line(251, 249, 230, 270), "nftables"), Ok(()));
    // A 2:1 skew, an endpoint never chosen, too few associations, the other backend's line.
    assert!(check_sctp_spread(&line(333, 167, 250, 250), "nftables").is_err());
    assert!(check_sctp_spread(&line(250, 250, 500, 0), "nftables").is_err());
    assert!(check_sctp_spread(&line(12, 12, 12, 12), "nftables").is_err());
    assert!(check_sctp_spread(&line(250, 250, 250, 250), "iptables").is_err());
}
