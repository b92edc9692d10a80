//! Registration and takeover: the agent's NodeProxy is created when it is not known to exist (at
//! start, after a watch saw it deleted, or when a status write found it gone), and kube-proxy's
//! leftovers are removed once our rules serve the node (at start with `--takeover-kube-proxy`,
//! and after each hand-back from mode `external`, never while the node is handed over).

use kube::{Client, ResourceExt};
use switchyard_crds::{
    consts::{SERVICE_PROXY_EXTERNAL, SERVICE_PROXY_LABEL},
    v1alpha1::ProxyMode,
};

use super::intake::{Shared, lock};
use crate::{Error, Result, driver::Driver, report};

/// Registers our NodeProxy if intake asked for it; a failure asks again (next round).
pub(super) async fn register_if_asked(client: &Client, node: &str, shared: &Shared, d: &mut Driver) {
    if !shared.take_registration() {
        return;
    }
    match report::ensure_registered(client, node).await {
        Ok(()) => d.dirty = true,
        Err(e) => {
            tracing::warn!(error = %e, "registering the NodeProxy failed; retrying");
            shared.request_registration();
        }
    }
}

/// Someone deleted our NodeProxy: registers it again; returns whether to report at once.
pub(super) async fn register_again(client: &Client, node: &str, d: &mut Driver) -> bool {
    tracing::warn!("NodeProxy {node} is gone; registering again");
    match report::ensure_registered(client, node).await {
        Ok(()) => {
            d.dirty = true;
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "re-registering failed");
            false
        }
    }
}

/// Removes kube-proxy's leftovers after a sync, when our rules serve the node alone: once at start
/// (`--takeover-kube-proxy`), and after every switch from mode `external` back to one of ours.
/// Never while the node is handed over (mode `external`, a switch under way, or the Node still
/// labelled `switchyard.dev/service-proxy=external`, so the other proxy's DaemonSet still runs
/// there): those objects serve the node then.
#[derive(Debug)]
pub(super) struct Takeover {
    /// A takeover is still to do.
    pending: bool,
    /// After a hand-back: keep going until a pass finds nothing (kube-proxy, stopping, may
    /// re-create its rules once after a pass).
    until_clean: bool,
    /// The mode served at the last look, to see a switch from `external` finish.
    last_active: Option<ProxyMode>,
}

impl Takeover {
    /// A takeover still to do when `wanted`.
    pub fn new(wanted: bool) -> Self {
        Self {
            pending: wanted,
            until_clean: false,
            last_active: None,
        }
    }

    /// Whether a pass may run now; notes a finished switch from `external` (pure).
    fn due(&mut self, active: ProxyMode, switching: bool, labelled_external: bool) -> bool {
        if self.last_active.is_some_and(ProxyMode::is_external) && !active.is_external() && !switching {
            self.pending = true;
            self.until_clean = true;
        }
        if !switching {
            self.last_active = Some(active);
        }
        self.pending && !switching && !active.is_external() && !labelled_external
    }

    /// Records a pass: done when nothing failed (and, after a hand-back, nothing was left).
    fn passed(&mut self, removed: &[String], errors: &[String]) {
        self.pending = !errors.is_empty() || (self.until_clean && !removed.is_empty());
        if !self.pending {
            self.until_clean = false;
        }
    }

    /// After a successful sync: our rules serve now, so kube-proxy's leftovers can go (retried
    /// after every sync until nothing failed).
    pub async fn after_sync(&mut self, d: &Driver, shared: &Shared) -> Result<()> {
        let labelled = lock(&shared.node).as_ref().is_some_and(|n| {
            n.labels().get(SERVICE_PROXY_LABEL).map(String::as_str) == Some(SERVICE_PROXY_EXTERNAL)
        });
        if !self.due(d.state.active, d.switching(), labelled) {
            return Ok(());
        }
        let (removed, errors) = tokio::task::spawn_blocking(crate::takeover::takeover)
            .await
            .map_err(|e| Error::Config(format!("takeover task: {e}")))?;
        tracing::info!(?removed, ?errors, "took over from kube-proxy");
        self.passed(&removed, &errors);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ProxyMode::{External as EXT, Nftables as NFT};

    #[test]
    fn never_while_handed_over_and_again_after_a_hand_back() {
        let mut t = Takeover::new(false);
        assert!(!t.due(NFT, false, false), "not asked for at start");
        assert!(!t.due(NFT, true, false), "switching to external");
        assert!(!t.due(EXT, false, true), "handed over");
        assert!(!t.due(EXT, true, true), "taking over");
        assert!(
            !t.due(NFT, false, true),
            "ours serve, but the other proxy's DaemonSet still selects the node"
        );
        assert!(t.due(NFT, false, false), "label gone: take over");
        t.passed(&["nftables table ip kube-proxy".into()], &[]);
        assert!(
            t.due(NFT, false, false),
            "a pass removed something: look once more"
        );
        t.passed(&[], &[]);
        assert!(!t.due(NFT, false, false), "clean: done");
    }

    #[test]
    fn the_start_takeover_runs_once_when_it_succeeds_and_waits_out_a_hand_over() {
        let mut t = Takeover::new(true);
        assert!(
            !t.due(NFT, false, true),
            "labelled: the other proxy's DaemonSet still runs here"
        );
        assert!(t.due(NFT, false, false));
        t.passed(&["iptables nat KUBE-* chains".into()], &[]);
        assert!(
            !t.due(NFT, false, false),
            "--takeover-kube-proxy: one successful pass"
        );
        let mut failing = Takeover::new(true);
        assert!(failing.due(NFT, false, false));
        failing.passed(&[], &["iptables nat: locked".into()]);
        assert!(failing.due(NFT, false, false), "a failed pass is retried");
    }
}
