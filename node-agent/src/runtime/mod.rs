//! The agent's service-proxy loop. [`intake`] feeds watch events into the change tracker; the
//! sync loop is a short loop over its parts: the [`runner`] paces the syncs, [`sync`] programs the
//! kernel through the driver with the [`cleaner`]'s conntrack pass, [`step`] advances a switch,
//! and [`status`] and [`registration`] keep the NodeProxy up to date. [`config`] holds the typed
//! flags; the policy's settings that do not reach a backend (sync periods, service-proxy-name,
//! conntrack [`sysctls`]) are taken before each round. Which policy settings are in force is
//! [`settings_switch`]'s: a new rollout token brings them behind the health gate, and a failed
//! gate puts back the ones from before.

mod cleaner;
pub mod config;
mod intake;
mod reflector;
mod registration;
mod runner;
mod settings_switch;
mod status;
mod step;
mod sync;
mod sysctls;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node;
use kube::Client;

pub use sysctls::restore_from as restore_conntrack_sysctls;

pub use config::{
    CidrList, Config, ModeFlag, NodePortAddresses, PhaseFlag, node_settings, parse_cluster_cidrs,
    with_policy_settings,
};

use crate::{
    Error, Result,
    backend::Settings,
    driver::{Driver, FaultHook, KernelBackends, PROBE_EVERY, Parts, TcpProber},
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
    intake: Intake,
    config: impl Future<Output = Result<Config>>,
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
    faults: Arc<dyn FaultHook>,
) -> Result<()> {
    let shared = Arc::new(Shared::new(intake.proxy_name.clone(), health, metrics));
    tokio::select! {
        r = intake::run(client.clone(), intake, shared.clone()) => r,
        r = async { sync_loop(client, config.await?, shared, faults).await } => r,
    }
}

/// What intake needs, known before the kernel is probed (it lists while the probe runs).
#[derive(Debug, Clone)]
pub struct Intake {
    /// Our Node's name.
    pub node_name: String,
    /// `--service-proxy-name` (the policy's name, once known, overrides it in the tracker).
    pub proxy_name: Option<String>,
    /// Objects per page of a Service or EndpointSlice list.
    pub list_page: u32,
}

/// Objects per list page unless `--list-page-size` says otherwise (client-go's reflector asks for
/// 500). Every page is a round trip in which the apiserver and the agent wait on each other; at
/// 10k Services a 500-object page of JSON took the apiserver 22–30 ms (0.7 MB; the whole list in
/// one response 150 ms for 14.5 MB). `api-bench --rows 10k --proxies sy-nft`, two runs each, JSON:
/// start → all rules 0.58 / 0.62 s with pages of 500, 0.47 / 0.48 s with 5,000, 0.49 / 0.51 s
/// unpaginated; peak RSS 69, 75 and 100 MiB. At 44k: 3.01 s with 500, 2.08 / 2.91 s with 5,000,
/// peak RSS 243 and 246 MiB (unpaginated: 2.90 s, 394 MiB). In protobuf a page of 5,000 Services
/// and one of 5,000 slices took 45 ms together, the unpaginated lists 160 ms. With each page
/// decoded as it arrives (`model::list_stream`), 10k start → all rules alternated per start on
/// one apiserver: 0.58 / 0.77 s with pages of 5,000, 0.61 / 0.53 s unpaginated (no difference
/// beyond this machine's noise, so the pages stay).
pub const DEFAULT_LIST_PAGE: u32 = 5000;

/// What one round of the loop reads from intake.
struct Input {
    wish: Wish,
    /// Our Node.
    node: Option<Node>,
    settings: Settings,
    /// The flags with the policy's settings laid over them.
    effective: Config,
}

/// The round's input, once the tracker has listed everything and our Node is known.
fn read_input(shared: &Shared, config: &Config) -> Option<Input> {
    let node: Option<Node> = lock(&shared.node).clone();
    if !lock(&shared.tracker).synced() || node.is_none() {
        return None;
    }
    let effective = with_policy_settings(config, lock(&shared.proxy_settings).as_ref());
    let settings = node_settings(&effective, node.as_ref());
    Some(Input {
        wish: lock(&shared.wish).clone(),
        node,
        settings,
        effective,
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
        probe_every: PROBE_EVERY,
    };
    Driver::with_parts(parts, config.mode, settings.clone())
}

/// The driver, made and its start state read from the store and the kernel while intake lists
/// (tens of ms of `iptables-save` off a start; the Node's settings are laid over it before the
/// first sync). Only this agent changes its own kernel objects, so the reading stays true until
/// then, however long the lists take.
fn early_driver(config: &Config, faults: &Arc<dyn FaultHook>) -> tokio::task::JoinHandle<Driver> {
    let (config, faults) = (config.clone(), faults.clone());
    tokio::task::spawn_blocking(move || {
        let mut d = new_driver(&config, &node_settings(&config, None), &faults);
        d.read_start_state();
        d
    })
}

/// How long the first sync waits, once Services and the Node are listed, for our NodeProxy to be
/// listed too: its policy settings (NodePort addresses, masquerading, the service-proxy-name
/// filter) must shape the first ruleset after a restart, or the data plane would flap to the
/// flags' settings and back. Bounded, so that a NodeProxy watch that cannot list (a missing CRD,
/// RBAC) delays the node's first rules by this much, not forever.
const SPEC_WAIT: Duration = Duration::from_secs(10);

/// The sync loop's parts, kept across rounds.
struct SyncLoop {
    client: Client,
    config: Config,
    shared: Arc<Shared>,
    faults: Arc<dyn FaultHook>,
    runner: runner::SyncRunner,
    cleaner: cleaner::ConntrackCleaner,
    health_servers: ServiceHealthServers,
    takeover: registration::Takeover,
    reporter: status::StatusReporter,
    sysctls: sysctls::ConntrackSysctls,
    /// Until when the first sync waits for our NodeProxy ([`SPEC_WAIT`]); set when it starts to.
    spec_deadline: Option<Instant>,
    /// The policy settings in force, and those from before a settings switch.
    settings_memory: settings_switch::Memory,
    settings_file: settings_switch::MemoryFile,
}

async fn sync_loop(
    client: Client,
    config: Config,
    shared: Arc<Shared>,
    faults: Arc<dyn FaultHook>,
) -> Result<()> {
    let limit = runner::RateLimit::of(config.min_sync_period);
    let mut parts = SyncLoop {
        runner: runner::SyncRunner::new(limit, config.sync_period, Instant::now()),
        cleaner: cleaner::ConntrackCleaner::default(),
        health_servers: ServiceHealthServers::new(shared.health.clone()),
        takeover: registration::Takeover::new(config.takeover_kube_proxy),
        reporter: status::StatusReporter::new(
            client.clone(),
            config.node_name.clone(),
            config.capabilities.clone(),
        ),
        sysctls: sysctls::ConntrackSysctls::new(StateFile(config.state_dir.join("state.json"))),
        spec_deadline: None,
        settings_memory: settings_switch::MemoryFile(config.state_dir.join("settings.json")).load(),
        settings_file: settings_switch::MemoryFile(config.state_dir.join("settings.json")),
        client,
        config,
        shared,
        faults,
    };
    let mut driver: Option<Driver> = None;
    let mut early = Some(early_driver(&parts.config, &parts.faults));
    loop {
        let switching = driver.as_ref().is_some_and(Driver::switching);
        parts.runner.wait(&parts.shared.wake, switching).await;
        let Some(mut input) = read_input(&parts.shared, &parts.config) else {
            continue;
        };
        if driver.is_none() && parts.await_spec().await {
            continue;
        }
        let (mut d, fresh) = match driver.take() {
            Some(d) => (d, false),
            None => match early.take().map(tokio::task::JoinHandle::into_future) {
                Some(made) => match made.await {
                    Ok(d) => (d, true),
                    Err(e) => {
                        tracing::warn!(error = %e, "the start-up kernel read failed; reading at the first sync");
                        (new_driver(&parts.config, &input.settings, &parts.faults), true)
                    }
                },
                None => (new_driver(&parts.config, &input.settings, &parts.faults), true),
            },
        };
        parts.settings_in_force(&mut input, &mut d);
        let localhost = sysctls::localhost_wanted(&input.settings, &d.state);
        let strict_arp = sysctls::strict_arp_wanted(&input.settings, &d.state);
        parts.take_settings(&input.effective, localhost, strict_arp);
        // Localhost NodePorts only once route_localnet is set (a fresh driver has built no
        // backend yet: it takes the gated settings before its first sync, even mid-switch).
        parts.sysctls.gate_localhost(&mut input.settings, localhost);
        if fresh {
            d.set_settings(input.settings.clone());
        }
        driver = Some(parts.round(d, input).await?);
        if parts.sysctls.release_pending() {
            // The rules are gone: the next round puts route_localnet back.
            parts.runner.again();
        }
    }
}

impl SyncLoop {
    /// Lays the policy settings in force over the round's input ([`settings_switch`]): the
    /// spec's, except those a failed health gate put back; marks a request that changes them.
    /// Only once our NodeProxy is listed (until then the spec says nothing).
    fn settings_in_force(&mut self, input: &mut Input, d: &mut Driver) {
        if !self.shared.spec_listed.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let spec = lock(&self.shared.proxy_settings).clone();
        let token = input.wish.desired.as_ref().and_then(|w| w.token.clone());
        let view = settings_switch::SwitchView {
            switching: d.switching(),
            answered: d.state.answered.as_deref(),
            last: d.last.as_ref().map(|l| (l.token.as_deref(), &l.result)),
        };
        let remembered = self.settings_memory.clone();
        let in_force = self.settings_memory.round(spec.as_ref(), token.as_deref(), view);
        if self.settings_memory != remembered {
            self.settings_file.store(&self.settings_memory);
        }
        d.settings_changed = in_force.changed;
        if in_force.settings != spec {
            input.effective = with_policy_settings(&self.config, in_force.settings.as_ref());
            input.settings = node_settings(&input.effective, input.node.as_ref());
        }
    }

    /// Whether the settings of this round are the ones to run on: our NodeProxy has been listed,
    /// or the first sync stopped waiting for it ([`SPEC_WAIT`]) and runs on the flags'.
    fn settings_known(&self) -> bool {
        self.shared.spec_listed.load(std::sync::atomic::Ordering::Relaxed)
            || self.spec_deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Before the first sync: whether to wait (a while, or until a wake) for our NodeProxy to be
    /// listed; past [`SPEC_WAIT`] the first sync goes ahead with the flags' settings.
    async fn await_spec(&mut self) -> bool {
        if self.shared.spec_listed.load(std::sync::atomic::Ordering::Relaxed) {
            return false;
        }
        let now = Instant::now();
        let deadline = *self.spec_deadline.get_or_insert(now + SPEC_WAIT);
        if now >= deadline {
            tracing::warn!(
                waited = ?SPEC_WAIT,
                "our NodeProxy is not listed yet: the first sync uses the flags' settings"
            );
            return false;
        }
        tokio::select! {
            _ = self.shared.wake.notified() => {}
            _ = tokio::time::sleep(deadline - now) => {}
        }
        self.runner.again();
        true
    }

    /// Takes the settings that do not go to the backend: the sync pacing, the
    /// service-proxy-name filter (each logged when it changes), the conntrack sysctls,
    /// `route_localnet` (1 while `localhost` NodePorts are served) and strictARP's (while
    /// `strict_arp`); only once our NodeProxy has
    /// been listed (or the first sync stopped waiting for it), so that a restart does not flap
    /// them to the flags'.
    fn take_settings(&mut self, effective: &Config, localhost: bool, strict_arp: bool) {
        if !self.settings_known() {
            return;
        }
        for (kind, condition) in self
            .sysctls
            .apply(effective.conntrack.as_ref(), localhost, strict_arp)
            .into_iter()
            .flatten()
        {
            self.reporter.set_condition(kind, condition);
        }
        let limit = runner::RateLimit::of(effective.min_sync_period);
        if self.runner.configure(limit, effective.sync_period) {
            tracing::info!(min_sync_period = ?limit, sync_period = ?effective.sync_period, "sync periods changed");
            // kube-proxy's health timeout: 2 × syncPeriod.
            self.shared.health.set_timeout(effective.sync_period * 2);
        }
        let name = effective.proxy_name.clone();
        let mut tracker = lock(&self.shared.tracker);
        if tracker.proxy_name() != name.as_deref() {
            let flipped = tracker.set_proxy_name(name.clone());
            tracing::info!(service_proxy_name = ?name, services_changed = flipped, "service-proxy-name changed");
        }
    }

    /// One round: sync the tracker's state, then (after a successful sync) step the switch and
    /// report.
    async fn round(&mut self, mut d: Driver, Input { wish, settings, .. }: Input) -> Result<Driver> {
        d.update_settings(settings.clone());
        let (d, full) = self.full_sync_wanted(d).await?;
        let (snapshot, changes) = {
            let mut t = lock(&self.shared.tracker);
            (t.shared_snapshot(), t.take_changes())
        };
        let Some(full) = full.or_else(|| (!changes.services.is_empty()).then_some(false)) else {
            // An idle period, our rules in place and nothing changed: nothing to sync (kube-proxy
            // syncs nothing either); the switch step and the status report still run.
            let none = sync::Synced {
                stats: crate::backend::SyncStats::default(),
                took: Duration::ZERO,
            };
            return self.after_sync(d, &wish, &none, &snapshot, true).await;
        };
        self.shared.metrics.service_changes_pending.set(0);
        let (d, result) = sync::sync(d, &mut self.cleaner, &snapshot, changes, full, &settings).await?;
        match result {
            Ok(synced) => {
                self.runner.succeeded(synced.stats.full, Instant::now());
                let (metrics, health) = (&self.shared.metrics, &self.shared.health);
                let servers = &mut self.health_servers;
                sync::record_success(metrics, health, &d, &synced, &snapshot, &settings, servers);
                self.after_sync(d, &wish, &synced, &snapshot, false).await
            }
            Err(e) => {
                sync::record_failure(&self.shared.metrics, &d, &e);
                self.runner.failed();
                Ok(d)
            }
        }
    }

    /// Whether this round's sync is full (`Some(true)`) or partial (`Some(false)`): the runner's
    /// answer; after an idle sync period, the backends' cheap check of our rules (kube-proxy's
    /// canary check, counted by `switchyard_idle_checks_total`) asks for a full resync only when
    /// they changed, and `None` when they are intact (the round syncs only if something changed).
    async fn full_sync_wanted(&mut self, d: Driver) -> Result<(Driver, Option<bool>)> {
        let idle = self.runner.take_idle();
        if self.runner.begin(Instant::now()) {
            return Ok((d, Some(true)));
        }
        if !idle || d.switching() {
            return Ok((d, Some(false)));
        }
        let (d, intact) = on_blocking_thread("idle check", d, Driver::rules_intact).await?;
        let result = match intact {
            Some(true) => "intact",
            Some(false) => "changed",
            None => "unchecked",
        };
        self.shared
            .metrics
            .idle_checks
            .get_or_create(&crate::metrics::CheckResult {
                result: result.into(),
            })
            .inc();
        Ok((d, (intact != Some(true)).then_some(true)))
    }

    /// After a successful sync: takeover, one switch step, registration and the status report.
    /// `idle`: no sync ran (an idle period with our rules intact); the status keeps the last sync's
    /// figures.
    async fn after_sync(
        &mut self,
        d: Driver,
        wish: &Wish,
        synced: &sync::Synced,
        snapshot: &Arc<crate::model::DualSnapshot>,
        idle: bool,
    ) -> Result<Driver> {
        self.takeover.after_sync(&d, &self.shared).await?;
        let supported = &self.config.capabilities.supported_modes;
        let named = lock(&self.shared.tracker).proxy_name().is_some();
        let (mut d, again) = step::step(&self.client, d, supported, wish, snapshot, named).await?;
        if again {
            self.runner.again();
        }
        let node = &self.config.node_name;
        registration::register_if_asked(&self.client, node, &self.shared, &mut d).await;
        let problem = i64::from(d.state_problem.is_some());
        self.shared.metrics.state_file_problem.set(problem);
        let last = status::LastSync {
            stats: &synced.stats,
            took: synced.took,
            snapshot,
            idle,
        };
        if self.reporter.report(&mut d, wish, last).await {
            self.runner.again();
        }
        Ok(d)
    }
}
