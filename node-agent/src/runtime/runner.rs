//! The sync runner: when the proxy loop syncs and whether the sync is full. A sync waits for a
//! wake (a change, a retry, a follow-up switch step) or a tick, then for the rest of the minimum
//! period since the last sync. A failed sync and an hour without a full one force a full sync.
//! An idle tick (every sync period) asks for a check of the kernel instead ([`SyncRunner::take_idle`]):
//! the round reads back whether our rules are still in place, cheaply (kube-proxy's canary
//! check), and syncs in full only when they are not — a full resync at every idle tick cost half
//! a core at 10k Services in iptables-nft mode (issue 16). While a switch is under way the tick
//! is fast, so the health gate's probe rounds run every second.
//!
//! The minimum period and the sync period are the policy's `minSyncPeriodSeconds` and
//! `syncPeriodSeconds` when its NodeProxy spec sets them, else `--min-sync-period` and
//! `--sync-period` ([`SyncRunner::configure`] takes a change without a restart). A set minimum
//! period bounds the rate (kube-proxy's meaning). Unset, it fits the syncs' real cost ([`RateLimit::Adaptive`]): a change after a quiet
//! spell syncs at once, and a burst is coalesced for [`COALESCE`] or [`COST_FACTOR`] times what
//! the last sync round cost, whichever is longer, never more than [`ADAPTIVE_MAX`].

use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The tick while a switch is under way.
pub(super) const SWITCH_TICK: Duration = Duration::from_secs(1);
/// The longest time between full syncs, however busy the loop is with partial ones.
pub(super) const FULL_SYNC_AT_LEAST: Duration = Duration::from_secs(3600);
/// Adaptive rate limit: the shortest gap between syncs, over which a burst of events coalesces.
pub(super) const COALESCE: Duration = Duration::from_millis(5);
/// Adaptive rate limit: the gap between syncs is this many times the last round's cost, so that
/// syncing takes at most a third of a core through a sustained stream of changes.
pub(super) const COST_FACTOR: u32 = 3;
/// Adaptive rate limit: the longest gap between syncs (kube-proxy's default minimum period), and
/// the delay before a failed sync is retried.
pub(super) const ADAPTIVE_MAX: Duration = Duration::from_secs(1);

/// How syncs are rate-limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RateLimit {
    /// `--min-sync-period`: at most one sync per period, retries included.
    Fixed(Duration),
    /// Fitted to the cost of the last sync round (see the module doc).
    Adaptive,
}

impl RateLimit {
    /// `--min-sync-period` if set, else adaptive.
    pub fn of(min_sync_period: Option<Duration>) -> Self {
        min_sync_period.map_or(Self::Adaptive, Self::Fixed)
    }
}

/// Paces the proxy loop's syncs.
#[derive(Debug)]
pub(super) struct SyncRunner {
    limit: RateLimit,
    period: Duration,
    /// What the last successful round cost (from its start to the end of its sync).
    last_cost: Duration,
    /// The last sync failed: its retry waits [`ADAPTIVE_MAX`] under the adaptive limit.
    retrying: bool,
    last_sync: Option<Instant>,
    last_full: Instant,
    need_full: bool,
    /// An idle sync period passed: the next round checks that our rules are still in place.
    idle: bool,
    /// Run again without waiting for a wake (after a failure, or a step that wants a follow-up).
    again: bool,
}

impl SyncRunner {
    /// A runner whose first sync is full and may start at once.
    pub fn new(limit: RateLimit, period: Duration, now: Instant) -> Self {
        Self {
            limit,
            period,
            last_cost: Duration::ZERO,
            retrying: false,
            last_sync: None,
            last_full: now,
            need_full: true,
            idle: false,
            again: false,
        }
    }

    /// Takes the minimum and the sync period in force now (the policy's or the flags'); returns
    /// whether they changed. The pacing state (last sync, pending full sync) is kept.
    pub fn configure(&mut self, limit: RateLimit, period: Duration) -> bool {
        let changed = (self.limit, self.period) != (limit, period);
        self.limit = limit;
        self.period = period;
        changed
    }

    /// How long to wait for a wake before ticking.
    pub fn tick(&self, switching: bool) -> Duration {
        if switching { SWITCH_TICK } else { self.period }
    }

    /// The tick of `tick` passed without a wake; an idle period ends in a check of the kernel.
    pub fn ticked(&mut self, tick: Duration) {
        self.idle |= tick == self.period;
    }

    /// Whether this round follows an idle sync period (and so checks that our rules are still in
    /// place); clears the request.
    pub fn take_idle(&mut self) -> bool {
        std::mem::take(&mut self.idle)
    }

    /// The minimum period from the last sync's start to the next one's.
    pub fn min_period(&self) -> Duration {
        match self.limit {
            // A failed sync retries no sooner than a second even with a minimum period of 0,
            // so a persistent failure is not a busy loop.
            RateLimit::Fixed(period) if self.retrying => period.max(ADAPTIVE_MAX),
            RateLimit::Fixed(period) => period,
            RateLimit::Adaptive if self.retrying => ADAPTIVE_MAX,
            RateLimit::Adaptive => (self.last_cost * COST_FACTOR).clamp(COALESCE, ADAPTIVE_MAX),
        }
    }

    /// What is left of the minimum period since the last sync at `now`.
    pub fn hold(&self, now: Instant) -> Duration {
        self.last_sync
            .map(|last| {
                self.min_period()
                    .saturating_sub(now.saturating_duration_since(last))
            })
            .unwrap_or_default()
    }

    /// Waits for `wake` (or a pending [`SyncRunner::again`]) or the tick, then for the rest of
    /// the minimum period.
    pub async fn wait(&mut self, wake: &Notify, switching: bool) {
        if !std::mem::take(&mut self.again) {
            let tick = self.tick(switching);
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(tick) => self.ticked(tick),
            }
        }
        let hold = self.hold(Instant::now());
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
    }

    /// Run again soon, without waiting for a wake.
    pub fn again(&mut self) {
        self.again = true;
    }

    /// A sync starts at `now`: whether it must be full.
    pub fn begin(&mut self, now: Instant) -> bool {
        if now.saturating_duration_since(self.last_full) > FULL_SYNC_AT_LEAST {
            self.need_full = true;
        }
        self.last_sync = Some(now);
        self.need_full
    }

    /// The sync succeeded (`full`: it rewrote everything) at `now`.
    pub fn succeeded(&mut self, full: bool, now: Instant) {
        self.need_full = false;
        self.retrying = false;
        if let Some(start) = self.last_sync {
            self.last_cost = now.saturating_duration_since(start);
        }
        if full {
            self.last_full = now;
        }
    }

    /// The sync failed: the changes it took are gone, so the retry is full.
    pub fn failed(&mut self) {
        self.need_full = true;
        self.retrying = true;
        self.again();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(1);
    const PERIOD: Duration = Duration::from_secs(30);

    #[test]
    fn the_first_sync_is_full_and_starts_at_once() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(RateLimit::Fixed(MIN), PERIOD, t0);
        assert_eq!(r.hold(t0), Duration::ZERO);
        assert!(r.begin(t0));
        r.succeeded(true, t0);
        assert!(!r.begin(t0 + MIN), "the next is partial");
    }

    #[test]
    fn syncs_keep_the_minimum_period() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(RateLimit::Fixed(MIN), PERIOD, t0);
        r.begin(t0);
        assert_eq!(
            r.hold(t0 + Duration::from_millis(300)),
            Duration::from_millis(700)
        );
        assert_eq!(r.hold(t0 + MIN), Duration::ZERO);
        assert_eq!(r.hold(t0 + 2 * MIN), Duration::ZERO);
    }

    #[test]
    fn an_idle_period_asks_for_a_check_and_a_failure_forces_a_full_sync() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(RateLimit::Fixed(MIN), PERIOD, t0);
        r.begin(t0);
        r.succeeded(true, t0);
        r.ticked(r.tick(true));
        assert!(!r.take_idle(), "a switch's fast tick is no idle period");
        assert!(!r.begin(t0 + MIN));
        r.succeeded(false, t0 + MIN);
        r.ticked(r.tick(false));
        assert!(
            !r.begin(t0 + PERIOD),
            "an idle sync period is no full sync by itself"
        );
        assert!(r.take_idle(), "but asks for a check of the kernel");
        assert!(!r.take_idle(), "once");
        r.succeeded(false, t0 + PERIOD);
        r.failed();
        assert!(r.again, "a failure is retried without a wake");
        assert!(r.begin(t0 + PERIOD + MIN), "and in full");
    }

    #[test]
    fn a_failure_retries_after_a_second_even_with_a_zero_minimum() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(RateLimit::Fixed(Duration::ZERO), PERIOD, t0);
        r.begin(t0);
        r.failed();
        assert_eq!(
            r.min_period(),
            ADAPTIVE_MAX,
            "no busy loop on a persistent failure"
        );
        r.begin(t0 + ADAPTIVE_MAX);
        r.succeeded(true, t0 + ADAPTIVE_MAX);
        assert_eq!(
            r.min_period(),
            Duration::ZERO,
            "the set minimum again once a sync succeeds"
        );
    }

    #[test]
    fn partial_syncs_give_way_to_a_full_one_every_hour() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(RateLimit::Fixed(MIN), PERIOD, t0);
        r.begin(t0);
        r.succeeded(true, t0);
        let later = t0 + FULL_SYNC_AT_LEAST;
        assert!(!r.begin(later));
        r.succeeded(false, later);
        assert!(r.begin(later + MIN));
    }

    #[test]
    fn unset_the_minimum_period_fits_the_cost_of_the_last_round() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut r = SyncRunner::new(RateLimit::of(None), PERIOD, t0);
        assert_eq!(r.hold(t0), Duration::ZERO, "the first sync starts at once");
        r.begin(t0);
        r.succeeded(true, t0 + ms(1));
        assert_eq!(
            r.min_period(),
            COALESCE,
            "a cheap sync: bursts coalesce over a few ms"
        );
        assert_eq!(r.hold(t0 + ms(2)), ms(3));
        assert_eq!(
            r.hold(t0 + ms(5)),
            Duration::ZERO,
            "no 1 s hold after a cheap sync"
        );
        let t1 = t0 + ms(10);
        r.begin(t1);
        r.succeeded(false, t1 + ms(40));
        assert_eq!(r.min_period(), ms(120), "a costly round spaces the syncs");
        let t2 = t1 + ms(200);
        r.begin(t2);
        r.succeeded(false, t2 + ms(900));
        assert_eq!(
            r.min_period(),
            ADAPTIVE_MAX,
            "never more than kube-proxy's default"
        );
        r.begin(t2 + ADAPTIVE_MAX);
        r.failed();
        assert_eq!(
            r.min_period(),
            ADAPTIVE_MAX,
            "a failed sync is retried after a second"
        );
        assert_eq!(
            RateLimit::of(Some(MIN)),
            RateLimit::Fixed(MIN),
            "a set period stays the bound"
        );
    }

    #[test]
    fn a_new_period_and_limit_take_effect_without_losing_the_pacing() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(RateLimit::of(None), PERIOD, t0);
        r.begin(t0);
        r.succeeded(true, t0);
        let two = Duration::from_secs(2);
        assert!(r.configure(RateLimit::of(Some(MIN)), two));
        assert!(
            !r.configure(RateLimit::Fixed(MIN), two),
            "the same again: no change"
        );
        assert_eq!(r.tick(false), two, "the idle tick is the new sync period");
        assert_eq!(r.min_period(), MIN, "a set minimum bounds the rate");
        assert_eq!(
            r.hold(t0 + Duration::from_millis(400)),
            Duration::from_millis(600)
        );
        r.ticked(r.tick(false));
        assert!(r.take_idle(), "an idle new period ends in a check of the kernel");
        assert!(r.configure(RateLimit::of(None), PERIOD));
        assert_eq!(r.min_period(), COALESCE, "unset again: adaptive");
    }

    #[test]
    fn the_tick_is_fast_while_switching() {
        let r = SyncRunner::new(RateLimit::Fixed(MIN), PERIOD, Instant::now());
        assert_eq!((r.tick(true), r.tick(false)), (SWITCH_TICK, PERIOD));
    }
}
