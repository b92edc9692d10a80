//! The switch driver: owns the backends, runs [`crate::switch`]'s steps against the kernel,
//! persists progress (write-ahead, before each effect) and runs the health gate's probes.
//!
//! Its parts are injected ([`Parts`]): the backends come from a [`BackendFactory`], the state
//! from a [`StateStore`] whose failure aborts the step, the probe rounds from a [`Prober`], and a
//! [`FaultHook`] runs after each store.
//!
//! # Guarantees
//! - Write-ahead: a step's phase is stored before its effect runs; when the store fails the
//!   state stays as it was, the effect does not run, and no later step runs until a store
//!   succeeds.
//! - Make before break: at cut-over the target's entry points open before the old ones close.
//! - A finished switch (succeeded, rolled back, refused) leaves one backend's objects.

mod parts;
#[cfg(test)]
mod tests;

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use switchyard_crds::v1alpha1::{HealthGate, ProbeResult, ProxyMode, SwitchOutcome, SwitchPhase};

pub use parts::{
    BackendFactory, FaultHook, KernelBackends, NoFaults, PROBE_EVERY, Parts, PauseAfter, Prober, TcpProber,
    probe_round,
};

use crate::{
    backend::{Backend, BackendError, Presence, Settings, SyncStats},
    model::{Changes, DualSnapshot, ServiceName},
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
    /// How it ended (never [`SwitchOutcome::Unknown`]).
    pub result: SwitchOutcome,
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

/// The reason of a failed store.
const UNWRITABLE: &str = "StateFileUnwritable";

/// The driver.
pub struct Driver {
    backends: BTreeMap<ProxyMode, Box<dyn Backend>>,
    factory: Box<dyn BackendFactory>,
    prober: Box<dyn Prober>,
    faults: Arc<dyn FaultHook>,
    probe_every: Duration,
    last_round: Option<Instant>,
    /// Persisted state.
    pub state: SwitchState,
    store: Box<dyn StateStore>,
    /// What the store held at start, until the first sync reconciles it with the kernel.
    loaded: Option<Loaded>,
    /// The backends removed when the start state was read (absent then; see `clean_absent`).
    cleaned_early: Vec<ProxyMode>,
    /// The persisted state could not be trusted at start (why), or the last store failed.
    pub state_problem: Option<StateProblem>,
    /// The in-memory state is ahead of the store (a store after an effect failed): retried.
    unsaved: bool,
    settings: Settings,
    /// The mode of `--mode`, used when neither the store nor the kernel says more.
    initial: ProxyMode,
    recovered: bool,
    /// When Preparing started (a target that waits, mode `external`, has the gate's timeout).
    prepared_at: Option<Instant>,
    cut_over_at: Option<Instant>,
    /// How often the serving entry points changed hands (cut-overs and rollbacks).
    entry_point_swaps: u64,
    healthy_since: Option<Instant>,
    failures: u32,
    /// Latest probe results.
    pub probes: Vec<ProbeResult>,
    /// The last finished switch (reported once, then kept for status).
    pub last: Option<Finished>,
    /// Set when something a person should see changed (phase, result).
    pub dirty: bool,
    started: Option<k8s_openapi::jiff::Timestamp>,
    /// The request brings other policy settings than the node ran before it (set by the runtime
    /// each round): with the mode the node runs, a settings switch.
    pub settings_changed: bool,
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

fn gate_of(gate: &HealthGate) -> Gate {
    Gate {
        min_healthy: Duration::from_secs(u64::from(gate.min_healthy_seconds)),
        timeout: Duration::from_secs(u64::from(gate.timeout_seconds)),
        failure_threshold: gate.failure_threshold.max(1),
    }
}

impl Driver {
    /// A driver on the kernel's backends ([`Parts::kernel`]) persisting to `store`.
    pub fn new(
        store: Box<dyn StateStore>,
        initial: ProxyMode,
        settings: Settings,
        iptables_variant: String,
    ) -> Self {
        Self::with_parts(Parts::kernel(store, iptables_variant), initial, settings)
    }

    /// A driver starting from the persisted state (or Active in `initial`); the first sync checks
    /// that state against the kernel before anything is programmed.
    pub fn with_parts(parts: Parts, initial: ProxyMode, settings: Settings) -> Self {
        let loaded = parts.store.load();
        let state = match &loaded {
            Loaded::Valid(state) => state.clone(),
            Loaded::Absent | Loaded::Corrupt(_) => SwitchState::active(initial),
        };
        Self {
            backends: BTreeMap::new(),
            factory: parts.backends,
            prober: parts.prober,
            faults: parts.faults,
            probe_every: parts.probe_every,
            last_round: None,
            state,
            store: parts.store,
            loaded: Some(loaded),
            cleaned_early: Vec::new(),
            state_problem: None,
            unsaved: false,
            settings,
            initial,
            recovered: false,
            prepared_at: None,
            cut_over_at: None,
            entry_point_swaps: 0,
            healthy_since: None,
            failures: 0,
            probes: Vec::new(),
            last: None,
            dirty: true,
            started: None,
            settings_changed: false,
        }
    }

    /// Phase for the API.
    pub fn phase(&self) -> SwitchPhase {
        phase_api(self.state.phase)
    }

    /// How often the serving entry points changed hands (a cut-over, a rollback): after each,
    /// flows that no rules NATed are forgotten (`conntrack::UnnatedServiceFlows`).
    pub fn entry_point_swaps(&self) -> u64 {
        self.entry_point_swaps
    }

    /// Whether a switch is under way (probes need a fast tick).
    pub fn switching(&self) -> bool {
        self.state.phase != Phase::Active
    }

    fn backend(&mut self, mode: ProxyMode) -> &mut Box<dyn Backend> {
        let (factory, settings) = (&self.factory, &self.settings);
        self.backends
            .entry(mode)
            .or_insert_with(|| factory.build(mode, settings))
    }

    /// The settings the backends are built with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// New settings (node addresses, CIDR): rebuild the backends, next sync is full.
    pub fn set_settings(&mut self, settings: Settings) {
        if settings != self.settings {
            self.settings = settings;
            self.backends.clear();
        }
    }

    /// Takes new settings where that is safe: not during a switch (they wait for its end). The
    /// serving backend is rebuilt if it may be ([`Backend::rebuild_with_new_settings`]), or else
    /// takes them in place ([`Backend::take_settings`]; the others are rebuilt when used); one
    /// that takes neither keeps the settings it was built with.
    pub fn update_settings(&mut self, settings: Settings) {
        if self.switching() || settings == self.settings {
            return;
        }
        let active = self.state.active;
        if self.backend(active).rebuild_with_new_settings() {
            self.set_settings(settings);
        } else if self.backend(active).take_settings(&settings) {
            self.backends.retain(|mode, _| *mode == active);
            self.settings = settings;
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
                    .is_some_and(|p| p.reason == UNWRITABLE)
                {
                    self.state_problem = None;
                }
                self.faults.persisted(self.state.phase);
                true
            }
            Err(e) => {
                tracing::error!(store = %self.store.location(), error = %e, phase = ?self.state.phase, "cannot persist the switch state");
                self.state_problem = Some(StateProblem {
                    reason: UNWRITABLE,
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

    /// Records a finished switch for status.
    fn finish(
        &mut self,
        from: ProxyMode,
        to: ProxyMode,
        result: SwitchOutcome,
        reason: String,
        token: Option<String>,
    ) {
        self.last = Some(Finished {
            from,
            to,
            result,
            reason,
            token,
            started: self.started.take(),
            finished: k8s_openapi::jiff::Timestamp::now(),
        });
    }

    /// Active in `active` again after a switch that answered `token`.
    fn settle(&mut self, active: ProxyMode, token: Option<String>) {
        self.state = SwitchState {
            phase: Phase::Active,
            active,
            target: None,
            token: None,
            answered: token,
            restarts: 0,
        };
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

    /// Whether the backends this driver programs still hold their rules, by each one's cheap
    /// check ([`Backend::intact`]): `Some(true)` intact; `Some(false)` changed, or the check
    /// failed (both logged), so the next sync is full; `None` when a backend has no cheap check
    /// (IPVS: it resyncs in full after every idle period, quietly).
    pub fn rules_intact(&mut self) -> Option<bool> {
        let active = self.state.active;
        let target = self
            .state
            .target
            .filter(|t| *t != active && self.backends.contains_key(t));
        let mut verdict = Some(true);
        for mode in [Some(active), target].into_iter().flatten() {
            match self.backend(mode).intact() {
                Ok(Some(true)) => {}
                Ok(None) => verdict = verdict.and(None),
                Ok(Some(false)) => {
                    tracing::warn!(%mode, "our rules changed under us since the last sync: syncing in full");
                    return Some(false);
                }
                Err(e) => {
                    tracing::warn!(%mode, error = %e, "cannot check our rules in the kernel: syncing in full");
                    return Some(false);
                }
            }
        }
        verdict
    }

    /// What the kernel holds of each backend, read back; a backend that cannot be read counts as
    /// absent (logged). Also: the modes read back as absent (not the unreadable ones).
    fn kernel_view(&self) -> (Vec<(ProxyMode, Presence)>, Vec<ProxyMode>) {
        let mut absent = Vec::new();
        let view = ProxyMode::ALL
            .iter()
            .map(|&mode| {
                let b = self.factory.build(mode, &self.settings);
                let presence = match b.presence() {
                    Ok(presence) => {
                        if presence == Presence::Absent {
                            absent.push(mode);
                        }
                        presence
                    }
                    Err(e) => {
                        tracing::warn!(%mode, error = %e, "cannot read this backend's kernel state; taking it as absent");
                        Presence::Absent
                    }
                };
                (mode, presence)
            })
            .collect();
        (view, absent)
    }

    /// Checks what the store held at start against the kernel (an unreadable or stale state
    /// never decides alone) and takes the start state.
    /// Reads the start state now (the store was read when the driver was made; this reads the
    /// kernel) instead of at the first sync, which then only programs.
    pub fn read_start_state(&mut self) {
        self.reconcile_loaded();
    }

    fn reconcile_loaded(&mut self) {
        let Some(loaded) = self.loaded.take() else { return };
        let (kernel, absent) = self.kernel_view();
        let start = switch::start_state(&loaded, &kernel, self.initial);
        tracing::info!(?kernel, store = %self.store.location(), serving = %start.state.active, "start state");
        if let Some((reason, message)) = start.problem {
            tracing::warn!(reason, %message, "the persisted switch state is not trusted");
            self.state_problem = Some(StateProblem { reason, message });
        }
        if let Some((result, reason)) = start.result {
            let (from, to, token) = (
                self.state.active,
                start.state.active,
                start.state.answered.clone(),
            );
            self.started = None;
            self.finish(from, to, result, reason, token);
        }
        self.state = start.state;
        self.clean_absent(&absent);
    }

    /// Removes what may be left of the backends that will not serve and that the kernel showed
    /// absent at start. Nothing of theirs serves, so this need not wait for ours (make before
    /// break is for the present ones, which the first sync removes after ours serve), and done
    /// now — from [`Driver::read_start_state`], while intake lists — it neither delays our rules
    /// nor reads them: a clean-up that reads a table whole (IPVS's on iptables-legacy) read our
    /// 10k Services too after the first sync (0.24 s of it). A failed one is left to the first
    /// sync, whose error it then is.
    fn clean_absent(&mut self, absent: &[ProxyMode]) {
        for mode in switch::recover(&self.state).remove {
            if absent.contains(&mode) && self.factory.build(mode, &self.settings).cleanup().is_ok() {
                tracing::debug!(%mode, "removed what was left of a backend absent at start");
                self.cleaned_early.push(mode);
            }
        }
    }

    /// The first sync: reconciles the persisted state with the kernel, then programs the backend
    /// that must serve and removes every other backend's objects.
    fn recover(&mut self, snapshot: &DualSnapshot, changes: &Changes) -> Result<SyncStats, BackendError> {
        self.reconcile_loaded();
        let r = switch::recover(&self.state);
        let serve = r.serve;
        let b = self.backend(serve);
        b.set_bypass(false)?;
        let stats = b.sync(snapshot, changes, true)?;
        for mode in r.remove {
            if !self.cleaned_early.contains(&mode) {
                self.factory.build(mode, &self.settings).cleanup()?;
            }
        }
        if let Some((result, reason)) = r.result {
            let (from, to, token) = (
                self.state.active,
                self.state.target.unwrap_or(serve),
                self.state.token.clone(),
            );
            self.started = None;
            self.finish(from, to, result, reason, token);
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
        let progress = GateProgress {
            elapsed: self.cut_over_at.map(|t| t.elapsed()).unwrap_or_default(),
            healthy_for: self.healthy_since.map(|t| t.elapsed()).unwrap_or_default(),
            consecutive_failures: self.failures,
            target_waiting: self.target_waiting(),
            preparing_for: self.prepared_at.map(|t| t.elapsed()).unwrap_or_default(),
            settings_changed: self.settings_changed,
        };
        match switch::decide(&self.state, desired, supported, gate_of(gate), progress) {
            Step::Idle | Step::AwaitTarget => false,
            Step::Refuse { reason } => self.refuse(desired, reason),
            Step::Prepare { target, token } => self.prepare(target, token, snapshot),
            Step::CutOver => self.cut_over(snapshot),
            Step::Verify => self.verify(snapshot, probe_targets),
            Step::Clean => self.clean(),
            Step::RollBack { reason } => self.roll_back(snapshot, reason),
        }
    }

    /// In Preparing: whether the target still waits for something outside Switchyard (logged
    /// when it changes is not needed: the phase shows Preparing meanwhile).
    fn target_waiting(&mut self) -> bool {
        let (Phase::Preparing, Some(target)) = (self.state.phase, self.state.target) else {
            return false;
        };
        let waiting = self.backend(target).waiting_for();
        if let Some(what) = &waiting {
            tracing::debug!(%target, waiting_for = %what, "switch: target not ready yet");
        }
        waiting.is_some()
    }

    /// The node cannot run the desired mode: answers the token with a failure.
    fn refuse(&mut self, desired: Option<&Desired>, reason: String) -> bool {
        let to = desired.map(|d| d.mode).unwrap_or(self.state.active);
        tracing::warn!(%reason, "switch refused");
        let answered = SwitchState {
            answered: desired.and_then(|d| d.token.clone()),
            ..self.state.clone()
        };
        if self.commit(answered) {
            let (from, token) = (self.state.active, self.state.answered.clone());
            self.finish(from, to, SwitchOutcome::Failed, reason, token);
        }
        false
    }

    /// Programs the target backend in full, bypassed (no packet enters it yet).
    fn prepare(&mut self, target: ProxyMode, token: Option<String>, snapshot: &DualSnapshot) -> bool {
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
        self.prepared_at = Some(Instant::now());
        if target == self.state.active {
            // A settings switch: the serving backend was rebuilt with the new settings and synced.
            return true;
        }
        let b = self.backend(target);
        let result = b
            .set_bypass(true)
            .and_then(|()| b.sync(snapshot, &Changes::default(), true));
        match result {
            Ok(_) => true,
            Err(e) => self.roll_back(snapshot, format!("programming {target} failed: {e}")),
        }
    }

    /// Swaps the entry points, make before break, and starts the health gate.
    fn cut_over(&mut self, snapshot: &DualSnapshot) -> bool {
        let (from, Some(to)) = (self.state.active, self.state.target) else {
            return false;
        };
        if !self.commit(SwitchState {
            phase: Phase::CutOver,
            ..self.state.clone()
        }) {
            return false;
        }
        // Make before break: the new entry points open before the old ones close (a settings
        // switch keeps its one backend open).
        let result = if from == to {
            Ok(())
        } else {
            self.backend(to)
                .set_bypass(false)
                .and_then(|()| self.backend(from).set_bypass(true))
        };
        if let Err(e) = result {
            return self.roll_back(snapshot, format!("cut-over failed: {e}"));
        }
        self.entry_point_swaps += 1;
        tracing::info!(%from, %to, "switch: cut over, verifying");
        self.state.phase = Phase::Verifying;
        self.cut_over_at = Some(Instant::now());
        self.last_round = None;
        self.healthy_since = None;
        self.failures = 0;
        // After the effect: a failed store is retried before the next step.
        self.persist();
        true
    }

    /// The target's rules read back, as a probe result when they drifted (or cannot be read).
    fn drift(&mut self, to: ProxyMode) -> Option<ProbeResult> {
        let detail = match self.backend(to).verify() {
            Ok(drift) if drift.is_empty() => return None,
            Ok(drift) => drift.join("; "),
            Err(e) => e.to_string(),
        };
        Some(ProbeResult {
            target: format!("{to} rules"),
            ok: false,
            detail: Some(detail),
        })
    }

    /// One health-gate round: the probes and the target's rules.
    fn verify(&mut self, snapshot: &DualSnapshot, probe_targets: &[ServiceName]) -> bool {
        let Some(to) = self.state.target else { return false };
        if self.last_round.is_some_and(|t| t.elapsed() < self.probe_every) {
            return false;
        }
        self.last_round = Some(Instant::now());
        let mut results = self.prober.probe(snapshot, probe_targets);
        results.extend(self.drift(to));
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

    /// The gate passed: removes the old backend; the target serves alone.
    fn clean(&mut self) -> bool {
        let (from, Some(to)) = (self.state.active, self.state.target) else {
            return false;
        };
        if !self.commit(SwitchState {
            phase: Phase::Cleaning,
            ..self.state.clone()
        }) {
            return false;
        }
        if from != to {
            if let Err(e) = self.backend(from).cleanup() {
                tracing::error!(error = %e, "cleaning the old backend failed; will retry");
                return false;
            }
            self.backends.remove(&from);
        }
        let token = self.state.token.take();
        self.settle(to, token.clone());
        self.persist(); // after the effect: retried before the next step on failure
        tracing::info!(%from, %to, "switch: done");
        self.finish(
            from,
            to,
            SwitchOutcome::Succeeded,
            "health gate passed".into(),
            token,
        );
        false
    }

    /// Un-bypasses the old backend, re-synced in full.
    fn restore(&mut self, from: ProxyMode, snapshot: &DualSnapshot) -> Result<(), BackendError> {
        let b = self.backend(from);
        b.set_bypass(false)?;
        b.sync(snapshot, &Changes::default(), true).map(|_| ())
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
        if let Err(e) = self.restore(from, snapshot) {
            tracing::error!(error = %e, "rollback: restoring the old backend failed; will retry");
            return false;
        }
        self.entry_point_swaps += 1;
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
        self.settle(from, token.clone());
        self.cut_over_at = None;
        self.persist(); // after the effect: retried before the next step on failure
        self.finish(from, to, SwitchOutcome::RolledBack, reason, token);
        false
    }
}
