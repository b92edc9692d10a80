//! The mode advisor's figures on this node: a window of recent sync durations (the last
//! [`WINDOW_SYNCS`] syncs within [`WINDOW_AGE`], restarted when the mode changes) with the size of
//! what the last sync programmed, and the recommendation [`switchyard_planner::advisor`] makes
//! from them and the node's capabilities. Pure (the caller passes the clocks).
//!
//! The figures go into the NodeProxy status with the status report that follows a sync, but they
//! are *published* — taken into the report — at a bounded rate: the first time, then every
//! [`REFRESH_EVERY`], or at once when the recommendation itself changes. So the status does not
//! change after every sync on their account, and the operator's pool summary (the largest figures
//! over the pool) changes at most about once a minute per node.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use switchyard_crds::v1alpha1::{Capabilities, ModeAdvice, ProxyMode, SyncMeasurements};
use switchyard_planner::advisor;

use crate::model::DualSnapshot;

/// Most syncs in the window.
pub const WINDOW_SYNCS: usize = 100;
/// Oldest sync in the window.
pub const WINDOW_AGE: Duration = Duration::from_secs(15 * 60);
/// How often unchanged advice is republished with fresh figures.
pub const REFRESH_EVERY: Duration = Duration::from_secs(60);

/// One sync as the window keeps it.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    took: Duration,
    full: bool,
}

/// What one sync did, for the window.
#[derive(Debug, Clone, Copy)]
pub struct SyncFigures {
    /// Mode the sync ran in.
    pub mode: ProxyMode,
    /// How long it took.
    pub took: Duration,
    /// Whether it was a full sync.
    pub full: bool,
    /// Service ports programmed now (both families).
    pub services: usize,
    /// Endpoints programmed now.
    pub endpoints: usize,
    /// Kernel objects of the whole desired state as the backend counted them (0 when a partial
    /// sync did not count them: the last count is kept).
    pub rules: usize,
}

impl SyncFigures {
    /// The figures of a sync of `snapshot` in `mode` (service and endpoint counts from the snapshot,
    /// which every backend programs whole, unlike its per-sync stats).
    pub fn of(mode: ProxyMode, took: Duration, full: bool, rules: usize, snapshot: &DualSnapshot) -> Self {
        let families = snapshot.families();
        Self {
            mode,
            took,
            full,
            services: families.iter().map(|s| s.services.len()).sum(),
            endpoints: families
                .iter()
                .flat_map(|s| s.endpoints.values())
                .map(Vec::len)
                .sum(),
            rules,
        }
    }
}

/// The agent's measurements and advice, and what was last published.
#[derive(Debug, Default)]
pub struct Measurer {
    mode: Option<ProxyMode>,
    samples: VecDeque<Sample>,
    last: Option<SyncFigures>,
    rules: usize,
    published: Option<(Instant, SyncMeasurements, ModeAdvice)>,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Whether two recommendations say the same thing (the figures in them may differ).
fn same_verdict(a: &ModeAdvice, b: &ModeAdvice) -> bool {
    (a.action, a.recommended_mode, &a.reasons, a.figures.mode)
        == (b.action, b.recommended_mode, &b.reasons, b.figures.mode)
}

impl Measurer {
    /// Records one successful sync at `now`; publishes (returns true) the first figures, fresh
    /// ones every [`REFRESH_EVERY`], and at once a recommendation that changed.
    pub fn record(
        &mut self,
        sync: SyncFigures,
        capabilities: &Capabilities,
        now: Instant,
        wall: Timestamp,
    ) -> bool {
        if self.mode != Some(sync.mode) {
            self.samples.clear();
            self.rules = 0;
            self.mode = Some(sync.mode);
        }
        self.samples.push_back(Sample {
            at: now,
            took: sync.took,
            full: sync.full,
        });
        while self.samples.len() > WINDOW_SYNCS
            || self
                .samples
                .front()
                .is_some_and(|s| now.saturating_duration_since(s.at) > WINDOW_AGE)
        {
            self.samples.pop_front();
        }
        if sync.rules > 0 || sync.full {
            self.rules = sync.rules;
        }
        self.last = Some(sync);
        let Some(measurements) = self.measurements(wall) else {
            return false;
        };
        let advice = advisor::node_advice(&measurements, capabilities);
        let due = match &self.published {
            None => true,
            Some((at, _, published)) => {
                now.saturating_duration_since(*at) >= REFRESH_EVERY || !same_verdict(published, &advice)
            }
        };
        if due {
            self.published = Some((now, measurements, advice));
        }
        due
    }

    /// The window's figures now.
    fn measurements(&self, wall: Timestamp) -> Option<SyncMeasurements> {
        let (mode, last) = (self.mode?, self.last?);
        let (first, newest) = (self.samples.front()?, self.samples.back()?);
        let mut took: Vec<Duration> = self.samples.iter().map(|s| s.took).collect();
        took.sort();
        let n = took.len();
        // Nearest rank: the smallest duration with at least 90 % of the syncs at or below it.
        let p90 = took[(n * 9).div_ceil(10).clamp(1, n) - 1];
        let total: Duration = took.iter().sum();
        Some(SyncMeasurements {
            mode,
            measured_at: Some(Time(wall)),
            window_seconds: i64::try_from(newest.at.saturating_duration_since(first.at).as_secs())
                .unwrap_or(i64::MAX),
            syncs: count(n),
            full_syncs: count(self.samples.iter().filter(|s| s.full).count()),
            average_millis: millis(total / u32::try_from(n).unwrap_or(u32::MAX)),
            p90_millis: millis(p90),
            max_millis: millis(took[n - 1]),
            services: count(last.services),
            endpoints: count(last.endpoints),
            rules: count(self.rules),
        })
    }

    /// The measurements and advice published last, for the status.
    pub fn published(&self) -> Option<(&SyncMeasurements, &ModeAdvice)> {
        self.published.as_ref().map(|(_, m, a)| (m, a))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use switchyard_crds::v1alpha1::AdviceAction;

    fn caps() -> Capabilities {
        let mut c = Capabilities {
            kernel_version: "6.18.0".into(),
            ..Capabilities::default()
        };
        c.nftables.usable = true;
        c
    }

    fn sync(mode: ProxyMode, ms: u64, full: bool, services: usize) -> SyncFigures {
        SyncFigures {
            mode,
            took: Duration::from_millis(ms),
            full,
            services,
            endpoints: services * 2,
            rules: if full { services * 8 } else { 0 },
        }
    }

    const WALL: Timestamp = Timestamp::UNIX_EPOCH;

    #[test]
    fn window_average_p90_max_and_counts() {
        let (mut m, t0) = (Measurer::default(), Instant::now());
        // 1..=10 × 100 ms, the first full.
        for i in 1..=10u64 {
            m.record(
                sync(ProxyMode::Iptables, i * 100, i == 1, 50),
                &caps(),
                t0 + Duration::from_secs(i),
                WALL,
            );
        }
        let w = m.measurements(WALL).unwrap();
        assert_eq!((w.syncs, w.full_syncs, w.window_seconds), (10, 1, 9));
        assert_eq!((w.average_millis, w.p90_millis, w.max_millis), (550, 900, 1000));
        // Partial syncs that counted no rules keep the full sync's count.
        assert_eq!((w.services, w.endpoints, w.rules), (50, 100, 400));
    }

    #[test]
    fn the_window_keeps_the_last_100_syncs_within_15_minutes() {
        let (mut m, t0) = (Measurer::default(), Instant::now());
        for i in 0..150u64 {
            m.record(
                sync(ProxyMode::Iptables, i, false, 10),
                &caps(),
                t0 + Duration::from_millis(i),
                WALL,
            );
        }
        let w = m.measurements(WALL).unwrap();
        assert_eq!((w.syncs, w.max_millis), (100, 149));
        let later = t0 + WINDOW_AGE + Duration::from_secs(60);
        m.record(sync(ProxyMode::Iptables, 7, false, 10), &caps(), later, WALL);
        let w = m.measurements(WALL).unwrap();
        assert_eq!((w.syncs, w.average_millis), (1, 7), "older syncs left the window");
    }

    #[test]
    fn a_mode_change_restarts_the_window() {
        let (mut m, t0) = (Measurer::default(), Instant::now());
        for i in 0..5u64 {
            m.record(
                sync(ProxyMode::Iptables, 3000, false, 10),
                &caps(),
                t0 + Duration::from_secs(i),
                WALL,
            );
        }
        assert!(m.record(
            sync(ProxyMode::Nftables, 2, true, 10),
            &caps(),
            t0 + Duration::from_secs(6),
            WALL
        ));
        let (w, a) = m.published().unwrap();
        assert_eq!((w.mode, w.syncs, w.average_millis), (ProxyMode::Nftables, 1, 2));
        assert_eq!(
            (a.action, a.recommended_mode),
            (AdviceAction::Stay, ProxyMode::Nftables)
        );
    }

    #[test]
    fn publishes_first_then_every_minute_or_when_the_verdict_changes() {
        let (mut m, t0) = (Measurer::default(), Instant::now());
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(
            m.record(sync(ProxyMode::Iptables, 100, true, 10), &caps(), at(0), WALL),
            "first"
        );
        let published: Vec<u64> = (1..=130)
            .filter(|&s| m.record(sync(ProxyMode::Iptables, 100, false, 10), &caps(), at(s), WALL))
            .collect();
        // The 5th sync drops FewSyncs from the reasons (a new verdict: at once); then a minute
        // after each publication, however many syncs ran in between.
        assert_eq!(published, [4, 64, 124]);
        assert_eq!(
            m.published().unwrap().0.syncs,
            100,
            "the window's figures at 124 s"
        );
        // The node grows past the service rule: published at once.
        assert!(m.record(
            sync(ProxyMode::Iptables, 100, false, 6000),
            &caps(),
            at(131),
            WALL
        ));
        let a = m.published().unwrap().1;
        assert_eq!(
            (a.action, a.recommended_mode),
            (AdviceAction::Switch, ProxyMode::Nftables)
        );
        assert_eq!(a.figures.services, 6000);
    }
}
