//! One sync: the driver programs the snapshot on a blocking thread (kernel programming blocks)
//! with the conntrack pass right after it, then what the sync did goes to metrics, health and the
//! health-check node-port servers.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use super::{cleaner::ConntrackCleaner, intake::now_seconds, on_blocking_thread};
use crate::{
    Result,
    backend::{BackendError, Settings, SyncStats},
    driver::Driver,
    health::{HealthCheckPorts, ServiceHealthServers},
    metrics::{Metrics, ModeLabel, TrafficPolicy},
    model::{Changes, DualSnapshot, ServicePort, categorize},
};

/// What a successful sync did.
#[derive(Debug, Clone)]
pub(super) struct Synced {
    /// The backend's stats.
    pub stats: SyncStats,
    /// How long the sync took (without the conntrack pass).
    pub took: Duration,
}

/// Syncs `snapshot` (`changes` since the last sync; `full`: everything) and runs the cleanups
/// the cleaner planned for it. The driver comes back with the result.
pub(super) async fn sync(
    driver: Driver,
    cleaner: &mut ConntrackCleaner,
    snapshot: &Arc<DualSnapshot>,
    changes: Changes,
    full: bool,
    settings: &Settings,
) -> Result<(Driver, Result<Synced, BackendError>)> {
    let planned = cleaner.plan(snapshot, &changes, full, settings);
    // Shared with the task: no copy of the whole state.
    let snap = Arc::clone(snapshot);
    let (driver, (result, unfinished, changes)) = on_blocking_thread("sync", driver, move |d| {
        let started = Instant::now();
        let r = d.sync(&snap, &changes, full);
        let took = started.elapsed();
        let unfinished = planned.run(r.is_ok(), |family, cleanup| {
            if cleanup.is_empty() {
                return Ok(0);
            }
            crate::sys::conntrack::delete_stale(family, &|flow| cleanup.is_stale(flow))
        });
        (r.map(|stats| Synced { stats, took }), unfinished, changes)
    })
    .await?;
    let programmed = result.is_ok().then_some(&**snapshot);
    cleaner.finish(programmed, &changes, full, unfinished);
    Ok((driver, result))
}

fn mode_label(driver: &Driver) -> ModeLabel {
    ModeLabel {
        mode: driver.state.active.to_string(),
    }
}

/// Records a successful sync in metrics and health, and serves the health-check node ports.
pub(super) fn record_success(
    metrics: &Metrics,
    health: &crate::health::ProxyHealth,
    driver: &Driver,
    synced: &Synced,
    snapshot: &DualSnapshot,
    settings: &Settings,
    health_servers: &mut ServiceHealthServers,
) {
    let (stats, took) = (&synced.stats, synced.took.as_secs_f64());
    if stats.full {
        metrics.sync_full_duration.observe(took);
    } else {
        metrics.sync_partial_duration.observe(took);
    }
    metrics.sync_duration.observe(took);
    metrics.last_sync_timestamp.set(now_seconds());
    let label = mode_label(driver);
    metrics
        .programmed_services
        .get_or_create(&label)
        .set(stats.services as i64);
    metrics
        .objects_written
        .get_or_create(&label)
        .set(stats.objects_written as i64);
    health.updated();
    // Full syncs are rare (the first, after a failure, a relist, a settings change) and what a
    // start-up's time goes to: logged at info; the incremental ones at debug.
    if stats.full {
        tracing::info!(
            services = stats.services,
            objects = stats.objects_written,
            millis = synced.took.as_millis() as u64,
            "full sync"
        );
    } else {
        tracing::debug!(
            services = stats.services,
            objects = stats.objects_written,
            millis = synced.took.as_millis() as u64,
            "synced"
        );
    }
    health_servers.sync(health_check_ports(snapshot, settings));
    no_local_endpoints(snapshot, settings, metrics);
}

/// Records a failed sync (the next one is full).
pub(super) fn record_failure(metrics: &Metrics, driver: &Driver, error: &BackendError) {
    metrics.sync_failures.get_or_create(&mode_label(driver)).inc();
    tracing::error!(error = %error, "sync failed; retrying with a full sync");
}

/// Health-check node ports of ETP=Local Services with their local endpoint counts. A dual-stack
/// pod is one endpoint per family, so the count is the larger of the two families'.
fn health_check_ports(snapshot: &DualSnapshot, settings: &Settings) -> HealthCheckPorts {
    let mut ports = HealthCheckPorts::new();
    for family in snapshot.families() {
        for p in family.services.values().filter(|p| p.external_policy_local) {
            let Some(hc) = p.health_check_node_port else {
                continue;
            };
            let eps = family
                .endpoints
                .get(&p.name)
                .map(Vec::as_slice)
                .unwrap_or_default();
            let local = categorize(eps, &settings.node).local.len();
            let entry = ports.entry(hc).or_insert_with(|| (p.name.service.clone(), 0));
            entry.1 = entry.1.max(local);
        }
    }
    ports
}

fn no_local_endpoints(snapshot: &DualSnapshot, settings: &Settings, metrics: &Metrics) {
    let (mut internal, mut external) = (0i64, 0i64);
    // Only Services with a Local policy count; skipping the others first keeps the walk free of
    // endpoint lookups (this runs after every sync).
    let counted =
        |p: &&ServicePort| p.internal_policy_local || (p.external_policy_local && p.externally_accessible());
    for (snapshot, p) in snapshot
        .families()
        .into_iter()
        .flat_map(|s| s.services.values().filter(counted).map(move |p| (s, p)))
    {
        let eps = snapshot
            .endpoints
            .get(&p.name)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let c = categorize(eps, &settings.node);
        if c.local.is_empty() && c.has_any {
            internal += i64::from(p.internal_policy_local);
            external += i64::from(p.external_policy_local && p.externally_accessible());
        }
    }
    for (policy, count) in [("internal", internal), ("external", external)] {
        metrics
            .no_local_endpoints
            .get_or_create(&TrafficPolicy {
                traffic_policy: policy.into(),
            })
            .set(count);
    }
}
