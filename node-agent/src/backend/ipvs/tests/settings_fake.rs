//! IPVS settings on the fake adapters (no root): what the policy's `proxy.ipvs` asks for reaches
//! the table once the backend takes it in place, at its next sync (full, whatever was asked):
//! every scheduler by `SET_SERVICE` on the existing virtual servers (their real servers and
//! connections stay), the timeouts by `SET_CONFIG` (a 0 leaves one alone), and `excludeCIDRs`
//! keeps a virtual server out of sync and cleanup even when its address is bound on our link.

use super::*;
use crate::sys::ipvs::Timeouts;
use crate::sys::ipvs::fake::SCHEDULERS;

fn web() -> VirtualAddr {
    VirtualAddr {
        protocol: crate::sys::ipvs::Protocol::Tcp,
        addr: IpAddr::V4(ip("10.96.0.40")),
        port: 80,
    }
}

fn snapshot() -> Snapshot {
    let mut snap = Snapshot::default();
    add(
        &mut snap,
        port("web", Protocol::Tcp, "10.96.0.40", 80),
        vec![ep("10.244.1.40", 8080, REMOTE), ep("10.244.2.40", 8080, REMOTE)],
    );
    add(
        &mut snap,
        port("dns", Protocol::Udp, "10.96.0.41", 53),
        vec![ep("10.244.1.41", 53, REMOTE)],
    );
    snap
}

fn sync(b: &mut FakeBackend, snap: &Snapshot, full: bool) -> SyncStats {
    b.sync(&DualSnapshot::from(snap.clone()), &Changes::default(), full)
        .expect("sync")
}

/// The scheduler of every virtual server in the fake table.
fn schedulers(b: &FakeBackend) -> Vec<String> {
    b.ipvs_table()
        .services()
        .expect("dump")
        .into_iter()
        .filter_map(|(_, s)| s.map(|s| s.scheduler))
        .collect()
}

#[test]
fn every_scheduler_reaches_the_existing_virtual_servers_in_place() {
    let mut b = fake_backend(settings());
    let snap = snapshot();
    sync(&mut b, &snap, true);
    let rs = IpAddr::V4(ip("10.244.1.40"));
    assert!(
        b.ipvs_table_mut()
            .inner_mut()
            .set_connections(&web(), rs, 8080, 2, 1)
    );
    for scheduler in SCHEDULERS {
        let mut next = b.settings().clone();
        let changed = next.ipvs.scheduler != scheduler;
        next.ipvs.scheduler = scheduler.into();
        assert!(b.take_settings(&next), "IPVS takes settings in place");
        let stats = sync(&mut b, &snap, false);
        assert_eq!(
            stats.full, changed,
            "{scheduler}: new settings make the next sync full"
        );
        assert_eq!(schedulers(&b), [scheduler; 2], "{scheduler}");
        let kept = b.ipvs_table().destinations(&web()).expect("dump");
        assert!(
            kept.iter().any(|d| d.addr == rs && d.active_conns == 2),
            "{scheduler}: the real servers and their connections stay (SET_SERVICE): {kept:?}"
        );
        assert_eq!(b.verify().expect("verify"), Vec::<String>::new(), "{scheduler}");
    }
    // The same settings again change nothing: a partial sync stays partial.
    let same = b.settings().clone();
    assert!(b.take_settings(&same));
    assert!(!sync(&mut b, &snap, false).full);
}

#[test]
fn timeouts_reach_the_table_and_a_zero_leaves_one_alone() {
    let mut b = fake_backend(settings());
    let snap = snapshot();
    sync(&mut b, &snap, true);
    assert_eq!(
        b.ipvs_table().timeouts().expect("get"),
        Timeouts::KERNEL_DEFAULT,
        "no timeouts asked: the kernel's stay"
    );
    let mut next = b.settings().clone();
    next.ipvs.timeouts = Timeouts {
        tcp: 3600,
        tcp_fin: 0,
        udp: 45,
    };
    assert!(b.take_settings(&next));
    sync(&mut b, &snap, false);
    let want = Timeouts {
        tcp: 3600,
        tcp_fin: 120,
        udp: 45,
    };
    assert_eq!(b.ipvs_table().timeouts().expect("get"), want);
    assert_eq!(b.verify().expect("verify"), Vec::<String>::new());
    // Changed behind our back: drift, repaired by the next full sync.
    b.ipvs_table_mut()
        .inner_mut()
        .set_timeouts(&Timeouts {
            udp: 300,
            ..Timeouts::default()
        })
        .expect("set");
    let drift = b.verify().expect("verify");
    assert!(drift.iter().any(|d| d.contains("IPVS timeouts")), "{drift:?}");
    sync(&mut b, &snap, true);
    assert_eq!(b.ipvs_table().timeouts().expect("get"), want);
    // A refused write fails the sync, which stays full until it succeeds.
    next.ipvs.timeouts.tcp_fin = crate::sys::ipvs::fake::MAX_TIMEOUT + 1;
    assert!(b.take_settings(&next));
    assert!(
        b.sync(&DualSnapshot::from(snap.clone()), &Changes::default(), false)
            .is_err()
    );
}

#[test]
fn excluded_virtual_servers_are_left_alone_by_sync_and_cleanup() {
    let mut s = settings();
    s.ipvs.exclude_cidrs = vec!["10.96.9.0/24".parse().expect("net")];
    let mut b = fake_backend(s);
    let excluded = VirtualAddr {
        protocol: crate::sys::ipvs::Protocol::Tcp,
        addr: IpAddr::V4(ip("10.96.9.9")),
        port: 80,
    };
    let foreign = crate::sys::ipvs::Service {
        addr: excluded,
        scheduler: "wlc".into(),
        flags: 0,
        timeout: 0,
    };
    let theirs = Destination::masq(IpAddr::V4(ip("192.0.2.7")), 80, 3);
    let ops = [
        Op::AddService(foreign.clone()),
        Op::AddDest(excluded, theirs.clone()),
    ];
    assert!(
        b.ipvs_table_mut()
            .inner_mut()
            .apply(&ops)
            .expect("apply")
            .is_empty()
    );
    // A Service on that address too: its address is bound on our link, which would make the
    // virtual server ours if it were not excluded.
    let mut snap = snapshot();
    add(
        &mut snap,
        port("excluded", Protocol::Tcp, "10.96.9.9", 80),
        vec![ep("10.244.1.50", 8080, REMOTE)],
    );
    let untouched = |b: &FakeBackend| {
        let t = b.ipvs_table();
        let svc = t
            .services()
            .expect("dump")
            .into_iter()
            .find(|(k, _)| *k == ServiceKey::Addr(excluded))
            .and_then(|(_, s)| s);
        assert_eq!(svc.as_ref(), Some(&foreign));
        assert_eq!(
            t.destinations(&excluded).expect("dump"),
            std::slice::from_ref(&theirs)
        );
    };
    sync(&mut b, &snap, true);
    untouched(&b);
    assert!(
        b.links()
            .inner
            .addresses(LINK)
            .expect("addresses")
            .contains(&ip("10.96.9.9"))
    );
    assert_eq!(schedulers(&b).len(), 3, "ours and the excluded one");
    assert_eq!(b.verify().expect("verify"), Vec::<String>::new());
    sync(&mut b, &snap, false);
    untouched(&b);
    b.cleanup().expect("cleanup");
    untouched(&b);
    assert_eq!(schedulers(&b), ["wlc"], "only the excluded one is left");
}
