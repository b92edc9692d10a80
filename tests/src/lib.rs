//! End-to-end harness for Switchyard: a real etcd + kube-apiserver ([`controlplane`]), nodes that
//! are network namespaces with a real kernel data path ([`netns`]), and the project's own binaries
//! ([`binaries`]). Everything it starts it stops, also on panic (Drop), and a new run sweeps what a
//! crashed run left behind ([`sweep`]). The real-node tier ([`cluster`]) adds
//! kube-controller-manager, kube-scheduler, and a containerd and kubelet in every node
//! ([`kubelet`]), with images packed and loaded from archives ([`images`]). [`kube_proxy`] runs the
//! real kube-proxy in a namespace node (the incumbent of the takeover tests).

pub mod agent;
pub mod binaries;
pub mod cluster;
pub mod conformance;
pub mod controlplane;
pub mod images;
pub mod kernel;
pub mod kube_proxy;
pub mod kubelet;
pub mod logs;
pub mod netns;
pub mod objects;
pub mod operator;
pub mod pki;
pub mod ports;
pub mod scale;
pub mod stats;
pub mod sweep;
pub mod tools;
pub mod traffic;

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

/// An IP family of the dual-stack test cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// Both families, IPv4 first (the cluster's primary family).
    pub const BOTH: [Family; 2] = [Family::V4, Family::V6];

    /// The family's name in the Kubernetes API (`ipFamilies`, EndpointSlice `addressType`).
    pub fn k8s_name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    /// The family of an address.
    pub fn of(ip: IpAddr) -> Self {
        if ip.is_ipv4() { Family::V4 } else { Family::V6 }
    }
}

/// Errors of the harness. Tests usually `expect()` these with context.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A prerequisite (Go, a binary, a package) is missing.
    #[error("{0}")]
    Prerequisite(String),
    /// A command failed.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Its stderr or the OS error.
        detail: String,
    },
    /// File or process I/O.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Certificate generation.
    #[error("certificates: {0}")]
    Pki(#[from] rcgen::Error),
    /// Kubernetes client.
    #[error("kube: {0}")]
    Kube(#[from] kube::Error),
    /// Something did not happen in time.
    #[error("timed out after {0:?}: {1}")]
    Timeout(Duration, String),
}

/// Result alias of the harness.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

/// Runs `program args` and returns stdout; a non-zero exit becomes [`Error::Command`].
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| Error::Command {
            command: format!("{program} {}", args.join(" ")),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(Error::Command {
            command: format!("{program} {}", args.join(" ")),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `check` every 100 ms until it returns `Some`, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if start.elapsed() > limit {
            return Err(Error::Timeout(limit, what.to_owned()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Checks `check` every 200 ms for `window` and returns the first violation: something that must
/// not happen is given `window` to happen, and is looked for all along (not once after a sleep).
pub async fn throughout<F, Fut>(window: Duration, mut check: F) -> std::result::Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<(), String>>,
{
    let start = Instant::now();
    loop {
        check().await?;
        if start.elapsed() >= window {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
