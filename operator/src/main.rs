//! `switchyard-operator`: rolls ProxyPolicies out to NodeProxies, wave by wave, with Lease-based
//! leader election (only the leader reconciles).
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;
use kube::{
    Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};
use switchyard_operator::{Error, Result, controller};

/// Switchyard operator: rolls ProxyPolicies out to NodeProxies wave by wave.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Kubeconfig to use; default: in-cluster service account, then $KUBECONFIG.
    #[arg(long, env = "SWITCHYARD_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Host (name or address) of the apiserver to use instead of the kubeconfig's server or the
    /// `kubernetes` Service's ClusterIP (`KUBERNETES_SERVICE_HOST`), which only works once a proxy
    /// serves it. The credentials stay those of the kubeconfig or the pod's service account.
    #[arg(long, env = "SWITCHYARD_APISERVER_HOST")]
    apiserver_host: Option<String>,
    /// Port of `--apiserver-host`.
    #[arg(long, env = "SWITCHYARD_APISERVER_PORT", default_value_t = 6443)]
    apiserver_port: u16,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "switchyard-system")]
    namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "switchyard-operator")]
    lease_name: String,
    /// Identity of this replica (Lease holder); default: POD_NAME, else hostname and PID.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a Lease lasts without renewal (a killed leader is replaced after this).
    #[arg(long, default_value_t = 15)]
    lease_duration_seconds: u64,
    /// Seconds before expiry at which the leader renews.
    #[arg(long, default_value_t = 5)]
    lease_grace_seconds: u64,
    /// Address of /healthz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080")]
    healthz_bind_address: SocketAddr,
    /// /healthz fails when the leader has not reconciled successfully for this many seconds.
    #[arg(long, default_value_t = 300)]
    healthz_stale_seconds: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: a Pod's log (kubectl logs, a log shipper) reads plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "switchyard-operator stopped");
            eprintln!("switchyard-operator: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn client(
    kubeconfig: Option<&PathBuf>,
    apiserver_host: Option<&str>,
    apiserver_port: u16,
) -> Result<Client> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc =
                Kubeconfig::read_from(path).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?
        }
        None => Config::infer()
            .await
            .map_err(|e| Error::Config(format!("no kubeconfig: {e}")))?,
    };
    if let Some(host) = apiserver_host {
        config.cluster_url = switchyard_crds::apiserver_url(host, apiserver_port)
            .parse()
            .map_err(|e| Error::Config(format!("--apiserver-host {host}: {e}")))?;
        tracing::info!(server = %config.cluster_url, "using the configured apiserver endpoint");
    }
    Client::try_from(config).map_err(Error::kube("build client"))
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
    tracing::info!("shutting down");
}

async fn run(args: Args) -> Result<()> {
    if args.lease_grace_seconds >= args.lease_duration_seconds {
        return Err(Error::Config(
            "--lease-grace-seconds must be less than --lease-duration-seconds".into(),
        ));
    }
    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "operator".into());
        format!("{}-{}", host.trim(), std::process::id())
    });
    let client = client(
        args.kubeconfig.as_ref(),
        args.apiserver_host.as_deref(),
        args.apiserver_port,
    )
    .await?;
    let config = controller::Config {
        namespace: args.namespace,
        lease_name: args.lease_name,
        identity,
        lease_duration: Duration::from_secs(args.lease_duration_seconds),
        lease_grace: Duration::from_secs(args.lease_grace_seconds),
        healthz_bind_address: args.healthz_bind_address,
        stale_after: Duration::from_secs(args.healthz_stale_seconds),
    };
    controller::run(client, config, shutdown_signal()).await
}
