//! The IPVS tier: `scripts/ipvs-vm.sh` boots a Debian kernel with `ip_vs` under qemu (TCG) and
//! runs the agent's IPVS tests inside it with real TCP and UDP between network namespaces
//! (ClusterIP, NodePort, rr and sh spreading, session affinity, no-endpoint rejects, graceful
//! termination, service deletion, cleanup that spares foreign IPVS services, the capability probe,
//! `ipvsadm -Ln` against the golden render, the bypass (new connections refused, objects and open
//! connections kept), the agent's switch driver moving the node ipvs -> nftables -> ipvs under a
//! client load with zero failed connections and no leftovers, and the 1k/10k sync benchmark).
//!
//! This host kernel has no IPVS, so this test never skips: when the VM cannot be prepared or
//! booted it fails with one line saying why.

use std::process::Command;

/// Lines of the VM's output that must be present when the run passes.
const MUST_SHOW: [&str; 20] = [
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
    "VMTEST after leaving nftables: no switchyard nft table",
    "VMTEST switch load: ",
];

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
