//! `proxy.ipvs` on the VM's kernel, each field set through the backend's settings (taken in
//! place, as a live settings switch hands them over) and read back from the kernel with its own
//! tools: every scheduler the probe reports on every virtual server (`ipvsadm -Ln`; an open
//! connection and its real server's counter survive, so it was `SET_SERVICE`), the timeouts with
//! `GET_CONFIG` and `ipvsadm -L --timeout`, and a virtual server in `excludeCIDRs` unchanged after
//! sync and cleanup. strictARP's sysctls are the runtime's (`runtime::sysctls::tests::vm_*`).

use super::*;
use crate::sys::ipvs::{IpvsTable, KernelIpvs, Timeouts};

/// `(address:port, scheduler)` of every virtual server in a raw `ipvsadm -Ln` listing.
fn schedulers(listing: &str) -> Vec<(String, String)> {
    listing
        .lines()
        .filter(|l| l.starts_with("TCP ") || l.starts_with("UDP ") || l.starts_with("SCTP "))
        .filter_map(|l| {
            let mut words = l.split_whitespace().skip(1);
            Some((words.next()?.to_owned(), words.next()?.to_owned()))
        })
        .collect()
}

/// The active connections of real server `real` of virtual server `service`, from `ipvsadm -Ln`.
fn active_conns(service: &str, real: &str) -> Option<u32> {
    real_line(&listing(), service, real)?
        .split_whitespace()
        .nth(4)?
        .parse()
        .ok()
}

fn take(b: &mut IpvsBackend, edit: impl FnOnce(&mut Settings)) {
    let mut next = b.settings().clone();
    edit(&mut next);
    assert!(b.take_settings(&next), "IPVS takes settings in place");
}

#[test]
#[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
fn vm_settings_every_scheduler_reaches_the_existing_virtual_servers() {
    let mut b = fresh("rr");
    let snap = vm_scenario();
    sync(&mut b, &snap, true);
    let caps = crate::probe::decide(&crate::probe::HostFacts::gather());
    // Every scheduler but `twos` (kernel 6.2), all in the initramfs.
    let shipped: Vec<&str> = crate::probe::IPVS_SCHEDULERS
        .into_iter()
        .filter(|s| *s != "twos")
        .collect();
    assert_eq!(caps.ipvs_schedulers, shipped, "the 6.1 kernel's schedulers");
    let mut open = connect("10.96.0.10", 80).expect("connect");
    let first = who(&mut open).expect("answer");
    let real = real_addr(&first);
    assert_eq!(active_conns("TCP  10.96.0.10:80", real), Some(1));
    let services = schedulers(&listing()).len();
    for scheduler in &caps.ipvs_schedulers {
        let changed = b.settings().ipvs.scheduler != *scheduler;
        take(&mut b, |s| s.ipvs.scheduler.clone_from(scheduler));
        let stats = sync(&mut b, &snap, false);
        assert_eq!(stats.full, changed, "new settings: a full sync");
        let listed = schedulers(&listing());
        assert_eq!(listed.len(), services, "{listed:?}");
        for (vs, sched) in &listed {
            assert_eq!(sched, scheduler, "{vs}");
        }
        assert_eq!(b.verify().unwrap(), Vec::<String>::new(), "{scheduler}");
    }
    assert_eq!(
        active_conns("TCP  10.96.0.10:80", real),
        Some(1),
        "the real server and its connection stayed (SET_SERVICE, no re-creation)"
    );
    assert_eq!(who(&mut open).expect("still answered"), first);
    println!(
        "VMTEST settings scheduler: {} schedulers {:?} each on all {services} virtual servers in place \
         (open connection kept on {first})",
        caps.ipvs_schedulers.len(),
        caps.ipvs_schedulers
    );
    drop(open);
    b.cleanup().unwrap();
}

#[test]
#[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
fn vm_settings_timeouts_reach_the_kernel() {
    let mut b = fresh("rr");
    let table = KernelIpvs::new();
    let before = table.timeouts().unwrap();
    assert_eq!(
        before,
        Timeouts::KERNEL_DEFAULT,
        "GET_CONFIG: the kernel's defaults"
    );
    let snap = vm_scenario();
    sync(&mut b, &snap, true);
    assert_eq!(table.timeouts().unwrap(), before, "none asked: left alone");
    take(&mut b, |s| {
        s.ipvs.timeouts = Timeouts {
            tcp: 3600,
            tcp_fin: 0,
            udp: 45,
        };
    });
    sync(&mut b, &snap, false);
    let after = table.timeouts().unwrap();
    assert_eq!(
        after,
        Timeouts {
            tcp: 3600,
            tcp_fin: 120,
            udp: 45
        }
    );
    let shown = sh(&["ipvsadm", "-L", "--timeout"]);
    assert!(shown.contains("3600 120 45"), "{shown}");
    assert_eq!(b.verify().unwrap(), Vec::<String>::new());
    println!(
        "VMTEST settings timeouts: GET_CONFIG {before:?} -> {after:?} (tcpFin 0 left alone); ipvsadm: {}",
        shown.trim()
    );
    b.cleanup().unwrap();
    // The root namespace's table serves the later tests: its defaults back.
    let mut table = table;
    table.set_timeouts(&Timeouts::KERNEL_DEFAULT).unwrap();
}

#[test]
#[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
fn vm_settings_excluded_virtual_server_survives_sync_and_cleanup() {
    let mut b = fresh("rr");
    take(&mut b, |s| {
        s.ipvs.exclude_cidrs = vec!["10.96.9.0/24".parse().unwrap()]
    });
    sh(&["ipvsadm", "-A", "-t", "10.96.9.9:80", "-s", "wlc"]);
    sh(&[
        "ipvsadm",
        "-a",
        "-t",
        "10.96.9.9:80",
        "-r",
        "10.244.3.13:8080",
        "-m",
        "-w",
        "3",
    ]);
    let theirs = || block(&listing(), "TCP  10.96.9.9:80");
    let before = theirs();
    // A Service on that address too: bound on our link, which alone would make it ours.
    let mut snap = vm_scenario();
    add(
        &mut snap,
        port("excluded", Protocol::Tcp, "10.96.9.9", 80),
        vm_eps(1, TCP_PORT),
    );
    sync(&mut b, &snap, true);
    assert!(
        crate::sys::link::addresses(render::LINK)
            .unwrap()
            .contains(&ip("10.96.9.9"))
    );
    assert_eq!(theirs(), before, "full sync");
    sync(&mut b, &vm_scenario(), false);
    assert_eq!(theirs(), before, "partial sync that drops the Service");
    sync(&mut b, &snap, true);
    b.cleanup().unwrap();
    let left = schedulers(&listing());
    assert_eq!(left, [("10.96.9.9:80".to_owned(), "wlc".to_owned())], "cleanup");
    assert_eq!(theirs(), before, "cleanup");
    println!("VMTEST settings excludeCIDRs: 10.96.9.9:80 unchanged after sync and cleanup: {before:?}");
    sh(&["ipvsadm", "-D", "-t", "10.96.9.9:80"]);
}
