//! Mode `external`: another service proxy (kube-proxy, an eBPF data plane) serves the node, and
//! Switchyard programs nothing. This backend is the switch's stand-in for that proxy, so that
//! handing a node over and taking it back are ordinary make-before-break switches:
//!
//! - *to* `external`: Preparing waits ([`Backend::waiting_for`]) until the other proxy's rules
//!   are in the kernel; CutOver bypasses Switchyard's backend, so new connections go through the
//!   other proxy; the health gate's probes then test it; Cleaning removes Switchyard's rules. A
//!   rollback un-bypasses them.
//! - *from* `external`: the new backend is programmed next to the other proxy's rules and opened
//!   (a `set_bypass` here is a no-op: the other proxy's rules are not ours to close); the probes
//!   test it; "cleaning" this backend removes nothing. kube-proxy's leftovers go with the
//!   takeover, once its DaemonSet no longer selects the node.
//!
//! It never touches another component's objects: `sync`, `set_bypass` and `cleanup` change
//! nothing in the kernel, and `presence` is always [`Presence::Absent`] (nothing of Switchyard's
//! serves), so an agent restart in mode `external` keeps nothing of its own.

use switchyard_crds::v1alpha1::ProxyMode;

use super::{Backend, BackendError, Presence, SyncStats};
use crate::model::{Changes, DualSnapshot};

/// How the backend sees whether the other proxy serves: the names of its objects found in the
/// kernel (empty: not yet). Injected so the driver's tests run without a kernel.
pub type Detector = Box<dyn Fn() -> Vec<String> + Send>;

/// The other proxy's stand-in.
pub struct ExternalBackend {
    detect: Detector,
}

impl ExternalBackend {
    /// Waits for kube-proxy's objects ([`crate::takeover::kube_proxy_found`]).
    pub fn kube_proxy() -> Self {
        Self::with_detector(Box::new(crate::takeover::kube_proxy_found))
    }

    /// Sees the other proxy with `detect`.
    pub fn with_detector(detect: Detector) -> Self {
        Self { detect }
    }
}

impl Backend for ExternalBackend {
    fn mode(&self) -> ProxyMode {
        ProxyMode::External
    }

    fn sync(&mut self, snapshot: &DualSnapshot, _: &Changes, full: bool) -> Result<SyncStats, BackendError> {
        let _ = snapshot; // the other proxy programs the Services
        Ok(SyncStats {
            full,
            ..SyncStats::default()
        })
    }

    fn cleanup(&mut self) -> Result<(), BackendError> {
        Ok(()) // the other proxy's objects are not Switchyard's to remove (see the takeover)
    }

    fn render_text(&self, _: &DualSnapshot) -> String {
        "# mode external: another service proxy serves this node; Switchyard programs nothing\n".into()
    }

    fn set_bypass(&mut self, _: bool) -> Result<(), BackendError> {
        Ok(()) // nothing of Switchyard's to open or close
    }

    fn presence(&self) -> Result<Presence, BackendError> {
        Ok(Presence::Absent)
    }

    fn rebuild_with_new_settings(&self) -> bool {
        true
    }

    fn waiting_for(&self) -> Option<String> {
        (self.detect)().is_empty().then(|| {
            "another service proxy's rules on the node (kube-proxy's nftables table `kube-proxy` or its iptables chain KUBE-SERVICES)".into()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_programs_nothing_and_waits_for_the_other_proxy() {
        let mut absent = ExternalBackend::with_detector(Box::new(Vec::new));
        let snapshot = DualSnapshot::default();
        let stats = absent.sync(&snapshot, &Changes::default(), true).expect("sync");
        assert_eq!((stats.services, stats.rules_total), (0, 0));
        absent.set_bypass(true).expect("bypass");
        absent.cleanup().expect("cleanup");
        assert_eq!(absent.presence().expect("presence"), Presence::Absent);
        assert!(absent.waiting_for().is_some_and(|w| w.contains("kube-proxy")));
        let present =
            ExternalBackend::with_detector(Box::new(|| vec!["nftables table ip kube-proxy".into()]));
        assert_eq!(present.waiting_for(), None);
        assert!(present.render_text(&snapshot).contains("another service proxy"));
    }
}
