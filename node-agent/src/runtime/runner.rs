//! The sync runner: when the proxy loop syncs and whether the sync is full. A sync waits for a
//! wake (a change, a retry, a follow-up switch step) or a tick, then for the rest of the minimum
//! period since the last sync. Idle ticks (every sync period) force a full sync, and so does a
//! failed sync and an hour without one; while a switch is under way the tick is fast, so the
//! health gate's probe rounds run every second.

use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The tick while a switch is under way.
pub(super) const SWITCH_TICK: Duration = Duration::from_secs(1);
/// The longest time between full syncs, however busy the loop is with partial ones.
pub(super) const FULL_SYNC_AT_LEAST: Duration = Duration::from_secs(3600);

/// Paces the proxy loop's syncs.
#[derive(Debug)]
pub(super) struct SyncRunner {
    min_period: Duration,
    period: Duration,
    last_sync: Option<Instant>,
    last_full: Instant,
    need_full: bool,
    /// Run again without waiting for a wake (after a failure, or a step that wants a follow-up).
    again: bool,
}

impl SyncRunner {
    /// A runner whose first sync is full and may start at once.
    pub fn new(min_period: Duration, period: Duration, now: Instant) -> Self {
        Self {
            min_period,
            period,
            last_sync: None,
            last_full: now,
            need_full: true,
            again: false,
        }
    }

    /// How long to wait for a wake before ticking.
    pub fn tick(&self, switching: bool) -> Duration {
        if switching { SWITCH_TICK } else { self.period }
    }

    /// The tick of `tick` passed without a wake; an idle period ends in a full resync.
    pub fn ticked(&mut self, tick: Duration) {
        self.need_full |= tick == self.period;
    }

    /// What is left of the minimum period since the last sync at `now`.
    pub fn hold(&self, now: Instant) -> Duration {
        self.last_sync
            .map(|last| {
                self.min_period
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
        if full {
            self.last_full = now;
        }
    }

    /// The sync failed: the changes it took are gone, so the retry is full.
    pub fn failed(&mut self) {
        self.need_full = true;
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
        let mut r = SyncRunner::new(MIN, PERIOD, t0);
        assert_eq!(r.hold(t0), Duration::ZERO);
        assert!(r.begin(t0));
        r.succeeded(true, t0);
        assert!(!r.begin(t0 + MIN), "the next is partial");
    }

    #[test]
    fn syncs_keep_the_minimum_period() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(MIN, PERIOD, t0);
        r.begin(t0);
        assert_eq!(
            r.hold(t0 + Duration::from_millis(300)),
            Duration::from_millis(700)
        );
        assert_eq!(r.hold(t0 + MIN), Duration::ZERO);
        assert_eq!(r.hold(t0 + 2 * MIN), Duration::ZERO);
    }

    #[test]
    fn an_idle_period_and_a_failure_force_a_full_sync() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(MIN, PERIOD, t0);
        r.begin(t0);
        r.succeeded(true, t0);
        r.ticked(r.tick(true));
        assert!(!r.begin(t0 + MIN), "a switch's fast tick does not");
        r.succeeded(false, t0 + MIN);
        r.ticked(r.tick(false));
        assert!(r.begin(t0 + PERIOD), "an idle sync period does");
        r.succeeded(true, t0 + PERIOD);
        r.failed();
        assert!(r.again, "a failure is retried without a wake");
        assert!(r.begin(t0 + PERIOD + MIN), "and in full");
    }

    #[test]
    fn partial_syncs_give_way_to_a_full_one_every_hour() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(MIN, PERIOD, t0);
        r.begin(t0);
        r.succeeded(true, t0);
        let later = t0 + FULL_SYNC_AT_LEAST;
        assert!(!r.begin(later));
        r.succeeded(false, later);
        assert!(r.begin(later + MIN));
    }

    #[test]
    fn the_tick_is_fast_while_switching() {
        let r = SyncRunner::new(MIN, PERIOD, Instant::now());
        assert_eq!((r.tick(true), r.tick(false)), (SWITCH_TICK, PERIOD));
    }
}
