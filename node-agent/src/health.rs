//! Health endpoints with kube-proxy's semantics, and per-service health-check node ports.
//!
//! `/healthz` and `/livez` (default `0.0.0.0:10256`): unhealthy iff an update has been queued for
//! longer than the health timeout without a successful sync; `/healthz` is also 503 while the node is
//! not eligible (missing, being deleted, or tainted `ToBeDeletedByClusterAutoscaler`). `/metrics`
//! exposes [`crate::metrics::Metrics`]. For LoadBalancer Services with `externalTrafficPolicy:
//! Local`, an HTTP server on the service's `healthCheckNodePort` answers 200 while the node has
//! local endpoints and the proxy is healthy, else 503.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::IntoResponse,
    routing::get,
};
use serde_json::json;

use crate::{metrics::Metrics, model::ServiceName};

/// Shared proxy health.
#[derive(Debug)]
pub struct ProxyHealth {
    inner: Mutex<HealthState>,
    /// The health timeout in milliseconds; follows the sync period (see [`ProxyHealth::set_timeout`]).
    timeout_ms: AtomicU64,
}

#[derive(Debug)]
struct HealthState {
    oldest_pending: Option<Instant>,
    last_updated: SystemTime,
    node_eligible: bool,
    /// Watches (by name) currently failing: since when, and the last error with its time.
    api_failing: BTreeMap<&'static str, ApiFailure>,
}

#[derive(Debug, Clone)]
struct ApiFailure {
    since: SystemTime,
    error: String,
    last: Instant,
}

/// The apiserver as the agent's watches see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiView {
    /// No watch is failing.
    pub reachable: bool,
    /// When the oldest failing watch started failing.
    pub unreachable_since: Option<SystemTime>,
    /// The most recent error.
    pub last_error: Option<String>,
}

/// A point-in-time view of health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthView {
    /// No update pending for longer than the timeout.
    pub healthy: bool,
    /// Node exists and is not being deleted.
    pub node_eligible: bool,
}

impl ProxyHealth {
    /// Health with `timeout` (kube-proxy: 2 × syncPeriod).
    pub fn new(timeout: Duration) -> Self {
        Self {
            inner: Mutex::new(HealthState {
                oldest_pending: None,
                last_updated: SystemTime::now(),
                node_eligible: true,
                api_failing: BTreeMap::new(),
            }),
            timeout_ms: AtomicU64::new(millis(timeout)),
        }
    }

    /// A new timeout (the sync period changed: kube-proxy's is 2 × syncPeriod).
    pub fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms.store(millis(timeout), Ordering::Relaxed);
    }

    /// The current timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    fn with<T>(&self, f: impl FnOnce(&mut HealthState) -> T) -> T {
        match self.inner.lock() {
            Ok(mut g) => f(&mut g),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }

    /// An update (Service or EndpointSlice change) was queued.
    pub fn queued(&self) {
        self.with(|s| {
            s.oldest_pending.get_or_insert_with(Instant::now);
        });
    }

    /// A sync succeeded.
    pub fn updated(&self) {
        self.with(|s| {
            s.oldest_pending = None;
            s.last_updated = SystemTime::now();
        });
    }

    /// Node eligibility changed.
    pub fn set_node_eligible(&self, eligible: bool) {
        self.with(|s| s.node_eligible = eligible);
    }

    /// Current health.
    pub fn view(&self) -> HealthView {
        self.with(|s| HealthView {
            healthy: s.oldest_pending.is_none_or(|t| t.elapsed() < self.timeout()),
            node_eligible: s.node_eligible,
        })
    }

    /// The watch `what` failed with `error`; returns whether this starts its failure.
    pub fn api_failed(&self, what: &'static str, error: String) -> bool {
        self.with(|s| match s.api_failing.get_mut(what) {
            Some(entry) => {
                entry.error = error;
                entry.last = Instant::now();
                false
            }
            None => {
                s.api_failing.insert(
                    what,
                    ApiFailure {
                        since: SystemTime::now(),
                        error,
                        last: Instant::now(),
                    },
                );
                true
            }
        })
    }

    /// The watch `what` delivered an event; returns how long it had been failing, if it was.
    pub fn api_recovered(&self, what: &'static str) -> Option<Duration> {
        self.with(|s| s.api_failing.remove(what))
            .map(|f| f.since.elapsed().unwrap_or_default())
    }

    /// A request to the apiserver succeeded: watches that have reported no error for `quiet`
    /// have recovered too (a watch resumed from its resource version delivers no event until
    /// something changes). Returns the recovered watches with how long each had failed.
    pub fn api_answered(&self, quiet: Duration) -> Vec<(&'static str, Duration)> {
        self.with(|s| {
            let quiet_ones: Vec<&'static str> = s
                .api_failing
                .iter()
                .filter(|(_, f)| f.last.elapsed() >= quiet)
                .map(|(w, _)| *w)
                .collect();
            quiet_ones
                .into_iter()
                .filter_map(|w| {
                    s.api_failing
                        .remove(w)
                        .map(|f| (w, f.since.elapsed().unwrap_or_default()))
                })
                .collect()
        })
    }

    /// The apiserver's reachability.
    pub fn api_view(&self) -> ApiView {
        self.with(|s| ApiView {
            reachable: s.api_failing.is_empty(),
            unreachable_since: s.api_failing.values().map(|f| f.since).min(),
            last_error: s
                .api_failing
                .values()
                .max_by_key(|f| f.last)
                .map(|f| f.error.clone()),
        })
    }

    fn last_updated(&self) -> SystemTime {
        self.with(|s| s.last_updated)
    }
}

/// State shared by the HTTP handlers.
#[derive(Clone)]
pub struct HttpState {
    /// Proxy health.
    pub health: Arc<ProxyHealth>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    format!("{secs:.3}")
}

fn reply(code: StatusCode, body: serde_json::Value) -> impl IntoResponse {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert("X-Content-Type-Options", HeaderValue::from_static("nosniff"));
    (code, headers, body.to_string())
}

async fn healthz(State(s): State<HttpState>, livez: bool) -> impl IntoResponse {
    let view = s.health.view();
    let ok = view.healthy && (livez || view.node_eligible);
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let family = if livez {
        &s.metrics.livez_total
    } else {
        &s.metrics.healthz_total
    };
    family
        .get_or_create(&crate::metrics::CodeLabel {
            code: code.as_u16().to_string(),
        })
        .inc();
    let now = SystemTime::now();
    let last = if view.healthy {
        now
    } else {
        s.health.last_updated()
    };
    let mut body = json!({
        "lastUpdated": rfc3339(last),
        "currentTime": rfc3339(now),
        "healthy": view.healthy,
        "status": {"IPv4": {"lastUpdated": rfc3339(last), "healthy": view.healthy}},
    });
    if !livez {
        body["nodeEligible"] = json!(view.node_eligible);
    }
    // An outage does not fail the probes (the data path keeps serving what it programmed, as
    // kube-proxy's does), but it is said here and in the metrics.
    let api = s.health.api_view();
    body["apiServer"] = json!({
        "reachable": api.reachable,
        "unreachableSince": api.unreachable_since.map(rfc3339),
        "lastError": api.last_error,
    });
    reply(code, body)
}

/// The router for `/healthz`, `/livez` and `/metrics`.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|s: State<HttpState>| async move { healthz(s, false).await }),
        )
        .route(
            "/livez",
            get(|s: State<HttpState>| async move { healthz(s, true).await }),
        )
        .route(
            "/metrics",
            get(|State(s): State<HttpState>| async move { s.metrics.render() }),
        )
        .with_state(state)
}

/// Serves `router` on `addr` until the process ends.
pub async fn serve(addr: std::net::SocketAddr, router: Router) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, router).await
}

/// A listener on `port` of every address of both families: `[::]` with `IPV6_V6ONLY` off (so
/// whatever `net.ipv6.bindv6only` says, IPv4 load balancers reach it too), or `0.0.0.0` on a node
/// without IPv6.
fn dual_stack_listener(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let open = |domain: Domain, addr: std::net::SocketAddr| -> std::io::Result<std::net::TcpListener> {
        let socket = Socket::new(domain, Type::STREAM, None)?;
        if domain == Domain::IPV6 {
            socket.set_only_v6(false)?;
        }
        socket.set_reuse_address(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        Ok(socket.into())
    };
    let listener = match open(Domain::IPV6, (std::net::Ipv6Addr::UNSPECIFIED, port).into()) {
        Ok(l) => l,
        // Only a node without IPv6 falls back; a port in use is reported, not hidden.
        Err(e) if matches!(e.raw_os_error(), Some(code) if code == nix::errno::Errno::EAFNOSUPPORT as i32 || code == nix::errno::Errno::EADDRNOTAVAIL as i32) =>
        {
            tracing::info!(port, error = %e, "no IPv6 on this node; health-check port on IPv4 only");
            open(Domain::IPV4, (std::net::Ipv4Addr::UNSPECIFIED, port).into())?
        }
        Err(e) => return Err(e),
    };
    tokio::net::TcpListener::from_std(listener)
}

/// Desired health-check servers: node port → (service, local endpoints).
pub type HealthCheckPorts = BTreeMap<u16, (ServiceName, usize)>;

/// Runs and reconciles the per-service health-check node-port servers.
pub struct ServiceHealthServers {
    health: Arc<ProxyHealth>,
    desired: Arc<Mutex<HealthCheckPorts>>,
    running: BTreeMap<u16, tokio::task::JoinHandle<()>>,
}

impl ServiceHealthServers {
    /// No servers yet.
    pub fn new(health: Arc<ProxyHealth>) -> Self {
        Self {
            health,
            desired: Arc::new(Mutex::new(BTreeMap::new())),
            running: BTreeMap::new(),
        }
    }

    /// Starts servers for new ports, stops servers for removed ones, updates counts.
    pub fn sync(&mut self, ports: HealthCheckPorts) {
        let wanted: Vec<u16> = ports.keys().copied().collect();
        if let Ok(mut d) = self.desired.lock() {
            *d = ports;
        }
        self.running.retain(|port, task| {
            let keep = wanted.contains(port);
            if !keep {
                task.abort();
            }
            keep
        });
        for port in wanted {
            if self.running.contains_key(&port) {
                continue;
            }
            let (desired, health) = (self.desired.clone(), self.health.clone());
            let app = Router::new().fallback(move || {
                let (desired, health) = (desired.clone(), health.clone());
                async move {
                    let (service, local) = desired
                        .lock()
                        .ok()
                        .and_then(|d| d.get(&port).cloned())
                        .unwrap_or_else(|| {
                            (
                                ServiceName {
                                    namespace: "".into(),
                                    name: "".into(),
                                },
                                0,
                            )
                        });
                    let healthy = health.view().healthy;
                    let code = if local > 0 && healthy {
                        StatusCode::OK
                    } else {
                        StatusCode::SERVICE_UNAVAILABLE
                    };
                    let mut headers = HeaderMap::new();
                    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                    headers.insert("X-Content-Type-Options", HeaderValue::from_static("nosniff"));
                    if let Ok(v) = HeaderValue::from_str(&local.to_string()) {
                        headers.insert("X-Load-Balancing-Endpoint-Weight", v);
                    }
                    let body = json!({"service": {"namespace": &*service.namespace, "name": &*service.name},
                                      "localEndpoints": local, "serviceProxyHealthy": healthy});
                    (code, headers, body.to_string())
                }
            });
            self.running.insert(
                port,
                tokio::spawn(async move {
                    let served = match dual_stack_listener(port) {
                        Ok(listener) => axum::serve(listener, app).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = served {
                        tracing::warn!(port, error = %e, "FailedToStartServiceHealthcheck");
                    }
                }),
            );
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pending_update_older_than_the_timeout_is_unhealthy_and_the_timeout_follows_changes() {
        let health = ProxyHealth::new(Duration::from_secs(60));
        assert!(health.view().healthy, "nothing pending");
        health.queued();
        assert!(health.view().healthy, "pending for less than 60 s");
        health.set_timeout(Duration::ZERO);
        assert_eq!(health.timeout(), Duration::ZERO);
        assert!(!health.view().healthy, "pending for longer than a zero timeout");
        health.updated();
        assert!(health.view().healthy, "a sync clears what was pending");
    }
}
