//! The operator's single error type and its `Result` alias.

/// Everything that can go wrong in the operator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done, e.g. `apply NodeProxy node-1`.
        action: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// Bad flags or kubeconfig.
    #[error("configuration: {0}")]
    Config(String),
    /// The lease watcher stopped, so leadership can no longer be known.
    #[error("leader election stopped")]
    LeaseStopped,
    /// A watch cache did not become ready.
    #[error("the {0} cache did not sync")]
    NotReady(&'static str),
    /// Serving `/healthz` and `/metrics` failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// A short, low-cardinality label for the `switchyard_operator_reconcile_errors_total` metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "kube",
            Error::Config(_) => "config",
            Error::LeaseStopped => "lease_stopped",
            Error::NotReady(_) => "not_ready",
            Error::Io { .. } => "io",
        }
    }

    /// Wraps a kube error with what was being done.
    pub fn kube(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let action = action.into();
        move |source| Error::Kube { action, source }
    }
}

/// Result alias of the operator.
pub type Result<T, E = Error> = std::result::Result<T, E>;
