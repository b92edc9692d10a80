//! `switchyard-agent`: probes the node's kernel and reports to its NodeProxy.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;
use kube::{Client, Config, config::{KubeConfigOptions, Kubeconfig}};
use switchyard_agent::{Error, Result, probe, report};
use switchyard_crds::v1alpha1::{NodeProxyStatus, SwitchPhase};

/// Switchyard node agent.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Name of the node this agent serves (the NodeProxy of the same name is its own).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Kubeconfig to use; default: in-cluster service account, then $KUBECONFIG.
    #[arg(long, env = "SWITCHYARD_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Print the probed capabilities as JSON and exit, without contacting the API.
    #[arg(long)]
    probe: bool,
    /// Seconds between re-probes and status reports.
    #[arg(long, default_value_t = 300)]
    report_interval_seconds: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "switchyard-agent stopped");
            eprintln!("switchyard-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn capabilities() -> Result<switchyard_crds::v1alpha1::Capabilities> {
    let facts = tokio::task::spawn_blocking(probe::HostFacts::gather)
        .await
        .map_err(|e| Error::Config(format!("probe task: {e}")))?;
    Ok(probe::decide(&facts))
}

async fn client(kubeconfig: Option<&PathBuf>) -> Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?
        }
        None => Config::infer().await.map_err(|e| Error::Config(format!("no kubeconfig: {e}")))?,
    };
    Client::try_from(config).map_err(|source| Error::Kube { action: "build client".into(), source })
}

async fn run(args: Args) -> Result<()> {
    if args.probe {
        let caps = capabilities().await?;
        println!("{}", serde_json::to_string_pretty(&caps).map_err(|e| Error::Config(e.to_string()))?);
        return Ok(());
    }
    let node = args.node_name.clone().ok_or_else(|| Error::Config("--node-name (or NODE_NAME) is required".into()))?;
    let client = client(args.kubeconfig.as_ref()).await?;
    report::ensure_registered(&client, &node).await?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::Config(format!("signal handler: {e}")))?;
    loop {
        let caps = capabilities().await?;
        tracing::info!(node, kernel = caps.kernel_version, modes = ?caps.supported_modes, "capabilities probed");
        let status = NodeProxyStatus {
            agent_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
            capabilities: Some(caps),
            phase: Some(SwitchPhase::Initializing),
            ..Default::default()
        };
        report::apply_status(&client, &node, &status).await?;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(args.report_interval_seconds)) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = terminate.recv() => return Ok(()),
        }
    }
}
