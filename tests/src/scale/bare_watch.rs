//! A bare watcher beside the proxy under test: when the apiserver delivers each timed write's
//! watch event to a client that does nothing else with it. No proxy can program a change before
//! its event reaches it, so this is the apiserver's share of every API write → kernel latency
//! (commit, watch cache, dispatch) on this machine at that moment; the kernel time minus it is
//! the proxy's own share (negative when the proxy's watch was served first).

use std::{
    fmt::Debug,
    time::{Duration, Instant},
};

use futures::StreamExt;
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{ListParams, WatchEvent, WatchParams},
};
use serde::de::DeserializeOwned;
use tokio::{sync::mpsc, task::JoinHandle};

use crate::{Error, Result};

/// Re-watches (each watch lasts ≤ 290 s) before a watch task gives up.
const MAX_WATCHES: usize = 64;

/// One event as the bare watcher received it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// When the watcher had it decoded.
    pub at: Instant,
    /// `Service` or `EndpointSlice`.
    pub kind: &'static str,
    /// The object's name.
    pub name: String,
    /// An EndpointSlice's endpoint addresses (empty for a Service).
    pub addresses: Vec<String>,
}

/// Watches of Services and EndpointSlices in `default`, from the current resource version on.
#[derive(Debug)]
pub struct BareWatcher {
    seen: mpsc::UnboundedReceiver<Seen>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for BareWatcher {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl BareWatcher {
    /// Starts both watches from the current resource version (no initial events).
    pub async fn start(client: &Client) -> Result<Self> {
        let (tx, seen) = mpsc::unbounded_channel();
        let services: Api<Service> = Api::namespaced(client.clone(), "default");
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
        let tasks = vec![
            spawn_watch(services, "Service", tx.clone(), |_| Vec::new()).await?,
            spawn_watch(slices, "EndpointSlice", tx, |s: &EndpointSlice| {
                s.endpoints.iter().flat_map(|e| e.addresses.clone()).collect()
            })
            .await?,
        ];
        Ok(Self { seen, tasks })
    }

    /// Ms from `since` to the first event received that `matches`, waiting up to `limit` for
    /// it; events before it are dropped (each sample looks only for its own write's event).
    pub async fn await_event(
        &mut self,
        since: Instant,
        limit: Duration,
        what: &str,
        matches: impl Fn(&Seen) -> bool,
    ) -> Result<f64> {
        let deadline = tokio::time::Instant::from_std(since + limit);
        loop {
            let seen = tokio::time::timeout_at(deadline, self.seen.recv())
                .await
                .map_err(|_| Error::Timeout(limit, format!("the bare watcher's event for {what}")))?
                .ok_or_else(|| {
                    Error::Prerequisite(format!("the bare watcher ended before the event for {what}"))
                })?;
            if matches(&seen) {
                return Ok(seen.at.saturating_duration_since(since).as_secs_f64() * 1000.0);
            }
        }
    }
}

/// Lists one item for the current resource version, then watches from it in a task that sends
/// each added or modified object's [`Seen`] and resumes from the last version seen when a watch
/// ends; it stops when the receiver is gone, a watch cannot be made, or after [`MAX_WATCHES`].
async fn spawn_watch<K>(
    api: Api<K>,
    kind: &'static str,
    tx: mpsc::UnboundedSender<Seen>,
    addresses: fn(&K) -> Vec<String>,
) -> Result<JoinHandle<()>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let listed = api.list_metadata(&ListParams::default().limit(1)).await?;
    let mut version = listed.metadata.resource_version.unwrap_or_default();
    let params = WatchParams::default().timeout(290);
    Ok(tokio::spawn(async move {
        for _ in 0..MAX_WATCHES {
            let Ok(stream) = api.watch(&params, &version).await else {
                return;
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                let at = Instant::now();
                let object = match event {
                    Ok(WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o)) => o,
                    Ok(WatchEvent::Bookmark(b)) => {
                        version = b.metadata.resource_version;
                        continue;
                    }
                    // A 410 or a broken stream: resume from the last version seen.
                    Ok(WatchEvent::Error(_)) | Err(_) => break,
                };
                version = object.resource_version().unwrap_or_default();
                let seen = Seen {
                    at,
                    kind,
                    name: object.name_any(),
                    addresses: addresses(&object),
                };
                if tx.send(seen).is_err() {
                    return;
                }
            }
        }
    }))
}
