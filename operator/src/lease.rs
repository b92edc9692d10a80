//! Leader election with a `coordination.k8s.io/v1` Lease, the way client-go's leaderelection does
//! it, written here so that it survives the API going away:
//!
//! - A candidate takes the Lease when it is free (no holder) or when its record has not changed for
//!   `leaseDurationSeconds` *as observed locally* (no clock comparison across machines); writes use
//!   the resourceVersion (optimistic concurrency), so of two candidates exactly one wins.
//! - The leader renews `grace` before expiry. When it cannot renew (API down or failing), it steps
//!   down locally once `duration` has passed since the start of its last successful renewal — before
//!   any standby can consider the Lease expired — and keeps trying. It never exits: when the API
//!   answers again it re-acquires the Lease (at once, if it still holds it) and leadership resumes.
//! - Every API call is retried with [`RetryBackoff`] (at most [`crate::retry::MAX_DELAY`] apart).
//! - On shutdown the leader releases the Lease (empty holder), so a standby takes over at once.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};
use tokio::sync::watch;

use crate::retry::{ApiState, RetryBackoff};

/// Settings of the election.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This candidate's identity.
    pub identity: String,
    /// `leaseDurationSeconds`.
    pub duration: Duration,
    /// How long before expiry the leader renews.
    pub grace: Duration,
}

/// What a candidate last saw of the Lease record.
#[derive(Debug, Clone, PartialEq)]
struct Observed {
    resource_version: Option<String>,
    at: Instant,
}

/// Outcome of one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    /// We hold the Lease (acquired or renewed).
    Held,
    /// Someone else holds a live Lease (or won the race).
    Other,
}

/// Whether a record last seen changing at `observed` (held by `holder`, lasting `duration`) may be
/// taken by `me` at `now`.
fn may_take(holder: Option<&str>, me: &str, observed: Instant, duration: Duration, now: Instant) -> bool {
    match holder {
        None | Some("") => true,
        Some(h) if h == me => true,
        Some(_) => now.saturating_duration_since(observed) > duration,
    }
}

/// Whether a leader whose last successful renewal started at `renewed` still leads at `now`.
fn still_leading(renewed: Option<Instant>, duration: Duration, now: Instant) -> bool {
    renewed.is_some_and(|r| now.saturating_duration_since(r) < duration)
}

struct Elector {
    api: Api<Lease>,
    config: LeaseConfig,
    observed: Option<Observed>,
}

impl Elector {
    fn record_duration(&self, spec: &LeaseSpec) -> Duration {
        spec.lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
            .unwrap_or(self.config.duration)
    }

    fn spec(&self, previous: Option<&LeaseSpec>) -> LeaseSpec {
        let now = MicroTime(jiff::Timestamp::now());
        let ours = previous.and_then(|p| p.holder_identity.as_deref()) == Some(self.config.identity.as_str());
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(i32::try_from(self.config.duration.as_secs()).unwrap_or(i32::MAX)),
            acquire_time: if ours {
                previous.and_then(|p| p.acquire_time.clone())
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if ours || previous.is_none() {
                transitions
            } else {
                transitions.saturating_add(1)
            }),
            ..Default::default()
        }
    }

    /// One get → create or replace round.
    async fn attempt(&mut self) -> Result<Attempt, kube::Error> {
        let name = self.config.name.clone();
        let Some(lease) = self.api.get_opt(&name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name),
                    namespace: Some(self.config.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(self.spec(None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => {
                    self.saw(&created);
                    Ok(Attempt::Held)
                }
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(Attempt::Other),
                Err(e) => Err(e),
            };
        };
        self.saw(&lease);
        let spec = lease.spec.clone().unwrap_or_default();
        let observed_at = self.observed.as_ref().map(|o| o.at).unwrap_or_else(Instant::now);
        if !may_take(
            spec.holder_identity.as_deref(),
            &self.config.identity,
            observed_at,
            self.record_duration(&spec),
            Instant::now(),
        ) {
            return Ok(Attempt::Other);
        }
        let mut next = lease.clone();
        next.spec = Some(self.spec(Some(&spec)));
        match self.api.replace(&name, &PostParams::default(), &next).await {
            Ok(written) => {
                self.saw(&written);
                Ok(Attempt::Held)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Attempt::Other),
            Err(e) => Err(e),
        }
    }

    /// Notes the record's resourceVersion; its observation time moves only when it changes.
    fn saw(&mut self, lease: &Lease) {
        let rv = lease.metadata.resource_version.clone();
        if self.observed.as_ref().map(|o| &o.resource_version) != Some(&rv) {
            self.observed = Some(Observed {
                resource_version: rv,
                at: Instant::now(),
            });
        }
    }

    /// Gives the Lease up (empty holder) if we hold it.
    async fn release(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.config.name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    }
}

/// Starts the election; the receiver says whether this replica leads. Dropping every receiver
/// ends the task, which then releases the Lease (the handle resolves when that is done).
pub fn spawn(
    client: Client,
    config: LeaseConfig,
    api_state: Arc<ApiState>,
) -> (watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(false);
    let elector = Elector {
        api: Api::namespaced(client, &config.namespace),
        config,
        observed: None,
    };
    let task = tokio::spawn(run(elector, tx, api_state));
    (rx, task)
}

async fn run(mut elector: Elector, tx: watch::Sender<bool>, api_state: Arc<ApiState>) {
    let mut backoff = RetryBackoff::new();
    let mut renewed: Option<Instant> = None;
    let duration = elector.config.duration;
    let renew_every = duration
        .saturating_sub(elector.config.grace)
        .max(Duration::from_millis(500));
    // A standby polls this often (client-go's retryPeriod is about a fifth of the duration).
    let poll = (duration / 5).clamp(Duration::from_millis(500), Duration::from_secs(5));
    let attempt_limit = (duration / 3).clamp(Duration::from_secs(1), Duration::from_secs(10));
    loop {
        let started = Instant::now();
        // A stopped (not killed) apiserver leaves requests hanging: bound each attempt, so a
        // leader still steps down in time.
        let attempt = tokio::time::timeout(attempt_limit, elector.attempt());
        let wait = tokio::select! {
            () = tx.closed() => break,
            r = attempt => match r.unwrap_or_else(|_| Err(kube::Error::Service("Lease request timed out".into()))) {
                Ok(Attempt::Held) => {
                    api_state.answered();
                    backoff = RetryBackoff::new();
                    renewed = Some(started);
                    set(&tx, true, &elector.config);
                    renew_every
                }
                Ok(Attempt::Other) => {
                    api_state.answered();
                    backoff = RetryBackoff::new();
                    renewed = None;
                    set(&tx, false, &elector.config);
                    poll
                }
                Err(e) => {
                    api_state.failed("Lease", &e);
                    let delay = backoff.next().unwrap_or(poll);
                    if *tx.borrow() && !still_leading(renewed, duration, Instant::now() + delay) {
                        tracing::warn!(identity = %elector.config.identity, error = %e, "cannot renew the Lease: stepping down until the API answers");
                        set(&tx, false, &elector.config);
                    }
                    delay
                }
            },
        };
        // While leading, wake up in time to step down if renewals keep failing.
        let deadline = renewed
            .filter(|_| *tx.borrow())
            .map(|r| (r + duration).saturating_duration_since(Instant::now()));
        let wait = deadline.map_or(wait, |d| wait.min(d));
        tokio::select! {
            () = tx.closed() => break,
            () = tokio::time::sleep(wait) => {}
        }
        if *tx.borrow() && !still_leading(renewed, duration, Instant::now()) {
            tracing::warn!(identity = %elector.config.identity, "the Lease lapsed without renewal: stepping down");
            set(&tx, false, &elector.config);
        }
    }
    if renewed.is_some() {
        match tokio::time::timeout(Duration::from_secs(3), elector.release()).await {
            Ok(Ok(())) => tracing::info!(identity = %elector.config.identity, "released the Lease"),
            Ok(Err(e)) => tracing::warn!(error = %e, "could not release the Lease"),
            Err(_) => tracing::warn!("releasing the Lease timed out"),
        }
    }
}

fn set(tx: &watch::Sender<bool>, leader: bool, config: &LeaseConfig) {
    tx.send_if_modified(|l| {
        if *l == leader {
            return false;
        }
        *l = leader;
        if leader {
            tracing::info!(identity = %config.identity, lease = %config.name, "acquired the Lease");
        } else {
            tracing::info!(identity = %config.identity, lease = %config.name, "not the leader");
        }
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_own_or_stale_records_may_be_taken() {
        let t0 = Instant::now();
        let d = Duration::from_secs(6);
        assert!(may_take(None, "a", t0, d, t0));
        assert!(may_take(Some(""), "a", t0, d, t0));
        assert!(
            may_take(Some("a"), "a", t0, d, t0),
            "our own record: renew or re-acquire at once"
        );
        assert!(!may_take(Some("b"), "a", t0, d, t0 + Duration::from_secs(5)));
        assert!(may_take(Some("b"), "a", t0, d, t0 + Duration::from_secs(7)));
    }

    #[test]
    fn a_leader_steps_down_one_duration_after_its_last_renewal_started() {
        let t0 = Instant::now();
        let d = Duration::from_secs(6);
        assert!(!still_leading(None, d, t0));
        assert!(still_leading(Some(t0), d, t0 + Duration::from_secs(5)));
        assert!(!still_leading(Some(t0), d, t0 + Duration::from_secs(6)));
    }
}
