//! Retrying the API: a short, capped backoff for watch streams and the Controller's triggers, and
//! the API reachability the operator reports on `/healthz` and `/metrics`.
//!
//! kube-runtime's `default_backoff()` grows to 30 s and is reset only by a successful event, so
//! after a control-plane outage a watcher may sleep half a minute after the API is back, and the
//! "too old resource version" (410 Expired) error that follows a restart costs one more sleep
//! although the watcher has already reset itself to re-list. Here: 250 ms doubling to at most 2 s
//! (with jitter), and no sleep at all after a 410, so a watcher re-lists as soon as the API answers.
//! The Controller's own ProxyPolicy watch cannot tell a 410 from other errors (its backoff sees no
//! error), so it waits at most [`MAX_DELAY`] (+20 %) there; the caches the planner reads re-list at
//! once, and each completed re-list triggers a reconcile of every policy.
//!
//! Measured (`tests/tests/control_plane_faults.rs`, etcd + kube-apiserver SIGKILLed for 60 s while
//! a wave switches, soak 3 s): the next wave started 3.1 s after the API returned; with
//! kube-runtime's default backoff and kube-lease-manager (the operator before this module) 56.3 s.

use std::{
    pin::Pin,
    sync::{
        Mutex,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use futures::{Stream, StreamExt};
use kube::runtime::{utils::Backoff, watcher};
use tokio::sync::broadcast;

/// First retry delay.
pub const MIN_DELAY: Duration = Duration::from_millis(250);
/// Longest retry delay: the API is retried at least this often while it is down.
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// Exponential backoff from [`MIN_DELAY`] to [`MAX_DELAY`] with ±20 % jitter; never gives up.
#[derive(Debug, Clone, Default)]
pub struct RetryBackoff {
    attempt: u32,
}

impl RetryBackoff {
    /// A fresh backoff.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The delay before retry number `attempt` (0-based), without jitter.
pub fn base_delay(attempt: u32) -> Duration {
    let factor = 1u32.checked_shl(attempt.min(16)).unwrap_or(u32::MAX);
    MIN_DELAY.saturating_mul(factor).min(MAX_DELAY)
}

/// `delay` scaled by a factor in [0.8, 1.2) taken from the clock's sub-second nanoseconds.
fn jittered(delay: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let permille = 800 + u64::from(nanos % 400);
    Duration::from_millis(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX) * permille / 1000)
}

impl Iterator for RetryBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = base_delay(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        Some(jittered(delay))
    }
}

impl Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// Whether a watcher error means "re-list now": the apiserver no longer has the resource version
/// (HTTP 410 Gone, reason Expired), and the watcher has already reset itself to list again.
pub fn is_expired(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => api_code(e) == Some(410),
        _ => false,
    }
}

fn api_code(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Whether the API is reachable, as the operator's requests find it.
pub struct ApiState {
    /// Unix milliseconds since which the API fails, 0 while it answers.
    unreachable_since_ms: AtomicI64,
    last_error: Mutex<String>,
    /// Sent when the API answers again after failing: every policy is reconciled at once.
    recovered: broadcast::Sender<()>,
}

impl ApiState {
    /// A reachable API; `recovered` is signalled on every failure → success transition.
    pub fn new(recovered: broadcast::Sender<()>) -> Self {
        Self {
            unreachable_since_ms: AtomicI64::new(0),
            last_error: Mutex::new(String::new()),
            recovered,
        }
    }

    /// Records a failed request (`what`: which watch or call).
    pub fn failed(&self, what: &str, error: &dyn std::fmt::Display) {
        let now = jiff::Timestamp::now().as_millisecond();
        let first = self
            .unreachable_since_ms
            .compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        *self
            .last_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = format!("{what}: {error}");
        if first {
            tracing::warn!(what, error = %error, "the Kubernetes API is unreachable or failing; retrying with backoff (at most every {}s)", MAX_DELAY.as_secs());
        }
    }

    /// Records a successful request; on recovery, logs and triggers a reconcile of every policy.
    pub fn answered(&self) {
        let since = self.unreachable_since_ms.swap(0, Ordering::SeqCst);
        if since != 0 {
            let secs = (jiff::Timestamp::now().as_millisecond() - since) as f64 / 1000.0;
            tracing::info!(
                unreachable_seconds = secs,
                "the Kubernetes API answers again; reconciling every policy"
            );
            let _ = self.recovered.send(());
        }
    }

    /// `Some((unix seconds since, last error))` while the API fails.
    pub fn unreachable(&self) -> Option<(i64, String)> {
        let since = self.unreachable_since_ms.load(Ordering::SeqCst);
        (since != 0).then(|| {
            (
                since / 1000,
                self.last_error
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone(),
            )
        })
    }
}

type Sleep = Pin<Box<tokio::time::Sleep>>;

/// Wraps a watcher stream: after an error it waits [`RetryBackoff`] (nothing after a 410 Expired:
/// the watcher re-lists at once), logs, and records the API state; any event resets the backoff.
/// The stream never ends on errors.
pub fn retrying<S, T>(
    kind: &'static str,
    stream: S,
    api: std::sync::Arc<ApiState>,
) -> impl Stream<Item = Result<T, watcher::Error>> + Send
where
    S: Stream<Item = Result<T, watcher::Error>> + Send + 'static,
    T: Send + 'static,
{
    let state = (stream.boxed(), RetryBackoff::new(), None::<Sleep>, api);
    futures::stream::unfold(state, move |(mut stream, mut backoff, pause, api)| async move {
        if let Some(pause) = pause {
            pause.await;
        }
        let item = stream.next().await?;
        let pause = match &item {
            Ok(_) => {
                backoff.reset();
                api.answered();
                None
            }
            Err(e) if is_expired(e) => {
                tracing::info!(kind, error = %e, "watch expired (too old resource version); re-listing now");
                backoff.reset();
                None
            }
            Err(e) => {
                let delay = backoff.next().unwrap_or(MAX_DELAY);
                api.failed(&format!("{kind} watch"), e);
                tracing::debug!(kind, error = %e, ?delay, "watch failed; retrying");
                Some(Box::pin(tokio::time::sleep(delay)))
            }
        };
        Some((item, (stream, backoff, pause, api)))
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap() {
        let d: Vec<u128> = (0..8).map(|a| base_delay(a).as_millis()).collect();
        assert_eq!(d, [250, 500, 1000, 2000, 2000, 2000, 2000, 2000]);
        assert_eq!(base_delay(u32::MAX), MAX_DELAY);
    }

    #[test]
    fn jitter_stays_within_twenty_percent_and_reset_starts_over() {
        let mut b = RetryBackoff::new();
        for _ in 0..40 {
            let d = b.next().unwrap();
            assert!(
                d <= MAX_DELAY.mul_f64(1.2) && d >= MIN_DELAY.mul_f64(0.8),
                "{d:?}"
            );
        }
        b.reset();
        assert!(b.next().unwrap() < MIN_DELAY.mul_f64(1.2));
    }

    #[test]
    fn expired_is_recognised() {
        let gone = kube::core::Status::failure("too old resource version", "Expired").with_code(410);
        assert!(is_expired(&watcher::Error::WatchError(Box::new(gone.clone()))));
        assert!(is_expired(&watcher::Error::WatchStartFailed(kube::Error::Api(
            Box::new(gone)
        ))));
        let other = kube::core::Status::failure("boom", "InternalError").with_code(500);
        assert!(!is_expired(&watcher::Error::WatchError(Box::new(other))));
        assert!(!is_expired(&watcher::Error::NoResourceVersion));
    }

    // Paused time: the clock advances only through the stream's own sleeps, so the bounds below
    // hold on any machine, however loaded.
    #[tokio::test(start_paused = true)]
    async fn errors_pause_and_expired_does_not() {
        let (tx, mut rx) = broadcast::channel(4);
        let api = std::sync::Arc::new(ApiState::new(tx));
        let gone = kube::core::Status::failure("too old", "Expired").with_code(410);
        let items: Vec<Result<u8, watcher::Error>> = vec![
            Err(watcher::Error::NoResourceVersion),
            Err(watcher::Error::WatchError(Box::new(gone))),
            Ok(1),
        ];
        let mut s = Box::pin(retrying("Test", futures::stream::iter(items), api.clone()));
        let start = tokio::time::Instant::now();
        assert!(s.next().await.unwrap().is_err());
        assert!(api.unreachable().is_some());
        assert!(s.next().await.unwrap().is_err());
        let after_first = start.elapsed();
        assert!(after_first >= MIN_DELAY.mul_f64(0.8), "{after_first:?}");
        assert_eq!(s.next().await.unwrap().unwrap(), 1);
        assert!(
            start.elapsed() < after_first + Duration::from_millis(150),
            "no pause after a 410"
        );
        assert!(api.unreachable().is_none());
        assert!(rx.try_recv().is_ok(), "recovery triggers a reconcile");
        assert!(s.next().await.is_none());
    }
}
