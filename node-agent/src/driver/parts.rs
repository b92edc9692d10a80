//! The parts a [`super::Driver`] is built from, each behind a trait so that its steps can be
//! tested against fakes without root: the backends (a factory), the data-plane prober and the
//! fault hook. (The state store's trait is [`crate::state_store::StateStore`].)

use std::{
    net::{SocketAddr, TcpStream},
    sync::Arc,
    time::Duration,
};

use switchyard_crds::v1alpha1::{ProbeResult, ProxyMode};

use crate::{
    backend::{self, Backend, Settings},
    model::{DualSnapshot, Protocol, ServiceName},
    state_store::StateStore,
    switch::Phase,
};

/// Builds the backend of a mode.
///
/// # Guarantees
/// Building touches no kernel state: a built backend programs nothing until it is synced, and
/// two backends of one mode built with the same settings own the same kernel objects (so one
/// built afresh can read back or clean up what another programmed).
pub trait BackendFactory: Send {
    /// The backend for `mode` rendering with `settings`.
    fn build(&self, mode: ProxyMode, settings: &Settings) -> Box<dyn Backend>;
}

/// The kernel's backends ([`backend::new_backend`]).
#[derive(Debug, Clone)]
pub struct KernelBackends {
    /// The iptables variant (`legacy` / `nft`) of the iptables and IPVS backends.
    pub iptables_variant: String,
}

impl BackendFactory for KernelBackends {
    fn build(&self, mode: ProxyMode, settings: &Settings) -> Box<dyn Backend> {
        backend::new_backend(mode, settings.clone(), &self.iptables_variant)
    }
}

/// Checks the data plane during a switch's health gate.
pub trait Prober: Send {
    /// One probe round from this node against each target Service of `snapshot`.
    fn probe(&self, snapshot: &DualSnapshot, targets: &[ServiceName]) -> Vec<ProbeResult>;
}

/// TCP connects through the data plane ([`probe_round`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpProber;

impl Prober for TcpProber {
    fn probe(&self, snapshot: &DualSnapshot, targets: &[ServiceName]) -> Vec<ProbeResult> {
        probe_round(snapshot, targets)
    }
}

/// Called right after the driver persisted a phase: where the crash tests stop an agent.
pub trait FaultHook: Send + Sync {
    /// `phase` was just stored (before its effect runs).
    fn persisted(&self, phase: Phase);
}

/// No fault injection (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoFaults;

impl FaultHook for NoFaults {
    fn persisted(&self, _phase: Phase) {}
}

/// Stalls the driver for `pause` right after it persisted `phase`, so that a test can kill the
/// agent exactly there (the hidden `--test-pause-at` flag).
#[derive(Debug, Clone, Copy)]
pub struct PauseAfter {
    /// The phase to stall after.
    pub phase: Phase,
    /// How long.
    pub pause: Duration,
}

impl FaultHook for PauseAfter {
    fn persisted(&self, phase: Phase) {
        if phase == self.phase {
            tracing::warn!(?phase, "fault injection: pausing after persisting the phase");
            std::thread::sleep(self.pause);
        }
    }
}

/// Everything a driver is built from.
pub struct Parts {
    /// Builds the backends.
    pub backends: Box<dyn BackendFactory>,
    /// Persists the switch state (write-ahead: a step whose store fails is not run).
    pub store: Box<dyn StateStore>,
    /// Runs the health gate's probe rounds.
    pub prober: Box<dyn Prober>,
    /// Called after each store.
    pub faults: Arc<dyn FaultHook>,
    /// The shortest time between two probe rounds of the health gate (however often the driver
    /// steps), so that a burst of syncs cannot count failures faster than the gate's tick.
    pub probe_every: Duration,
}

/// The health gate's probe rounds run at most once a second (the switch's tick).
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

impl Parts {
    /// The kernel's backends, TCP probes and no fault injection, persisting to `store`.
    pub fn kernel(store: Box<dyn StateStore>, iptables_variant: String) -> Self {
        Self {
            backends: Box::new(KernelBackends { iptables_variant }),
            store,
            prober: Box::new(TcpProber),
            faults: Arc::new(NoFaults),
            probe_every: PROBE_EVERY,
        }
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
