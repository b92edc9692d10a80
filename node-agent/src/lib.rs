//! Switchyard node agent: the service proxy on one node.
//!
//! ```text
//!  kube-apiserver ──► report (NodeProxy status, SSA)        ◄── probe (HostFacts → Capabilities)
//!                                                                   │
//!                                                                  sys (netlink, iptables, files)
//! ```
//! Only [`sys`] touches the kernel; [`probe`] decides from gathered facts; [`report`] talks to the API.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

pub mod backend;
pub mod conntrack;
pub mod driver;
pub mod health;
pub mod measurements;
pub mod metrics;
pub mod model;
pub mod node_sysctls;
pub mod preflight;
pub mod probe;
pub mod report;
pub mod runtime;
pub mod state_store;
pub mod switch;
pub mod sys;
pub mod takeover;

/// Errors of the agent.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A netlink socket operation failed.
    #[error("netlink {op}: {source}")]
    Netlink {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A Kubernetes API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done.
        action: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// A response from the apiserver could not be decoded.
    #[error("decoding {what}: {detail}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// Why it failed.
        detail: String,
    },
    /// A response from the apiserver did not arrive whole (stalled, cut).
    #[error("{action}: {detail}")]
    ApiStream {
        /// What was being done.
        action: String,
        /// What went wrong.
        detail: String,
    },
    /// The apiserver answered with a failure status.
    #[error("{action}: the apiserver answered {code} {reason}: {message}")]
    ApiStatus {
        /// What was being done.
        action: String,
        /// The status code (410: the resource version is too old).
        code: u16,
        /// The machine-readable reason.
        reason: String,
        /// The message.
        message: String,
    },
    /// The agent's configuration is unusable.
    #[error("configuration: {0}")]
    Config(String),
}

/// Result alias of the agent.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Short label for metrics (bounded cardinality).
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Netlink { .. } => "netlink",
            Error::Kube { .. } => "kube",
            Error::Decode { .. } => "decode",
            Error::ApiStatus { .. } => "api_status",
            Error::ApiStream { .. } => "api_stream",
            Error::Config(_) => "config",
        }
    }
}
