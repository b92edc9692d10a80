//! The generic conformance suite: what every [`Backend`] guarantees (see its `# Guarantees`),
//! checked the same way for every backend, on its fake adapters (no root) and on the kernel (root,
//! in network namespaces the kit creates). A backend's tests provide a [`Kit`] and expand
//! [`conformance_suite!`] for it: one `#[test]` per case.
//!
//! | case | what it checks |
//! | --- | --- |
//! | `cleanup_before_sync` | cleanup succeeds when nothing was ever programmed, and leaves nothing |
//! | `full_equals_partial` | a partial sync of a change leaves what a full sync of the result does |
//! | `failure_forces_full_resync` | after a failed sync the next one is full, even without the changes |
//! | `bypass_survives_sync` | a bypass holds through partial and full syncs until lifted |
//! | `verify_empty_after_sync` | `verify` finds no drift after full and partial syncs |
//! | `cleanup_twice_leaves_nothing` | cleanup is idempotent and removes every object |
//! | `cleanup_collects_every_error` | a failing part does not stop cleanup of the others; every failure is reported |
//! | `intact_until_disturbed` | the idle check (`intact`) holds after syncs and through a bypass, fails once the entry points are removed behind the backend's back, and holds again after a full sync |
//!
//! [`kits_agree`] checks a fake against the kernel on the same syncs (root).

use super::fixtures;
use crate::{
    backend::{Backend, Presence, SyncStats},
    model::{Changes, DualSnapshot},
};

/// One backend on one kernel (a fake, or a real one in a network namespace).
pub trait Subject {
    /// The backend under test.
    type B: Backend;
    /// The backend.
    fn backend(&mut self) -> &mut Self::B;
    /// Everything the backend owns in the kernel, read from the kernel (or the fake), normalised so
    /// that equal states compare equal whatever the creation order; empty when it owns nothing.
    fn owned(&self) -> String;
    /// Makes the next `n` kernel writes fail.
    fn fail_writes(&mut self, n: usize);
    /// Removes the backend's entry points behind its back, as a firewall reload or another tool
    /// would; `false`: this kit cannot (then its backend must have no cheap `intact` check).
    fn disturb(&mut self) -> bool {
        false
    }
}

/// How to make subjects of one backend on one kind of kernel.
pub trait Kit: Sync {
    /// The subjects it makes.
    type S: Subject;
    /// Runs `f` with a fresh subject on an empty kernel (inside its network namespace).
    fn with_subject<T: Send>(&self, f: impl FnOnce(&mut Self::S) -> T + Send) -> T;
    /// The parts a cleanup handles independently (e.g. one per IP family): failing writes in all
    /// of them yield this many errors.
    fn cleanup_parts(&self) -> usize;
    /// The scenario the suite programs (by default the dual-stack fixture).
    fn scenario(&self) -> DualSnapshot {
        fixtures::dual_scenario().0
    }
}

fn full_sync<S: Subject>(s: &mut S, snap: &DualSnapshot) -> SyncStats {
    let stats = s
        .backend()
        .sync(snap, &Changes::default(), true)
        .unwrap_or_else(|e| panic!("full sync: {e}"));
    assert!(stats.full, "{stats:?}");
    stats
}

fn presence<S: Subject>(s: &mut S) -> Presence {
    s.backend().presence().unwrap_or_else(|e| panic!("presence: {e}"))
}

/// What a full sync of `snap` on a fresh kernel leaves.
fn full_state<K: Kit>(kit: &K, snap: &DualSnapshot) -> String {
    kit.with_subject(|s| {
        full_sync(s, snap);
        s.owned()
    })
}

/// Cleanup succeeds when nothing was ever programmed, and leaves nothing.
pub fn cleanup_before_sync<K: Kit>(kit: &K) {
    kit.with_subject(|s| {
        s.backend()
            .cleanup()
            .unwrap_or_else(|e| panic!("cleanup of nothing: {e}"));
        assert_eq!(s.owned(), "");
        assert_eq!(presence(s), Presence::Absent);
    });
}

/// A partial sync of a change leaves exactly what a full sync of the changed snapshot does.
pub fn full_equals_partial<K: Kit>(kit: &K) {
    let before = kit.scenario();
    let (after, changes) = fixtures::changed(&before);
    let partial = kit.with_subject(|s| {
        let full = full_sync(s, &before);
        assert_ne!(s.owned(), "", "a full sync programs something");
        let stats = s
            .backend()
            .sync(&after, &changes, false)
            .unwrap_or_else(|e| panic!("partial sync: {e}"));
        assert!(!stats.full, "{stats:?}");
        assert!(
            stats.objects_written < full.objects_written,
            "partial {stats:?} vs full {full:?}"
        );
        s.owned()
    });
    assert_eq!(partial, full_state(kit, &after));
}

/// After a failed sync the next one is full: the caller has drained its changes, so the backend
/// must not rely on them.
pub fn failure_forces_full_resync<K: Kit>(kit: &K) {
    let before = kit.scenario();
    let (after, changes) = fixtures::changed(&before);
    let recovered = kit.with_subject(|s| {
        full_sync(s, &before);
        s.fail_writes(1);
        assert!(
            s.backend().sync(&after, &changes, false).is_err(),
            "a failing write fails the sync"
        );
        let stats = s
            .backend()
            .sync(&after, &Changes::default(), false)
            .unwrap_or_else(|e| panic!("resync: {e}"));
        assert!(stats.full, "the sync after a failure is full: {stats:?}");
        s.owned()
    });
    assert_eq!(recovered, full_state(kit, &after));
}

/// A bypass holds through partial and full syncs until it is lifted.
pub fn bypass_survives_sync<K: Kit>(kit: &K) {
    let before = kit.scenario();
    let (after, changes) = fixtures::changed(&before);
    kit.with_subject(|s| {
        full_sync(s, &before);
        assert_eq!(presence(s), Presence::Serving);
        s.backend().set_bypass(true).expect("bypass");
        assert_eq!(presence(s), Presence::Bypassed);
        s.backend().sync(&after, &changes, false).expect("partial sync");
        assert_eq!(presence(s), Presence::Bypassed, "after a partial sync");
        full_sync(s, &after);
        assert_eq!(presence(s), Presence::Bypassed, "after a full sync");
        s.backend().set_bypass(false).expect("lift the bypass");
        assert_eq!(presence(s), Presence::Serving);
    });
}

/// `verify` finds no drift after full and partial syncs.
pub fn verify_empty_after_sync<K: Kit>(kit: &K) {
    let before = kit.scenario();
    let (after, changes) = fixtures::changed(&before);
    kit.with_subject(|s| {
        full_sync(s, &before);
        assert_eq!(s.backend().verify().expect("verify"), Vec::<String>::new());
        s.backend().sync(&after, &changes, false).expect("partial sync");
        assert_eq!(s.backend().verify().expect("verify"), Vec::<String>::new());
    });
}

/// The idle check: `intact` after full and partial syncs and through a bypass; not once the entry
/// points are removed behind the backend's back; again after the full sync that follows. A
/// backend without a cheap check answers `None` (IPVS: its full resync stays).
pub fn intact_until_disturbed<K: Kit>(kit: &K) {
    let before = kit.scenario();
    let (after, changes) = fixtures::changed(&before);
    kit.with_subject(|s| {
        full_sync(s, &before);
        let intact = |s: &mut K::S| s.backend().intact().expect("intact");
        if intact(s).is_none() {
            assert_eq!(
                s.backend().mode(),
                switchyard_crds::v1alpha1::ProxyMode::Ipvs,
                "only IPVS has no cheap check"
            );
            return;
        }
        assert_eq!(intact(s), Some(true), "after a full sync");
        s.backend().sync(&after, &changes, false).expect("partial sync");
        assert_eq!(intact(s), Some(true), "after a partial sync");
        s.backend().set_bypass(true).expect("bypass");
        assert_eq!(intact(s), Some(true), "bypassed as asked");
        s.backend().set_bypass(false).expect("lift the bypass");
        assert!(
            s.disturb(),
            "a backend with a cheap check needs a kit that can disturb it"
        );
        assert_eq!(intact(s), Some(false), "entry points removed behind its back");
        full_sync(s, &after);
        assert_eq!(intact(s), Some(true), "restored by the full sync");
    });
}

/// Cleanup is idempotent and removes every object of the backend.
pub fn cleanup_twice_leaves_nothing<K: Kit>(kit: &K) {
    let before = kit.scenario();
    kit.with_subject(|s| {
        full_sync(s, &before);
        s.backend().cleanup().expect("cleanup");
        assert_eq!(s.owned(), "");
        s.backend().cleanup().expect("second cleanup");
        assert_eq!(s.owned(), "");
        assert_eq!(presence(s), Presence::Absent);
    });
}

fn cleanup_errors<S: Subject>(s: &mut S) -> Vec<String> {
    match s.backend().cleanup() {
        Ok(()) => Vec::new(),
        Err(e) => e.errors().iter().map(ToString::to_string).collect(),
    }
}

/// A failing part does not stop the cleanup of the others, and every failure is reported
/// (netavark's collect-all-errors teardown).
pub fn cleanup_collects_every_error<K: Kit>(kit: &K) {
    let before = kit.scenario();
    let parts = kit.cleanup_parts();
    kit.with_subject(|s| {
        full_sync(s, &before);
        let programmed = s.owned();
        s.fail_writes(1);
        let errors = cleanup_errors(s);
        assert_eq!(errors.len(), 1, "{errors:?}");
        let left = s.owned();
        if parts > 1 {
            assert_ne!(
                left, programmed,
                "the other parts are cleaned despite the failure"
            );
        }
        assert_ne!(left, "", "the failed part is left");
        full_sync(s, &before);
        s.fail_writes(parts);
        let errors = cleanup_errors(s);
        assert_eq!(errors.len(), parts, "one error per part: {errors:?}");
        assert_eq!(cleanup_errors(s), Vec::<String>::new());
        assert_eq!(s.owned(), "");
    });
}

/// The states a full sync of the kit's scenario and then a partial sync of its change leave.
fn states<K: Kit>(kit: &K) -> (String, String) {
    let before = kit.scenario();
    let (after, changes) = fixtures::changed(&before);
    kit.with_subject(|s| {
        full_sync(s, &before);
        let full = s.owned();
        s.backend()
            .sync(&after, &changes, false)
            .unwrap_or_else(|e| panic!("partial sync: {e}"));
        (full, s.owned())
    })
}

/// Two kits of one backend agree (the fake and the kernel, so that the fake stays true to its
/// oracle beyond the golden scenario): a full sync and then a partial sync leave the same state in
/// both. Their subjects must normalise [`Subject::owned`] alike.
pub fn kits_agree<A: Kit, B: Kit>(a: &A, b: &B) {
    let (full_a, partial_a) = states(a);
    let (full_b, partial_b) = states(b);
    assert_ne!(full_a, "", "a full sync programs something");
    assert_eq!(full_a, full_b, "after the full sync");
    assert_eq!(partial_a, partial_b, "after the partial sync");
}

/// Expands to one `#[test]` per case of the suite for the kit `$kit` (an expression); with
/// `ignore = "why"` the tests are `#[ignore]`d (kits that need a kernel only a VM has).
macro_rules! conformance_suite {
    (@cases $kit:expr; $(#[$attr:meta])*) => {
        #[test]
        $(#[$attr])*
        fn cleanup_before_sync() {
            $crate::backend::conformance::suite::cleanup_before_sync(&$kit);
        }
        #[test]
        $(#[$attr])*
        fn full_equals_partial() {
            $crate::backend::conformance::suite::full_equals_partial(&$kit);
        }
        #[test]
        $(#[$attr])*
        fn failure_forces_full_resync() {
            $crate::backend::conformance::suite::failure_forces_full_resync(&$kit);
        }
        #[test]
        $(#[$attr])*
        fn bypass_survives_sync() {
            $crate::backend::conformance::suite::bypass_survives_sync(&$kit);
        }
        #[test]
        $(#[$attr])*
        fn verify_empty_after_sync() {
            $crate::backend::conformance::suite::verify_empty_after_sync(&$kit);
        }
        #[test]
        $(#[$attr])*
        fn cleanup_twice_leaves_nothing() {
            $crate::backend::conformance::suite::cleanup_twice_leaves_nothing(&$kit);
        }
        #[test]
        $(#[$attr])*
        fn cleanup_collects_every_error() {
            $crate::backend::conformance::suite::cleanup_collects_every_error(&$kit);
        }
        #[test]
        $(#[$attr])*
        fn intact_until_disturbed() {
            $crate::backend::conformance::suite::intact_until_disturbed(&$kit);
        }
    };
    ($kit:expr, ignore = $why:literal) => {
        $crate::backend::conformance::suite::conformance_suite!(@cases $kit; #[ignore = $why]);
    };
    ($kit:expr) => {
        $crate::backend::conformance::suite::conformance_suite!(@cases $kit;);
    };
}
pub(crate) use conformance_suite;
