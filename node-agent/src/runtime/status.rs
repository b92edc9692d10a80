//! The status report: builds the NodeProxy status from the driver and the last sync (conditions
//! whose transition time moves only with their status), applies it when something changed or
//! every 10 s, publishes a state-file problem as an Event once, and carries the last switch
//! result over an agent restart.

use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{Api, Client};
use switchyard_crds::v1alpha1::{
    Capabilities, HEALTHY_CONDITION, HealthyReason, NodeProxy, NodeProxyStatus, SwitchOutcome, SwitchResult,
    SyncStats as StatusSync,
};

use super::{intake::Wish, registration};
use crate::{
    Error, Result,
    backend::SyncStats,
    driver::{Driver, Finished, StateProblem},
    measurements::{Measurer, SyncFigures},
    model::DualSnapshot,
    report,
};

/// How often the status is applied when nothing changed.
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// What the last sync did, for the status.
#[derive(Debug, Clone, Copy)]
pub(super) struct LastSync<'a> {
    /// The backend's stats.
    pub stats: &'a SyncStats,
    /// How long it took.
    pub took: Duration,
    /// What it programmed.
    pub snapshot: &'a DualSnapshot,
    /// No sync ran this round (an idle period, our rules intact): the status keeps the last
    /// sync's figures and the advisor's window takes no sample.
    pub idle: bool,
}

fn now_time() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn condition(type_: &str, ok: bool, reason: &str, message: String, generation: Option<i64>) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True".into() } else { "False".into() },
        reason: reason.into(),
        message,
        last_transition_time: now_time(),
        observed_generation: generation,
    }
}

/// `Healthy`: at the desired mode, and the switch answering the current token (if any) succeeded.
fn healthy_condition(driver: &Driver, wish: &Wish) -> Condition {
    let last = driver.last.as_ref();
    let current = last
        .is_some_and(|l| l.token.is_some() && l.token == wish.desired.as_ref().and_then(|d| d.token.clone()));
    let at_desired = wish
        .desired
        .as_ref()
        .is_none_or(|d| d.mode == driver.state.active)
        && !driver.switching();
    let succeeded = |l: &Finished| l.result == SwitchOutcome::Succeeded;
    let healthy = at_desired && (last.is_none_or(|l| !current || succeeded(l)));
    let healthy_condition = |ok, reason: HealthyReason, message| {
        condition(HEALTHY_CONDITION, ok, reason.as_str(), message, wish.generation)
    };
    match (healthy, last) {
        (true, Some(l)) if current => healthy_condition(
            true,
            HealthyReason::GatePassed,
            format!("{} active; health gate passed", l.to),
        ),
        (true, _) => healthy_condition(
            true,
            HealthyReason::Active,
            format!("{} active", driver.state.active),
        ),
        (false, Some(l)) if current && !succeeded(l) => {
            healthy_condition(false, HealthyReason::from(&l.result), l.reason.clone())
        }
        (false, _) => healthy_condition(
            false,
            HealthyReason::Switching,
            format!("switch phase {:?}", driver.phase()),
        ),
    }
}

/// `StateConsistent`: whether the persisted switch state can be trusted.
fn state_condition(driver: &Driver, wish: &Wish) -> Condition {
    match &driver.state_problem {
        Some(p) => condition(
            "StateConsistent",
            false,
            p.reason,
            p.message.clone(),
            wish.generation,
        ),
        None => condition(
            "StateConsistent",
            true,
            "Consistent",
            "the persisted switch state agrees with the kernel".into(),
            wish.generation,
        ),
    }
}

fn last_switch(l: &Finished) -> SwitchResult {
    SwitchResult {
        from: Some(l.from),
        to: l.to,
        result: l.result.as_str().to_owned(),
        reason: Some(l.reason.clone()),
        rollout_token: l.token.clone(),
        started_at: l.started.map(Time),
        finished_at: Some(Time(l.finished)),
    }
}

fn sync_status(sync: LastSync<'_>) -> StatusSync {
    let families = sync.snapshot.families();
    StatusSync {
        last_sync_time: Some(now_time()),
        last_sync_millis: sync.took.as_millis() as i64,
        services: families.iter().map(|s| s.services.len()).sum::<usize>() as i64,
        endpoints: families
            .iter()
            .flat_map(|s| s.endpoints.values())
            .map(Vec::len)
            .sum::<usize>() as i64,
        rules: sync.stats.rules_total as i64,
    }
}

/// The agent's whole view of its NodeProxy status. A condition's transition time is the one of
/// `previous` while its status stays.
pub(super) fn status(
    capabilities: &Capabilities,
    driver: &Driver,
    sync: Option<LastSync<'_>>,
    wish: &Wish,
    previous: &[Condition],
) -> NodeProxyStatus {
    let mut conditions = vec![healthy_condition(driver, wish), state_condition(driver, wish)];
    for c in &mut conditions {
        if let Some(p) = previous
            .iter()
            .find(|p| p.type_ == c.type_ && p.status == c.status)
        {
            c.last_transition_time = p.last_transition_time.clone();
        }
    }
    NodeProxyStatus {
        observed_generation: wish.generation,
        agent_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
        capabilities: Some(capabilities.clone()),
        active_mode: Some(driver.state.active),
        phase: Some(driver.phase()),
        last_switch: driver.last.as_ref().map(last_switch),
        probes: driver.probes.clone(),
        sync: sync.map(sync_status),
        // The mode advisor's, laid over by the reporter (published at its own pace).
        measurements: None,
        advice: None,
        // Measured by the reporter when it applies the status.
        preflight_facts: None,
        conditions,
    }
}

/// The last switch result this node reported before the agent (re)started.
async fn previous_switch(client: &Client, node: &str) -> Result<Option<Finished>> {
    let np = Api::<NodeProxy>::all(client.clone())
        .get_opt(node)
        .await
        .map_err(|source| Error::Kube {
            action: format!("get nodeproxy {node}"),
            source,
        })?;
    let Some(last) = np.and_then(|np| np.status).and_then(|s| s.last_switch) else {
        return Ok(None);
    };
    // A string this agent does not know (another version's) reads as a failure, as before.
    let result = match last.outcome() {
        SwitchOutcome::Unknown(_) => SwitchOutcome::Failed,
        known => known,
    };
    Ok(Some(Finished {
        from: last.from.unwrap_or(last.to),
        to: last.to,
        result,
        reason: last.reason.unwrap_or_default(),
        token: last.rollout_token,
        started: last.started_at.map(|t| t.0),
        finished: last
            .finished_at
            .map(|t| t.0)
            .unwrap_or_else(k8s_openapi::jiff::Timestamp::now),
    }))
}

/// Reports the node's status; keeps what was reported.
pub(super) struct StatusReporter {
    client: Client,
    node: String,
    capabilities: Capabilities,
    last_report: Option<Instant>,
    reported_conditions: Vec<Condition>,
    /// The state problem an Event was published for.
    announced: Option<StateProblem>,
    /// The last switch reported before a restart has been read.
    prior_loaded: bool,
    /// Conditions set by other parts of the loop (the conntrack sysctls'), by type.
    extra: Vec<Condition>,
    /// `extra` changed since the last report.
    extra_dirty: bool,
    /// The mode advisor's sync window and what it published.
    measurer: Measurer,
    /// The status' figures of the last round that synced (kept through idle rounds).
    last_sync: Option<StatusSync>,
}

impl StatusReporter {
    /// A reporter for `node` that has reported nothing yet.
    pub fn new(client: Client, node: String, capabilities: Capabilities) -> Self {
        Self {
            client,
            node,
            capabilities,
            last_report: None,
            reported_conditions: Vec::new(),
            announced: None,
            prior_loaded: false,
            extra: Vec::new(),
            extra_dirty: false,
            measurer: Measurer::default(),
            last_sync: None,
        }
    }

    /// Sets (`Some`) or drops (`None`) the condition of `type_`, reported with the next status.
    pub fn set_condition(&mut self, type_: &str, condition: Option<Condition>) {
        let before = self.extra.clone();
        self.extra.retain(|c| c.type_ != type_);
        self.extra.extend(condition);
        let same = |a: &[Condition], b: &[Condition]| {
            a.len() == b.len()
                && a.iter().zip(b).all(|(x, y)| {
                    (&x.type_, &x.status, &x.reason, &x.message)
                        == (&y.type_, &y.status, &y.reason, &y.message)
                })
        };
        self.extra_dirty |= !same(&before, &self.extra);
    }

    /// Publishes a new state-file problem as a Warning Event (once; retried until it is out).
    async fn announce(&mut self, problem: Option<&StateProblem>) {
        let Some(problem) = problem.filter(|p| self.announced.as_ref() != Some(*p)) else {
            return;
        };
        match report::publish_warning(&self.client, &self.node, problem.reason, &problem.message).await {
            Ok(()) => self.announced = Some(problem.clone()),
            Err(e) => tracing::warn!(error = %e, "publishing the state-file Event failed; retrying"),
        }
    }

    /// Our status is applied whole (server-side apply): carries the last switch result over a
    /// restart, or the restart would erase it. False until it has been read.
    async fn load_prior(&mut self, d: &mut Driver) -> bool {
        if self.prior_loaded {
            return true;
        }
        match previous_switch(&self.client, &self.node).await {
            Ok(prior) => {
                if d.last.is_none() {
                    d.last = prior;
                }
                self.prior_loaded = true;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the last reported switch failed; status report postponed");
                false
            }
        }
    }

    /// Reports after a sync (and the switch step): the Event of a state problem, then the status
    /// when something changed or it is due. Returns whether the loop should run again at once
    /// (our NodeProxy was gone and has been registered again).
    /// Takes a round that synced: its figures for the status, and a sample for the advisor's
    /// window; returns whether the advisor publishes.
    fn record_sync(&mut self, d: &Driver, sync: LastSync<'_>) -> bool {
        self.last_sync = Some(sync_status(sync));
        let figures = SyncFigures::of(
            d.state.active,
            sync.took,
            sync.stats.full,
            sync.stats.rules_total,
            sync.snapshot,
        );
        self.measurer.record(
            figures,
            &self.capabilities,
            Instant::now(),
            k8s_openapi::jiff::Timestamp::now(),
        )
    }

    pub async fn report(&mut self, d: &mut Driver, wish: &Wish, sync: LastSync<'_>) -> bool {
        self.announce(d.state_problem.clone().as_ref()).await;
        let advised = !sync.idle && self.record_sync(d, sync);
        let due = self.last_report.is_none_or(|t| t.elapsed() > REPORT_EVERY);
        if !(d.dirty || due || self.extra_dirty || advised) || !self.load_prior(d).await {
            return false;
        }
        let mut status = status(&self.capabilities, d, Some(sync), wish, &self.reported_conditions);
        status.sync = self.last_sync.clone();
        if let Some((measurements, advice)) = self.measurer.published() {
            status.measurements = Some(measurements.clone());
            status.advice = Some(advice.clone());
        }
        let readings = crate::preflight::Readings::read(&self.capabilities.kernel_version);
        status.preflight_facts = Some(crate::preflight::facts(
            d.state.active,
            d.settings(),
            &readings,
            now_time(),
        ));
        for c in &self.extra {
            let mut c = c.clone();
            c.observed_generation = wish.generation;
            if let Some(p) = self
                .reported_conditions
                .iter()
                .find(|p| p.type_ == c.type_ && p.status == c.status)
            {
                c.last_transition_time = p.last_transition_time.clone();
            }
            status.conditions.push(c);
        }
        match report::apply_status(&self.client, &self.node, &status).await {
            Ok(()) => {
                self.reported_conditions = status.conditions;
                self.last_report = Some(Instant::now());
                self.extra_dirty = false;
                d.dirty = false;
                false
            }
            Err(Error::Kube {
                source: kube::Error::Api(status),
                ..
            }) if status.code == 404 => registration::register_again(&self.client, &self.node, d).await,
            Err(e) => {
                tracing::warn!(error = %e, "status report failed");
                false
            }
        }
    }
}
