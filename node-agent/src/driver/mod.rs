//! The switch driver: owns the backends, runs [`crate::switch`]'s steps against the kernel,
//! persists progress (write-ahead, before each effect) and runs the health gate's probes.

use std::{
    collections::BTreeMap,
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use switchyard_crds::v1alpha1::{HealthGate, ProbeResult, ProxyMode, SwitchPhase};

use crate::{
    backend::{self, Backend, BackendError, Presence, Settings, SyncStats},
    model::{Changes, DualSnapshot, Protocol, ServiceName},
    state_store::{Loaded, StateStore},
    switch::{self, Desired, Gate, GateProgress, Phase, Step, SwitchState},
};

/// Outcome of a finished switch, for NodeProxy status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// Mode before.
    pub from: ProxyMode,
    /// Mode requested.
    pub to: ProxyMode,
    /// `Succeeded`, `RolledBack` or `Failed`.
    pub result: &'static str,
    /// Why.
    pub reason: String,
    /// Token answered.
    pub token: Option<String>,
    /// When the switch started (this agent's clock).
    pub started: Option<k8s_openapi::jiff::Timestamp>,
    /// When it ended.
    pub finished: k8s_openapi::jiff::Timestamp,
}

/// Why the persisted state is not what the agent runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateProblem {
    /// `StateFileCorrupt`, `StateFileStale`, `StateFileMissing` or `StateFileUnwritable`.
    pub reason: &'static str,
    /// What was found and what the agent does about it.
    pub message: String,
}

/// The driver.
pub struct Driver {
    backends: BTreeMap<ProxyMode, Box<dyn Backend>>,
    /// Persisted state.
    pub state: SwitchState,
    store: Box<dyn StateStore>,
    /// What the store held at start, until the first sync reconciles it with the kernel.
    loaded: Option<Loaded>,
    /// The persisted state could not be trusted at start (why), or the last store failed.
    pub state_problem: Option<StateProblem>,
    /// The in-memory state is ahead of the store (a store after an effect failed): retried.
    unsaved: bool,
    settings: Settings,
    iptables_variant: String,
    /// The mode of `--mode`, used when neither the store nor the kernel says more.
    initial: ProxyMode,
    recovered: bool,
    cut_over_at: Option<Instant>,
    healthy_since: Option<Instant>,
    failures: u32,
    /// Latest probe results.
    pub probes: Vec<ProbeResult>,
    /// The last finished switch (reported once, then kept for status).
    pub last: Option<Finished>,
    /// Set when something a person should see changed (phase, result).
    pub dirty: bool,
    started: Option<k8s_openapi::jiff::Timestamp>,
}

fn phase_api(p: Phase) -> SwitchPhase {
    match p {
        Phase::Active => SwitchPhase::Active,
        Phase::Preparing => SwitchPhase::Preparing,
        Phase::CutOver => SwitchPhase::CutOver,
        Phase::Verifying => SwitchPhase::Verifying,
        Phase::Cleaning => SwitchPhase::Cleaning,
        Phase::RollingBack => SwitchPhase::RollingBack,
    }
}

impl Driver {
    /// A driver starting from the persisted state (or Active in `initial`); the first sync checks
    /// that state against the kernel before anything is programmed.
    pub fn new(
        store: Box<dyn StateStore>,
        initial: ProxyMode,
        settings: Settings,
        iptables_variant: String,
    ) -> Self {
        let loaded = store.load();
        let state = match &loaded {
            Loaded::Valid(state) => state.clone(),
            Loaded::Absent | Loaded::Corrupt(_) => SwitchState::active(initial),
        };
        Self {
            backends: BTreeMap::new(),
            state,
            store,
            loaded: Some(loaded),
            state_problem: None,
            unsaved: false,
            settings,
            iptables_variant,
            initial,
            recovered: false,
            cut_over_at: None,
            healthy_since: None,
            failures: 0,
            probes: Vec::new(),
            last: None,
            dirty: true,
            started: None,
        }
    }

    /// Phase for the API.
    pub fn phase(&self) -> SwitchPhase {
        phase_api(self.state.phase)
    }

    /// Whether a switch is under way (probes need a fast tick).
    pub fn switching(&self) -> bool {
        self.state.phase != Phase::Active
    }

    fn backend(&mut self, mode: ProxyMode) -> &mut Box<dyn Backend> {
        let (settings, variant) = (self.settings.clone(), self.iptables_variant.clone());
        self.backends
            .entry(mode)
            .or_insert_with(|| backend::new_backend(mode, settings, &variant))
    }

    /// New settings (node addresses, CIDR): rebuild the backends, next sync is full.
    pub fn set_settings(&mut self, settings: Settings) {
        if settings != self.settings {
            self.settings = settings;
            self.backends.clear();
        }
    }

    /// Stores the current state; false (logged, reported) when the store failed.
    fn persist(&mut self) -> bool {
        self.dirty = true;
        match self.store.store(&self.state) {
            Ok(()) => {
                self.unsaved = false;
                if self
                    .state_problem
                    .as_ref()
                    .is_some_and(|p| p.reason == "StateFileUnwritable")
                {
                    self.state_problem = None;
                }
                fault_pause(self.state.phase);
                true
            }
            Err(e) => {
                tracing::error!(store = %self.store.location(), error = %e, phase = ?self.state.phase, "cannot persist the switch state");
                self.state_problem = Some(StateProblem {
                    reason: "StateFileUnwritable",
                    message: format!(
                        "cannot write {}: {e}; switch steps wait until it can be written",
                        self.store.location()
                    ),
                });
                self.unsaved = true;
                false
            }
        }
    }

    /// Write-ahead: makes `next` the state only once it is stored; on a store failure the state
    /// stays as it was and the caller must not run the step's effect.
    fn commit(&mut self, next: SwitchState) -> bool {
        let previous = std::mem::replace(&mut self.state, next);
        if self.persist() {
            true
        } else {
            self.state = previous;
            false
        }
    }

    /// Syncs every present backend (the serving one, and the target during a switch). On the
    /// first call, recovers from the persisted state first: programs the backend that must serve,
    /// then removes every other backend's objects.
    pub fn sync(
        &mut self,
        snapshot: &DualSnapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        if !self.recovered {
            return self.recover(snapshot, changes);
        }
        let active = self.state.active;
        let stats = self.backend(active).sync(snapshot, changes, full)?;
        if let Some(target) = self
            .state
            .target
            .filter(|t| *t != active && self.backends.contains_key(t))
        {
            self.backend(target).sync(snapshot, changes, full)?;
        }
        Ok(stats)
    }

    /// What the kernel holds of each backend, read back; a backend that cannot be read counts as
    /// absent (logged).
    fn kernel_view(&self) -> Vec<(ProxyMode, Presence)> {
        ProxyMode::ALL
            .iter()
            .map(|&mode| {
                let b = backend::new_backend(mode, self.settings.clone(), &self.iptables_variant);
                let presence = b.presence().unwrap_or_else(|e| {
                    tracing::warn!(%mode, error = %e, "cannot read this backend's kernel state; taking it as absent");
                    Presence::Absent
                });
                (mode, presence)
            })
            .collect()
    }

    /// The first sync: checks the persisted state against the kernel (an unreadable or stale
    /// state never decides alone), then programs the backend that must serve and removes every
    /// other backend's objects.
    fn recover(&mut self, snapshot: &DualSnapshot, changes: &Changes) -> Result<SyncStats, BackendError> {
        if let Some(loaded) = self.loaded.take() {
            let kernel = self.kernel_view();
            let start = switch::start_state(&loaded, &kernel, self.initial);
            tracing::info!(?kernel, store = %self.store.location(), serving = %start.state.active, "start state");
            if let Some((reason, message)) = start.problem {
                tracing::warn!(reason, %message, "the persisted switch state is not trusted");
                self.state_problem = Some(StateProblem { reason, message });
            }
            if let Some((result, reason)) = start.result {
                self.last = Some(Finished {
                    from: self.state.active,
                    to: start.state.active,
                    result,
                    reason,
                    token: start.state.answered.clone(),
                    started: None,
                    finished: k8s_openapi::jiff::Timestamp::now(),
                });
            }
            self.state = start.state;
        }
        let r = switch::recover(&self.state);
        let serve = r.serve;
        let b = self.backend(serve);
        b.set_bypass(false)?;
        let stats = b.sync(snapshot, changes, true)?;
        for mode in r.remove {
            let mut other = backend::new_backend(mode, self.settings.clone(), &self.iptables_variant);
            other.cleanup()?;
        }
        if let Some((result, reason)) = r.result {
            self.last = Some(Finished {
                from: self.state.active,
                to: self.state.target.unwrap_or(serve),
                result,
                reason,
                token: self.state.token.clone(),
                started: None,
                finished: k8s_openapi::jiff::Timestamp::now(),
            });
        }
        if self.state.phase != Phase::Active {
            tracing::warn!(phase = ?self.state.phase, serving = %serve, "recovered an interrupted switch");
        }
        self.state = r.state;
        // After the effect: a failed store is retried before any switch step (`unsaved`).
        self.persist();
        self.recovered = true;
        Ok(stats)
    }

    /// Runs one step of the switch; returns whether another step should follow at once.
    pub fn step(
        &mut self,
        desired: Option<&Desired>,
        supported: &[ProxyMode],
        gate: &HealthGate,
        snapshot: &DualSnapshot,
        probe_targets: &[ServiceName],
    ) -> bool {
        if !self.recovered || (self.unsaved && !self.persist()) {
            return false; // write-ahead: no step while the store is behind
        }
        let g = Gate {
            min_healthy: Duration::from_secs(u64::from(gate.min_healthy_seconds)),
            timeout: Duration::from_secs(u64::from(gate.timeout_seconds)),
            failure_threshold: gate.failure_threshold.max(1),
        };
        let progress = GateProgress {
            elapsed: self.cut_over_at.map(|t| t.elapsed()).unwrap_or_default(),
            healthy_for: self.healthy_since.map(|t| t.elapsed()).unwrap_or_default(),
            consecutive_failures: self.failures,
        };
        let step = switch::decide(&self.state, desired, supported, g, progress);
        match step {
            Step::Idle => false,
            Step::Refuse { reason } => {
                let to = desired.map(|d| d.mode).unwrap_or(self.state.active);
                tracing::warn!(%reason, "switch refused");
                let answered = SwitchState {
                    answered: desired.and_then(|d| d.token.clone()),
                    ..self.state.clone()
                };
                if !self.commit(answered) {
                    return false;
                }
                self.last = Some(Finished {
                    from: self.state.active,
                    to,
                    result: "Failed",
                    reason,
                    token: self.state.answered.clone(),
                    started: self.started.take(),
                    finished: k8s_openapi::jiff::Timestamp::now(),
                });
                false
            }
            Step::Prepare { target, token } => {
                tracing::info!(from = %self.state.active, to = %target, ?token, "switch: preparing");
                let preparing = SwitchState {
                    phase: Phase::Preparing,
                    target: Some(target),
                    token,
                    ..self.state.clone()
                };
                if !self.commit(preparing) {
                    return false;
                }
                self.started = Some(k8s_openapi::jiff::Timestamp::now());
                let result = {
                    let b = self.backend(target);
                    b.set_bypass(true)
                        .and_then(|()| b.sync(snapshot, &Changes::default(), true))
                };
                match result {
                    Ok(_) => true,
                    Err(e) => self.roll_back(snapshot, format!("programming {target} failed: {e}")),
                }
            }
            Step::CutOver => {
                let (from, Some(to)) = (self.state.active, self.state.target) else {
                    return false;
                };
                if !self.commit(SwitchState {
                    phase: Phase::CutOver,
                    ..self.state.clone()
                }) {
                    return false;
                }
                // Make before break: the new entry points open before the old ones close.
                let result = self
                    .backend(to)
                    .set_bypass(false)
                    .and_then(|()| self.backend(from).set_bypass(true));
                if let Err(e) = result {
                    return self.roll_back(snapshot, format!("cut-over failed: {e}"));
                }
                tracing::info!(%from, %to, "switch: cut over, verifying");
                self.state.phase = Phase::Verifying;
                self.cut_over_at = Some(Instant::now());
                self.healthy_since = None;
                self.failures = 0;
                // After the effect: a failed store is retried before the next step.
                self.persist();
                true
            }
            Step::Verify => {
                let Some(to) = self.state.target else { return false };
                let mut results = probe_round(snapshot, probe_targets);
                match self.backend(to).verify() {
                    Ok(drift) if drift.is_empty() => {}
                    Ok(drift) => results.push(ProbeResult {
                        target: format!("{to} rules"),
                        ok: false,
                        detail: Some(drift.join("; ")),
                    }),
                    Err(e) => results.push(ProbeResult {
                        target: format!("{to} rules"),
                        ok: false,
                        detail: Some(e.to_string()),
                    }),
                }
                if results.iter().all(|r| r.ok) {
                    self.failures = 0;
                    self.healthy_since.get_or_insert_with(Instant::now);
                } else {
                    self.failures += 1;
                    self.healthy_since = None;
                    tracing::warn!(failures = self.failures, probes = ?results, "health gate probe round failed");
                }
                if results != self.probes {
                    self.dirty = true;
                }
                self.probes = results;
                false
            }
            Step::Clean => {
                let (from, Some(to)) = (self.state.active, self.state.target) else {
                    return false;
                };
                if !self.commit(SwitchState {
                    phase: Phase::Cleaning,
                    ..self.state.clone()
                }) {
                    return false;
                }
                if let Err(e) = self.backend(from).cleanup() {
                    tracing::error!(error = %e, "cleaning the old backend failed; will retry");
                    return false;
                }
                self.backends.remove(&from);
                let token = self.state.token.take();
                self.state = SwitchState {
                    phase: Phase::Active,
                    active: to,
                    target: None,
                    token: None,
                    answered: token.clone(),
                    restarts: 0,
                };
                self.persist(); // after the effect: retried before the next step on failure
                tracing::info!(%from, %to, "switch: done");
                self.last = Some(Finished {
                    from,
                    to,
                    result: "Succeeded",
                    reason: "health gate passed".into(),
                    token,
                    started: self.started.take(),
                    finished: k8s_openapi::jiff::Timestamp::now(),
                });
                false
            }
            Step::RollBack { reason } => self.roll_back(snapshot, reason),
        }
    }

    /// Returns to the old backend: un-bypass it (re-synced in full), bypass and remove the target.
    fn roll_back(&mut self, snapshot: &DualSnapshot, reason: String) -> bool {
        let from = self.state.active;
        let to = self.state.target.unwrap_or(from);
        tracing::warn!(%from, %to, %reason, "switch: rolling back");
        // Kept in memory even when the store fails, so the next step resumes the rollback (the
        // stored phase recovers to the old backend too); its effects wait for the store.
        self.state.phase = Phase::RollingBack;
        if !self.persist() {
            return false;
        }
        let restore = {
            let b = self.backend(from);
            b.set_bypass(false)
                .and_then(|()| b.sync(snapshot, &Changes::default(), true).map(|_| ()))
        };
        if let Err(e) = restore {
            tracing::error!(error = %e, "rollback: restoring the old backend failed; will retry");
            return false;
        }
        if to != from {
            let removed = self
                .backend(to)
                .set_bypass(true)
                .and_then(|()| self.backend(to).cleanup());
            if let Err(e) = removed {
                tracing::error!(error = %e, "rollback: removing the target backend failed; will retry");
                return false;
            }
            self.backends.remove(&to);
        }
        let token = self.state.token.take();
        self.state = SwitchState {
            phase: Phase::Active,
            active: from,
            target: None,
            token: None,
            answered: token.clone(),
            restarts: 0,
        };
        self.cut_over_at = None;
        self.persist(); // after the effect: retried before the next step on failure
        self.last = Some(Finished {
            from,
            to,
            result: "RolledBack",
            reason,
            token,
            started: self.started.take(),
            finished: k8s_openapi::jiff::Timestamp::now(),
        });
        false
    }
}

/// Fault injection for the crash tests: with `SWITCHYARD_FAULT_PAUSE=<Phase>` the agent stalls
/// for a minute right after persisting that phase, so a test can kill it exactly there.
fn fault_pause(phase: Phase) {
    if std::env::var("SWITCHYARD_FAULT_PAUSE").is_ok_and(|p| p == format!("{phase:?}")) {
        tracing::warn!(?phase, "fault injection: pausing after persisting the phase");
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// One probe round from this node: TCP connect to every port of each target Service's ClusterIPs
/// (both families of a dual-stack Service). A connection that is accepted means an endpoint
/// answered through the data plane.
pub fn probe_round(snapshot: &DualSnapshot, targets: &[ServiceName]) -> Vec<ProbeResult> {
    let mut results = Vec::new();
    for target in targets {
        let ports: Vec<_> = snapshot
            .families()
            .into_iter()
            .flat_map(|s| s.services.values())
            .filter(|p| &p.name.service == target && p.name.protocol == Protocol::Tcp)
            .collect();
        if ports.is_empty() {
            results.push(ProbeResult {
                target: target.to_string(),
                ok: false,
                detail: Some("no such TCP service".into()),
            });
        }
        for p in ports {
            let addr = SocketAddr::from((p.cluster_ip, p.port));
            let (ok, detail) = match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => (true, s.peer_addr().ok().map(|a| format!("connected to {a}"))),
                Err(e) => (false, Some(e.to_string())),
            };
            results.push(ProbeResult {
                target: format!("{} {addr}", p.name),
                ok,
                detail,
            });
        }
    }
    results
}
