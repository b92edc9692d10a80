//! Driver step tests against fakes (no root): a fake kernel behind fake backends, an in-memory
//! state store that can be made to fail, scripted probe rounds and a recording fault hook.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use switchyard_crds::v1alpha1::{HealthGate, ProbeResult, ProxyMode, SwitchOutcome};

use super::{BackendFactory, Driver, FaultHook, Parts, Prober};
use crate::{
    backend::{Backend, BackendError, Presence, Settings, SyncStats, external::ExternalBackend},
    model::{Changes, DualSnapshot, NodeInfo, ServiceName},
    state_store::{Loaded, StateStore},
    switch::{Desired, Phase, SwitchState},
};

const IPT: ProxyMode = ProxyMode::Iptables;
const NFT: ProxyMode = ProxyMode::Nftables;
const IPVS: ProxyMode = ProxyMode::Ipvs;
const EXT: ProxyMode = ProxyMode::External;

/// What the fake kernel holds, and a log of every call the backends made.
#[derive(Debug, Default)]
struct Kernel {
    log: Vec<String>,
    /// Programmed modes and whether their entry points are bypassed.
    programmed: BTreeMap<ProxyMode, bool>,
    /// `(mode, operation)` that fail.
    fail: BTreeSet<(ProxyMode, &'static str)>,
    /// Drift `verify` reports per mode.
    drift: BTreeMap<ProxyMode, Vec<String>>,
    builds: usize,
    /// Another service proxy's rules are in the kernel (what mode `external` waits for).
    other_proxy: bool,
}

type Shared<T> = Arc<Mutex<T>>;

fn with<T, R>(m: &Shared<T>, f: impl FnOnce(&mut T) -> R) -> R {
    f(&mut m.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
}

struct FakeBackend {
    mode: ProxyMode,
    kernel: Shared<Kernel>,
}

impl FakeBackend {
    fn call(&self, op: &'static str, detail: String) -> Result<(), BackendError> {
        with(&self.kernel, |k| {
            k.log.push(format!("{} {op}{detail}", self.mode));
            if k.fail.contains(&(self.mode, op)) {
                Err(BackendError::Kernel {
                    backend: "fake",
                    detail: format!("{op} refused"),
                })
            } else {
                Ok(())
            }
        })
    }
}

impl Backend for FakeBackend {
    fn mode(&self) -> ProxyMode {
        self.mode
    }

    fn sync(&mut self, _: &DualSnapshot, _: &Changes, full: bool) -> Result<SyncStats, BackendError> {
        self.call("sync", format!(" full={full}"))?;
        with(&self.kernel, |k| {
            k.programmed.entry(self.mode).or_insert(false);
        });
        Ok(SyncStats {
            full,
            ..Default::default()
        })
    }

    fn cleanup(&mut self) -> Result<(), BackendError> {
        self.call("cleanup", String::new())?;
        with(&self.kernel, |k| k.programmed.remove(&self.mode));
        Ok(())
    }

    fn render_text(&self, _: &DualSnapshot) -> String {
        String::new()
    }

    fn set_bypass(&mut self, bypassed: bool) -> Result<(), BackendError> {
        self.call("bypass", format!("={bypassed}"))?;
        with(&self.kernel, |k| {
            if let Some(b) = k.programmed.get_mut(&self.mode) {
                *b = bypassed;
            } else if bypassed {
                // Bypassing first, as Prepare does: the objects come with the next sync.
                k.programmed.insert(self.mode, true);
            }
        });
        Ok(())
    }

    fn presence(&self) -> Result<Presence, BackendError> {
        Ok(with(&self.kernel, |k| match k.programmed.get(&self.mode) {
            None => Presence::Absent,
            Some(true) => Presence::Bypassed,
            Some(false) => Presence::Serving,
        }))
    }

    fn verify(&self) -> Result<Vec<String>, BackendError> {
        Ok(with(&self.kernel, |k| {
            k.drift.get(&self.mode).cloned().unwrap_or_default()
        }))
    }

    /// As the real backends: IPVS (never rebuilt) takes new settings in place, the others not.
    fn take_settings(&mut self, settings: &Settings) -> bool {
        let taken = self.mode == IPVS;
        if taken {
            with(&self.kernel, |k| {
                k.log
                    .push(format!("{} take_settings {}", self.mode, settings.node.name));
            });
        }
        taken
    }
}

struct FakeBackends(Shared<Kernel>);

impl BackendFactory for FakeBackends {
    fn build(&self, mode: ProxyMode, _: &Settings) -> Box<dyn Backend> {
        with(&self.0, |k| k.builds += 1);
        if mode == EXT {
            // The real stand-in of the other proxy, seeing the fake kernel.
            let kernel = self.0.clone();
            return Box::new(ExternalBackend::with_detector(Box::new(move || {
                with(&kernel, |k| k.other_proxy)
                    .then(|| "kube-proxy table".to_owned())
                    .into_iter()
                    .collect()
            })));
        }
        Box::new(FakeBackend {
            mode,
            kernel: self.0.clone(),
        })
    }
}

/// The store's contents and the phases whose stores fail.
#[derive(Debug)]
struct Store {
    initial: Loaded,
    stored: Vec<SwitchState>,
    fail_all: bool,
    fail_phases: Vec<Phase>,
}

struct FakeStore(Shared<Store>);

impl StateStore for FakeStore {
    fn load(&self) -> Loaded {
        with(&self.0, |s| match s.stored.last() {
            Some(state) => Loaded::Valid(state.clone()),
            None => s.initial.clone(),
        })
    }

    fn store(&mut self, state: &SwitchState) -> std::io::Result<()> {
        with(&self.0, |s| {
            if s.fail_all || s.fail_phases.contains(&state.phase) {
                return Err(std::io::Error::other("disk full"));
            }
            s.stored.push(state.clone());
            Ok(())
        })
    }

    fn location(&self) -> String {
        "memory".into()
    }
}

/// Probe rounds answer with `results` (all passing when empty) and are counted.
#[derive(Debug, Default)]
struct Probes {
    results: Vec<ProbeResult>,
    rounds: usize,
}

struct FakeProber(Shared<Probes>);

impl Prober for FakeProber {
    fn probe(&self, _: &DualSnapshot, targets: &[ServiceName]) -> Vec<ProbeResult> {
        with(&self.0, |p| {
            p.rounds += 1;
            if p.results.is_empty() {
                targets
                    .iter()
                    .map(|t| ProbeResult {
                        target: t.to_string(),
                        ok: true,
                        detail: None,
                    })
                    .collect()
            } else {
                p.results.clone()
            }
        })
    }
}

struct Recorder(Shared<Vec<Phase>>);

impl FaultHook for Recorder {
    fn persisted(&self, phase: Phase) {
        with(&self.0, |p| p.push(phase));
    }
}

struct Rig {
    kernel: Shared<Kernel>,
    store: Shared<Store>,
    probes: Shared<Probes>,
    hooked: Shared<Vec<Phase>>,
    driver: Driver,
}

fn settings(name: &str) -> Settings {
    Settings {
        node: NodeInfo {
            name: name.into(),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn targets() -> Vec<ServiceName> {
    vec![ServiceName {
        namespace: "default".into(),
        name: "kubernetes".into(),
    }]
}

fn gate(min_healthy_seconds: u32, failure_threshold: u32) -> HealthGate {
    HealthGate {
        min_healthy_seconds,
        timeout_seconds: 600,
        failure_threshold,
        ..HealthGate::default()
    }
}

fn want(mode: ProxyMode) -> Desired {
    Desired {
        mode,
        token: Some(format!("to-{mode}")),
    }
}

impl Rig {
    /// A driver in `initial` over a kernel holding `programmed` and a store holding `initial_store`.
    fn with(initial: ProxyMode, initial_store: Loaded, programmed: &[(ProxyMode, bool)]) -> Self {
        Self::build(initial, initial_store, programmed, Duration::ZERO)
    }

    /// [`Rig::with`], with probe rounds at most every `probe_every`.
    fn build(
        initial: ProxyMode,
        initial_store: Loaded,
        programmed: &[(ProxyMode, bool)],
        probe_every: Duration,
    ) -> Self {
        let kernel = Arc::new(Mutex::new(Kernel {
            programmed: programmed.iter().copied().collect(),
            ..Default::default()
        }));
        let store = Arc::new(Mutex::new(Store {
            initial: initial_store,
            stored: Vec::new(),
            fail_all: false,
            fail_phases: Vec::new(),
        }));
        let probes = Arc::new(Mutex::new(Probes::default()));
        let hooked = Arc::new(Mutex::new(Vec::new()));
        let parts = Parts {
            backends: Box::new(FakeBackends(kernel.clone())),
            store: Box::new(FakeStore(store.clone())),
            prober: Box::new(FakeProber(probes.clone())),
            faults: Arc::new(Recorder(hooked.clone())),
            probe_every,
        };
        let driver = Driver::with_parts(parts, initial, settings("n1"));
        Self {
            kernel,
            store,
            probes,
            hooked,
            driver,
        }
    }

    /// A driver in `initial` on an empty kernel and store, after its first sync.
    fn synced(initial: ProxyMode) -> Self {
        let mut rig = Self::with(initial, Loaded::Absent, &[]);
        rig.sync().expect("first sync");
        rig.take_log();
        rig
    }

    fn sync(&mut self) -> Result<SyncStats, BackendError> {
        self.driver
            .sync(&DualSnapshot::default(), &Changes::default(), false)
    }

    fn step(&mut self, desired: &Desired, gate: &HealthGate) -> bool {
        self.driver.step(
            Some(desired),
            &ProxyMode::EVERY,
            gate,
            &DualSnapshot::default(),
            &targets(),
        )
    }

    fn take_log(&self) -> Vec<String> {
        with(&self.kernel, |k| std::mem::take(&mut k.log))
    }

    fn stored_phases(&self) -> Vec<Phase> {
        with(&self.store, |s| s.stored.iter().map(|s| s.phase).collect())
    }

    fn programmed(&self) -> BTreeMap<ProxyMode, bool> {
        with(&self.kernel, |k| k.programmed.clone())
    }

    fn fail(&self, mode: ProxyMode, op: &'static str) {
        with(&self.kernel, |k| k.fail.insert((mode, op)));
    }
}

#[test]
fn no_step_runs_before_the_first_sync_which_serves_one_backend_and_removes_the_others() {
    let mut rig = Rig::with(IPT, Loaded::Absent, &[(NFT, true)]);
    assert!(!rig.step(&want(NFT), &gate(0, 1)));
    assert!(
        rig.take_log().is_empty(),
        "a step before the first sync touched the kernel"
    );
    rig.sync().expect("sync");
    assert_eq!(
        rig.take_log(),
        [
            "ipvs cleanup",
            "iptables bypass=false",
            "iptables sync full=true",
            "nftables cleanup"
        ],
        "what was absent at start is cleaned first; what serves (nftables) only after ours serve"
    );
    assert_eq!(rig.programmed(), BTreeMap::from([(IPT, false)]));
    assert_eq!(rig.stored_phases(), [Phase::Active]);
}

#[test]
fn reading_the_start_state_removes_only_absent_backends_and_the_first_sync_not_again() {
    // iptables serves as stored; a bypassed nftables table is left over.
    let mut rig = Rig::with(
        IPT,
        Loaded::Valid(SwitchState::active(IPT)),
        &[(IPT, false), (NFT, true)],
    );
    rig.driver.read_start_state();
    assert_eq!(
        rig.take_log(),
        ["ipvs cleanup"],
        "nftables is present: it waits until ours serve"
    );
    rig.sync().expect("sync");
    assert_eq!(
        rig.take_log(),
        [
            "iptables bypass=false",
            "iptables sync full=true",
            "nftables cleanup"
        ]
    );
}

#[test]
fn an_early_clean_up_that_fails_is_tried_again_after_ours_serve_and_its_error_counts() {
    let mut rig = Rig::with(IPT, Loaded::Absent, &[]);
    rig.fail(IPVS, "cleanup");
    assert!(rig.sync().is_err(), "the clean-up error is the first sync's");
    assert_eq!(
        rig.take_log(),
        [
            "ipvs cleanup",
            "nftables cleanup",
            "iptables bypass=false",
            "iptables sync full=true",
            "ipvs cleanup"
        ],
        "ours serve although a leftover could not be removed"
    );
    with(&rig.kernel, |k| k.fail.clear());
    rig.sync().expect("the next first sync");
    assert_eq!(rig.driver.state.active, IPT);
}

#[test]
fn a_switch_stores_each_phase_before_its_effect_and_cuts_over_make_before_break() {
    let mut rig = Rig::synced(IPT);
    let (desired, gate) = (want(NFT), gate(0, 3));
    assert!(
        rig.step(&desired, &gate),
        "prepare asks for the next step at once"
    );
    assert_eq!(
        rig.take_log(),
        ["nftables bypass=true", "nftables sync full=true"]
    );
    assert_eq!(rig.stored_phases().last(), Some(&Phase::Preparing));
    assert_eq!(rig.programmed(), BTreeMap::from([(IPT, false), (NFT, true)]));

    assert!(
        rig.step(&desired, &gate),
        "cut-over asks for the next step at once"
    );
    assert_eq!(
        rig.take_log(),
        ["nftables bypass=false", "iptables bypass=true"],
        "the new entry points open before the old ones close"
    );
    // Partial syncs during the switch reach both backends.
    rig.sync().expect("sync");
    assert_eq!(
        rig.take_log(),
        ["iptables sync full=false", "nftables sync full=false"]
    );

    assert!(
        !rig.step(&desired, &gate),
        "min healthy 0: the gate passes at once"
    );
    assert_eq!(rig.take_log(), ["iptables cleanup"]);
    assert_eq!(
        rig.stored_phases(),
        [
            Phase::Active,
            Phase::Preparing,
            Phase::CutOver,
            Phase::Verifying,
            Phase::Cleaning,
            Phase::Active
        ]
    );
    assert_eq!(
        *with(&rig.hooked, |h| h.clone()),
        rig.stored_phases(),
        "the hook runs after every store"
    );
    assert_eq!(rig.programmed(), BTreeMap::from([(NFT, false)]));
    let d = &rig.driver;
    assert_eq!((d.state.active, d.state.phase), (NFT, Phase::Active));
    assert_eq!(d.state.answered.as_deref(), Some("to-nftables"));
    let last = d.last.as_ref().expect("finished");
    assert_eq!(
        (last.from, last.to, last.result.clone()),
        (IPT, NFT, SwitchOutcome::Succeeded)
    );
    assert!(last.started.is_some());
    // Answered: the same wish starts nothing.
    assert!(!rig.step(&desired, &gate));
    assert!(rig.take_log().is_empty());
}

#[test]
fn a_failed_store_aborts_the_step_until_the_store_works_again() {
    let mut rig = Rig::synced(IPT);
    with(&rig.store, |s| s.fail_all = true);
    for _ in 0..2 {
        assert!(!rig.step(&want(NFT), &gate(0, 3)));
        assert!(
            rig.take_log().is_empty(),
            "an effect ran although its phase was not stored"
        );
        assert_eq!(rig.driver.state, SwitchState::active(IPT));
    }
    let problem = rig.driver.state_problem.clone().expect("reported");
    assert_eq!(problem.reason, "StateFileUnwritable");
    assert!(problem.message.contains("disk full"), "{}", problem.message);
    with(&rig.store, |s| s.fail_all = false);
    assert!(rig.step(&want(NFT), &gate(0, 3)));
    assert_eq!(rig.driver.state.phase, Phase::Preparing);
    assert!(
        rig.driver.state_problem.is_none(),
        "a store that works again clears the problem"
    );
}

#[test]
fn a_store_failing_after_an_effect_is_retried_before_the_next_step() {
    let mut rig = Rig::synced(IPT);
    let (desired, gate) = (want(NFT), gate(60, 3));
    with(&rig.store, |s| s.fail_phases.push(Phase::Verifying));
    assert!(rig.step(&desired, &gate));
    assert!(
        rig.step(&desired, &gate),
        "the cut-over ran; storing Verifying failed"
    );
    assert_eq!(rig.driver.state.phase, Phase::Verifying, "kept in memory");
    rig.take_log();
    assert!(!rig.step(&desired, &gate));
    assert_eq!(
        with(&rig.probes, |p| p.rounds),
        0,
        "no probe round while the store is behind"
    );
    with(&rig.store, |s| s.fail_phases.clear());
    assert!(!rig.step(&desired, &gate));
    assert_eq!(rig.stored_phases().last(), Some(&Phase::Verifying));
    assert_eq!(with(&rig.probes, |p| p.rounds), 1);
}

#[test]
fn a_target_that_cannot_be_programmed_is_rolled_back_and_removed() {
    let mut rig = Rig::synced(IPT);
    rig.fail(NFT, "sync");
    assert!(!rig.step(&want(NFT), &gate(0, 3)));
    assert_eq!(
        rig.take_log(),
        [
            "nftables bypass=true",
            "nftables sync full=true",
            "iptables bypass=false",
            "iptables sync full=true",
            "nftables bypass=true",
            "nftables cleanup"
        ]
    );
    assert_eq!(rig.programmed(), BTreeMap::from([(IPT, false)]));
    let last = rig.driver.last.clone().expect("finished");
    assert_eq!(last.result, SwitchOutcome::RolledBack);
    assert!(
        last.reason.contains("programming nftables failed"),
        "{}",
        last.reason
    );
    assert_eq!(rig.driver.state.answered.as_deref(), Some("to-nftables"));
    assert_eq!(rig.stored_phases().last(), Some(&Phase::Active));
}

#[test]
fn failing_probe_rounds_roll_back_at_the_threshold() {
    let mut rig = Rig::synced(IPT);
    let (desired, gate) = (want(NFT), gate(60, 2));
    with(&rig.probes, |p| {
        p.results = vec![ProbeResult {
            target: "default/kubernetes 10.96.0.1:443".into(),
            ok: false,
            detail: Some("connection refused".into()),
        }]
    });
    assert!(rig.step(&desired, &gate));
    assert!(rig.step(&desired, &gate));
    assert!(!rig.step(&desired, &gate));
    assert!(!rig.step(&desired, &gate));
    assert_eq!(
        rig.driver.state.phase,
        Phase::Verifying,
        "the threshold is reached: the next step rolls back"
    );
    assert!(rig.driver.probes.iter().any(|p| !p.ok));
    assert!(!rig.step(&desired, &gate));
    assert_eq!(with(&rig.probes, |p| p.rounds), 2);
    let last = rig.driver.last.clone().expect("finished");
    assert_eq!(last.result, SwitchOutcome::RolledBack);
    assert!(last.reason.contains("2 consecutive"), "{}", last.reason);
    assert_eq!(rig.programmed(), BTreeMap::from([(IPT, false)]));
}

#[test]
fn drifted_target_rules_fail_a_probe_round() {
    let mut rig = Rig::synced(IPT);
    let (desired, gate) = (want(NFT), gate(60, 3));
    assert!(rig.step(&desired, &gate));
    assert!(rig.step(&desired, &gate));
    with(&rig.kernel, |k| {
        k.drift.insert(NFT, vec!["chain services missing".into()])
    });
    assert!(!rig.step(&desired, &gate));
    let failed: Vec<_> = rig.driver.probes.iter().filter(|p| !p.ok).collect();
    assert_eq!(failed.len(), 1, "{:?}", rig.driver.probes);
    assert_eq!(failed[0].target, "nftables rules");
    assert_eq!(failed[0].detail.as_deref(), Some("chain services missing"));
}

#[test]
fn an_unsupported_mode_is_refused_once_without_touching_the_kernel() {
    let mut rig = Rig::synced(IPT);
    let supported = [IPT, NFT];
    let snapshot = DualSnapshot::default();
    let step = |d: &mut Driver| d.step(Some(&want(IPVS)), &supported, &gate(0, 3), &snapshot, &[]);
    assert!(!step(&mut rig.driver));
    let last = rig.driver.last.clone().expect("answered");
    assert_eq!((last.to, last.result), (IPVS, SwitchOutcome::Failed));
    assert!(last.reason.contains("cannot run ipvs"), "{}", last.reason);
    assert_eq!(rig.driver.state.answered.as_deref(), Some("to-ipvs"));
    rig.driver.last = None;
    assert!(!step(&mut rig.driver));
    assert!(rig.driver.last.is_none(), "refused again");
    assert!(rig.take_log().is_empty());
}

#[test]
fn a_restart_during_cleaning_finishes_the_switch_forward() {
    let cleaning = SwitchState {
        phase: Phase::Cleaning,
        active: IPT,
        target: Some(NFT),
        token: Some("t1".into()),
        answered: None,
        restarts: 0,
    };
    let mut rig = Rig::with(IPT, Loaded::Valid(cleaning), &[(IPT, true), (NFT, false)]);
    rig.sync().expect("sync");
    assert_eq!(rig.programmed(), BTreeMap::from([(NFT, false)]));
    let d = &rig.driver;
    assert_eq!((d.state.active, d.state.phase), (NFT, Phase::Active));
    assert_eq!(d.state.answered.as_deref(), Some("t1"));
    assert_eq!(
        d.last.as_ref().map(|l| l.result.clone()),
        Some(SwitchOutcome::Succeeded)
    );
    assert!(d.state_problem.is_none());
}

#[test]
fn a_corrupt_state_file_never_decides_alone() {
    let corrupt = Loaded::Corrupt("the state file is empty".into());
    let mut rig = Rig::with(IPT, corrupt, &[(NFT, false)]);
    rig.sync().expect("sync");
    assert_eq!(
        rig.driver.state.active, NFT,
        "the kernel's serving backend keeps serving"
    );
    assert_eq!(rig.programmed(), BTreeMap::from([(NFT, false)]));
    let problem = rig.driver.state_problem.clone().expect("reported");
    assert_eq!(problem.reason, "StateFileCorrupt");
}

#[test]
fn new_settings_rebuild_the_backends_except_during_a_switch_or_under_ipvs() {
    let builds = |rig: &Rig| with(&rig.kernel, |k| k.builds);
    let mut rig = Rig::synced(IPT);
    let before = builds(&rig);
    rig.driver.update_settings(settings("n1"));
    rig.sync().expect("sync");
    assert_eq!(builds(&rig), before, "same settings: same backends");
    rig.driver.update_settings(settings("renamed"));
    rig.sync().expect("sync");
    assert_eq!(builds(&rig), before + 1, "rebuilt with the new settings");

    assert!(rig.step(&want(NFT), &gate(60, 3)));
    let during = builds(&rig);
    rig.driver.update_settings(settings("again"));
    rig.sync().expect("sync");
    assert_eq!(builds(&rig), during, "settings wait for the switch to end");

    let mut ipvs = Rig::synced(IPVS);
    let before = builds(&ipvs);
    ipvs.driver.update_settings(settings("renamed"));
    ipvs.sync().expect("sync");
    assert_eq!(builds(&ipvs), before, "IPVS keeps the backend it serves with");
    assert!(
        ipvs.take_log().contains(&"ipvs take_settings renamed".to_owned()),
        "and takes the new settings in place"
    );
    assert_eq!(ipvs.driver.settings, settings("renamed"));
}

#[test]
fn probe_rounds_keep_their_pace_however_often_the_driver_steps() {
    let mut rig = Rig::build(IPT, Loaded::Absent, &[], Duration::from_secs(3600));
    rig.sync().expect("first sync");
    let (desired, gate) = (want(NFT), gate(60, 2));
    with(&rig.probes, |p| {
        p.results = vec![ProbeResult {
            target: "default/kubernetes 10.96.0.1:443".into(),
            ok: false,
            detail: Some("connection refused".into()),
        }]
    });
    assert!(rig.step(&desired, &gate));
    assert!(rig.step(&desired, &gate));
    for _ in 0..5 {
        assert!(!rig.step(&desired, &gate));
    }
    assert_eq!(with(&rig.probes, |p| p.rounds), 1, "one round per probe period");
    assert_eq!(
        rig.driver.state.phase,
        Phase::Verifying,
        "one failed round does not roll back"
    );
}

fn gate_timeout(min_healthy_seconds: u32, failure_threshold: u32, timeout_seconds: u32) -> HealthGate {
    HealthGate {
        timeout_seconds,
        ..gate(min_healthy_seconds, failure_threshold)
    }
}

#[test]
fn a_hand_over_waits_for_the_other_proxy_then_bypasses_and_removes_switchyards_rules() {
    let mut rig = Rig::synced(NFT);
    let (desired, gate) = (want(EXT), gate(0, 3));
    assert!(rig.step(&desired, &gate), "prepare");
    assert!(
        !rig.step(&desired, &gate),
        "no other proxy yet: wait in Preparing"
    );
    assert!(!rig.step(&desired, &gate));
    assert_eq!(rig.driver.state.phase, Phase::Preparing);
    assert!(
        rig.take_log().is_empty(),
        "nothing of ours is bypassed while waiting"
    );
    assert_eq!(rig.programmed(), BTreeMap::from([(NFT, false)]));

    with(&rig.kernel, |k| k.other_proxy = true);
    assert!(rig.step(&desired, &gate), "cut over");
    assert_eq!(rig.take_log(), ["nftables bypass=true"]);
    assert_eq!(rig.driver.state.phase, Phase::Verifying);
    assert!(!rig.step(&desired, &gate), "min healthy 0: the gate passes");
    assert_eq!(rig.take_log(), ["nftables cleanup"]);
    assert!(rig.programmed().is_empty(), "no Switchyard rules left");
    let d = &rig.driver;
    assert_eq!((d.state.active, d.state.phase), (EXT, Phase::Active));
    let last = d.last.as_ref().expect("finished");
    assert_eq!(
        (last.from, last.to, last.result.clone()),
        (NFT, EXT, SwitchOutcome::Succeeded)
    );
    // Handed over, syncs program nothing.
    rig.sync().expect("sync");
    assert!(rig.take_log().is_empty());
}

#[test]
fn a_hand_over_without_another_proxy_rolls_back_at_the_timeout_without_bypassing() {
    let mut rig = Rig::synced(NFT);
    let (desired, gate) = (want(EXT), gate_timeout(0, 3, 0));
    assert!(rig.step(&desired, &gate), "prepare");
    assert!(!rig.step(&desired, &gate), "the timeout has passed: roll back");
    let last = rig.driver.last.clone().expect("finished");
    assert_eq!(last.result, SwitchOutcome::RolledBack);
    assert!(
        last.reason.contains("no other service proxy appeared"),
        "{}",
        last.reason
    );
    let log = rig.take_log();
    assert!(!log.contains(&"nftables bypass=true".to_owned()), "{log:?}");
    assert_eq!(rig.programmed(), BTreeMap::from([(NFT, false)]));
    assert_eq!(rig.driver.state.active, NFT);
}

#[test]
fn probes_failing_through_the_other_proxy_un_bypass_switchyards_rules() {
    let mut rig = Rig::synced(IPT);
    with(&rig.kernel, |k| k.other_proxy = true);
    with(&rig.probes, |p| {
        p.results = vec![ProbeResult {
            target: "default/kubernetes 10.96.0.1:443".into(),
            ok: false,
            detail: Some("connection timed out".into()),
        }]
    });
    let (desired, gate) = (want(EXT), gate(60, 2));
    assert!(rig.step(&desired, &gate), "prepare");
    assert_eq!(rig.driver.entry_point_swaps(), 0, "prepared, not swapped");
    assert!(rig.step(&desired, &gate), "cut over");
    assert_eq!(
        rig.driver.entry_point_swaps(),
        1,
        "the cut-over swaps the entry points"
    );
    assert_eq!(rig.programmed(), BTreeMap::from([(IPT, true)]), "bypassed");
    while rig.driver.last.is_none() {
        rig.step(&desired, &gate);
    }
    let last = rig.driver.last.clone().expect("finished");
    assert_eq!((last.to, last.result), (EXT, SwitchOutcome::RolledBack));
    assert_eq!(rig.driver.entry_point_swaps(), 2, "so does the rollback");
    assert_eq!(with(&rig.probes, |p| p.rounds), 2);
    assert_eq!(
        rig.programmed(),
        BTreeMap::from([(IPT, false)]),
        "our rules are back"
    );
    assert!(rig.take_log().contains(&"iptables bypass=false".to_owned()));
    assert_eq!(rig.driver.state.active, IPT);
}

#[test]
fn a_takeover_from_external_programs_next_to_the_other_proxy_and_removes_none_of_its_objects() {
    let mut rig = Rig::with(EXT, Loaded::Valid(SwitchState::active(EXT)), &[]);
    rig.sync().expect("first sync");
    assert_eq!(
        rig.take_log(),
        ["iptables cleanup", "ipvs cleanup", "nftables cleanup"],
        "handed over: only Switchyard's own leftovers are removed"
    );
    with(&rig.kernel, |k| k.other_proxy = true);
    let (desired, gate) = (want(NFT), gate(0, 3));
    assert!(rig.step(&desired, &gate), "prepare");
    assert_eq!(
        rig.take_log(),
        ["nftables bypass=true", "nftables sync full=true"]
    );
    assert!(rig.step(&desired, &gate), "cut over");
    assert_eq!(rig.take_log(), ["nftables bypass=false"]);
    assert!(!rig.step(&desired, &gate), "gate passed, clean");
    assert!(rig.take_log().is_empty(), "cleaning `external` removes nothing");
    assert!(
        with(&rig.kernel, |k| k.other_proxy),
        "the other proxy's rules stay for the takeover"
    );
    let d = &rig.driver;
    assert_eq!((d.state.active, d.state.phase), (NFT, Phase::Active));
    assert_eq!(rig.programmed(), BTreeMap::from([(NFT, false)]));
}

/// A request with the mode the node runs and other settings (the runtime took them before the
/// step and says so): the gate decides.
fn settings_switch(rig: &mut Rig, mode: ProxyMode) -> Desired {
    rig.driver.settings_changed = true;
    Desired {
        token: Some(format!("settings-{mode}")),
        ..want(mode)
    }
}

#[test]
fn a_settings_switch_runs_the_gate_on_the_serving_backend_without_bypassing_it() {
    let mut rig = Rig::synced(NFT);
    let (desired, gate) = (settings_switch(&mut rig, NFT), gate(0, 3));
    assert!(rig.step(&desired, &gate), "prepare");
    assert!(rig.driver.switching());
    assert!(rig.step(&desired, &gate), "cut-over");
    assert!(!rig.step(&desired, &gate), "min healthy 0: the gate passes");
    assert_eq!(
        rig.take_log(),
        Vec::<String>::new(),
        "the serving backend is neither bypassed nor removed"
    );
    assert_eq!(rig.programmed(), BTreeMap::from([(NFT, false)]));
    assert_eq!(
        rig.stored_phases(),
        [
            Phase::Active,
            Phase::Preparing,
            Phase::CutOver,
            Phase::Verifying,
            Phase::Cleaning,
            Phase::Active
        ]
    );
    let d = &rig.driver;
    assert_eq!((d.state.active, d.state.phase), (NFT, Phase::Active));
    assert_eq!(d.state.answered.as_deref(), Some("settings-nftables"));
    let last = d.last.as_ref().expect("finished");
    assert_eq!(
        (last.from, last.to, last.result.clone()),
        (NFT, NFT, SwitchOutcome::Succeeded)
    );
    // Answered: not run again.
    assert!(!rig.step(&desired, &gate));
    assert!(!rig.driver.switching());
    // The same token without a settings change is no switch.
    let mut rig = Rig::synced(NFT);
    assert!(!rig.step(&want(NFT), &gate));
    assert!(!rig.driver.switching() && rig.driver.last.is_none());
}

#[test]
fn a_failed_settings_gate_rolls_back_and_keeps_the_backend_serving() {
    let mut rig = Rig::synced(NFT);
    let (desired, gate) = (settings_switch(&mut rig, NFT), gate(60, 2));
    with(&rig.probes, |p| {
        p.results = vec![ProbeResult {
            target: "default/kubernetes 10.96.0.1:443".into(),
            ok: false,
            detail: Some("connection refused".into()),
        }]
    });
    assert!(rig.step(&desired, &gate));
    assert!(rig.step(&desired, &gate));
    assert!(!rig.step(&desired, &gate));
    assert!(!rig.step(&desired, &gate));
    assert!(
        !rig.step(&desired, &gate),
        "the threshold is reached: rolled back"
    );
    let last = rig.driver.last.clone().expect("finished");
    assert_eq!((last.to, last.result), (NFT, SwitchOutcome::RolledBack));
    assert!(last.reason.contains("2 consecutive"), "{}", last.reason);
    assert_eq!(rig.driver.state.answered.as_deref(), Some("settings-nftables"));
    // The backend re-synced in full (with the settings the runtime puts back), never bypassed.
    let log = rig.take_log();
    assert_eq!(
        log,
        ["nftables bypass=false", "nftables sync full=true"],
        "{log:?}"
    );
    assert_eq!(rig.programmed(), BTreeMap::from([(NFT, false)]));
    assert!(!rig.step(&desired, &gate), "answered: not retried");
}
