//! Registration and takeover: the agent's NodeProxy is created when it is not known to exist (at
//! start, after a watch saw it deleted, or when a status write found it gone), and kube-proxy's
//! leftovers are removed once our rules serve the node.

use kube::Client;

use super::intake::Shared;
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

/// Removes kube-proxy's leftovers once, after the first sync outside a switch (`--takeover-kube-proxy`).
#[derive(Debug)]
pub(super) struct Takeover {
    done: bool,
}

impl Takeover {
    /// A takeover still to do when `wanted`.
    pub fn new(wanted: bool) -> Self {
        Self { done: !wanted }
    }

    /// After a successful sync: our rules serve now, so kube-proxy's leftovers can go (retried
    /// after every sync until nothing failed).
    pub async fn after_sync(&mut self, switching: bool) -> Result<()> {
        if self.done || switching {
            return Ok(());
        }
        let (removed, errors) = tokio::task::spawn_blocking(crate::takeover::takeover)
            .await
            .map_err(|e| Error::Config(format!("takeover task: {e}")))?;
        tracing::info!(?removed, ?errors, "took over from kube-proxy");
        self.done = errors.is_empty();
        Ok(())
    }
}
