//! The agent's service-proxy loop. [`intake`] feeds watch events into the change tracker; the
//! sync loop is a short loop over its parts: the [`runner`] paces the syncs, [`sync`] programs the
//! kernel through the driver with the [`cleaner`]'s conntrack pass, [`step`] advances a switch,
//! and [`status`] and [`registration`] keep the NodeProxy up to date. [`config`] holds the typed
//! flags.

mod cleaner;
pub mod config;
mod intake;
mod registration;
mod runner;
mod status;
mod step;
mod sync;

use std::{sync::Arc, time::Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Client;

pub use config::{
    CidrList, Config, ModeFlag, NodePortAddresses, PhaseFlag, node_settings, parse_cluster_cidrs,
    with_policy_settings,
};

use crate::{
    Error, Result,
    backend::Settings,
    driver::{Driver, FaultHook, KernelBackends, Parts, TcpProber},
    health::{ProxyHealth, ServiceHealthServers},
    metrics::Metrics,
    state_store::StateFile,
};
use intake::{Shared, Wish, lock};

/// Runs `f` on `value` on a blocking thread and hands `value` back with the result.
async fn on_blocking_thread<T, R>(
    what: &str,
    mut value: T,
    f: impl FnOnce(&mut T) -> R + Send + 'static,
) -> Result<(T, R)>
where
    T: Send + 'static,
    R: Send + 'static,
{
    tokio::task::spawn_blocking(move || {
        let r = f(&mut value);
        (value, r)
    })
    .await
    .map_err(|e| Error::Config(format!("{what} task: {e}")))
}

/// Runs the proxy until a watch fails for good or the process is asked to stop. `faults` runs
/// after each store of the switch state (fault injection; [`crate::driver::NoFaults`] in
/// production).
pub async fn run(
    client: Client,
    config: Config,
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
    faults: Arc<dyn FaultHook>,
) -> Result<()> {
    let shared = Arc::new(Shared::new(config.proxy_name.clone(), health, metrics));
    tokio::select! {
        r = intake::run(client.clone(), config.node_name.clone(), shared.clone()) => r,
        r = sync_loop(client, config, shared, faults) => r,
    }
}

/// What one round of the loop reads from intake.
struct Input {
    wish: Wish,
    settings: Settings,
}

/// The round's input, once the tracker has listed everything and our Node is known.
fn read_input(shared: &Shared, config: &Config) -> Option<Input> {
    let node: Option<Node> = lock(&shared.node).clone();
    if !lock(&shared.tracker).synced() || node.is_none() {
        return None;
    }
    let settings = node_settings(
        &with_policy_settings(config, lock(&shared.proxy_settings).as_ref()),
        node.as_ref(),
    );
    Some(Input {
        wish: lock(&shared.wish).clone(),
        settings,
    })
}

fn new_driver(config: &Config, settings: &Settings, faults: &Arc<dyn FaultHook>) -> Driver {
    let parts = Parts {
        backends: Box::new(KernelBackends {
            iptables_variant: config.iptables_variant.clone(),
        }),
        store: Box::new(StateFile(config.state_dir.join("state.json"))),
        prober: Box::new(TcpProber),
        faults: faults.clone(),
    };
    Driver::with_parts(parts, config.mode, settings.clone())
}

async fn sync_loop(
    client: Client,
    config: Config,
    shared: Arc<Shared>,
    faults: Arc<dyn FaultHook>,
) -> Result<()> {
    let mut runner = runner::SyncRunner::new(config.min_sync_period, config.sync_period, Instant::now());
    let mut cleaner = cleaner::ConntrackCleaner::default();
    let mut health_servers = ServiceHealthServers::new(shared.health.clone());
    let mut takeover = registration::Takeover::new(config.takeover_kube_proxy);
    let mut reporter = status::StatusReporter::new(
        client.clone(),
        config.node_name.clone(),
        config.capabilities.clone(),
    );
    let mut driver: Option<Driver> = None;
    let (metrics, health) = (&shared.metrics, &shared.health);
    loop {
        runner
            .wait(&shared.wake, driver.as_ref().is_some_and(Driver::switching))
            .await;
        let Some(Input { wish, settings }) = read_input(&shared, &config) else {
            continue;
        };
        let mut d = driver
            .take()
            .unwrap_or_else(|| new_driver(&config, &settings, &faults));
        d.update_settings(settings.clone());
        let full = runner.begin(Instant::now());
        let (snapshot, changes) = {
            let mut t = lock(&shared.tracker);
            (t.snapshot(), t.take_changes())
        };
        metrics.service_changes_pending.set(0);
        let (d, result) = sync::sync(d, &mut cleaner, &snapshot, changes, full, &settings).await?;
        let synced = match result {
            Ok(synced) => synced,
            Err(e) => {
                sync::record_failure(metrics, &d, &e);
                runner.failed();
                driver = Some(d);
                continue;
            }
        };
        runner.succeeded(synced.stats.full, Instant::now());
        sync::record_success(
            metrics,
            health,
            &d,
            &synced,
            &snapshot,
            &settings,
            &mut health_servers,
        );
        takeover.after_sync(d.switching()).await?;
        let supported = &config.capabilities.supported_modes;
        let (mut d, again) = step::step(&client, d, supported, &wish, &snapshot).await?;
        if again {
            runner.again();
        }
        registration::register_if_asked(&client, &config.node_name, &shared, &mut d).await;
        metrics
            .state_file_problem
            .set(i64::from(d.state_problem.is_some()));
        let last = status::LastSync {
            stats: &synced.stats,
            took: synced.took,
            snapshot: &snapshot,
        };
        if reporter.report(&mut d, &wish, last).await {
            runner.again();
        }
        driver = Some(d);
    }
}
