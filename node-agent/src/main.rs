//! `switchyard-agent`: the service proxy on one node.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

use clap::Parser;
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};
use switchyard_agent::{
    Error, Result, backend,
    driver::{FaultHook, NoFaults, PauseAfter},
    health::{self, HttpState, ProxyHealth},
    metrics::Metrics,
    model::tracker::Tracker,
    probe, report,
    runtime::{self, CidrList, ModeFlag, NodePortAddresses, PhaseFlag},
};
use switchyard_crds::v1alpha1::ProxyMode;

/// mimalloc in every build (see Cargo.toml): the benchmarks measure the allocator that ships.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Switchyard node agent: the service proxy on a node (nftables or iptables).
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Name of the node this agent serves (the NodeProxy of the same name is its own).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
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
    /// Print the probed capabilities as JSON and exit, without contacting the API.
    #[arg(long)]
    probe: bool,
    /// Remove every kernel object Switchyard owns (all backends, both iptables variants) and exit.
    #[arg(long)]
    cleanup: bool,
    /// Print the rules for the current cluster state without touching the kernel, and exit.
    #[arg(long)]
    render: bool,
    /// Only register and report capabilities; do not proxy.
    #[arg(long)]
    report_only: bool,
    /// Proxy mode.
    #[arg(long, value_enum, default_value_t = ModeFlag::Nftables)]
    mode: ModeFlag,
    /// Pod CIDR of the cluster, or one per family comma-separated (`10.244.0.0/16,fd00:10:244::/56`);
    /// traffic from outside it to ClusterIPs is masqueraded.
    #[arg(long, value_parser = CidrList::parse)]
    cluster_cidr: Option<CidrList>,
    /// Masquerade all service traffic.
    #[arg(long)]
    masquerade_all: bool,
    /// NodePort addresses: `primary`, `all`, or comma-separated CIDRs. Default: primary for
    /// nftables, all for iptables (kube-proxy's defaults).
    #[arg(long, value_parser = NodePortAddresses::parse)]
    nodeport_addresses: Option<NodePortAddresses>,
    /// Handle only Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long)]
    service_proxy_name: Option<String>,
    /// Minimum seconds between syncs. Unset, the rate limit fits the syncs' own cost: a change
    /// after a quiet spell syncs at once, a burst coalesces over 5 ms or three times the last
    /// sync's cost, and syncs are never held more than 1 s (kube-proxy's default) apart.
    #[arg(long)]
    min_sync_period: Option<f64>,
    /// Seconds of quiet after which the agent checks its rules in the kernel (kube-proxy's canary
    /// check) and resyncs in full only if they changed; a full resync runs at least hourly (a
    /// failed sync is retried sooner: after the minimum period, at least 1 s). The health timeout
    /// is twice this.
    #[arg(long, default_value_t = 30.0)]
    sync_period: f64,
    /// Address of /healthz and /livez (and /metrics).
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: SocketAddr,
    /// Address of /metrics.
    #[arg(long, default_value = "0.0.0.0:10249")]
    metrics_bind_address: SocketAddr,
    /// Once our rules serve the node, remove kube-proxy's leftovers (its nftables tables and
    /// KUBE-* iptables chains; kubelet's chains are kept).
    #[arg(long)]
    takeover_kube_proxy: bool,
    /// iptables mode: serve IPv4 NodePorts on 127.0.0.1 too (sets route_localnet=1 and adds
    /// kube-proxy's guard rule against martian localnet traffic), as kube-proxy's
    /// `--iptables-localhost-nodeports`; `=false` refuses such connections at once.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    iptables_localhost_nodeports: bool,
    /// nftables mode: serve IPv4 NodePorts on 127.0.0.1 too, in the kernel (sets route_localnet=1,
    /// DNATs node-local connections to 127.0.0.0/8 and guards loopback against other hosts).
    /// Off by default, as kube-proxy's nftables mode, which does not serve them. A policy's
    /// `proxy.localhostNodePorts` overrides this and `--iptables-localhost-nodeports`.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    nftables_localhost_nodeports: bool,
    /// The cluster's Service CIDRs (the apiserver's `--service-cluster-ip-range`), one per family
    /// comma-separated: nftables mode drops traffic to an address in them that is no ClusterIP it
    /// handles (an unallocated address, or a Service of another proxy) instead of routing it out
    /// of the node, as kube-proxy does with its ServiceCIDR objects.
    #[arg(long, value_parser = CidrList::parse)]
    service_cidr: Option<CidrList>,
    /// Directory for the persisted switch state.
    #[arg(long, default_value = "/var/lib/switchyard")]
    state_dir: PathBuf,
    /// Seconds between capability re-probes in --report-only mode.
    #[arg(long, default_value_t = 300)]
    report_interval_seconds: u64,
    /// Objects per page when Services and EndpointSlices are listed (at start-up and after the
    /// apiserver asks for a relist). Larger pages mean fewer round trips and more memory for one
    /// page; the default fits 44k Services in 9 pages of about 2 MB each.
    #[arg(long, default_value_t = runtime::DEFAULT_LIST_PAGE, value_parser = clap::value_parser!(u32).range(1..))]
    list_page_size: u32,
    /// Fault injection for the crash tests: stall for a minute right after persisting this switch
    /// phase, so that a test can kill the agent exactly there.
    #[arg(long, value_enum, hide = true)]
    test_pause_at: Option<PhaseFlag>,
}

fn main() -> ExitCode {
    // Before the runtime's threads touch memory: see both functions.
    let small_pages = keep_heap_in_small_pages();
    return_freed_pages_at_once();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("switchyard-agent: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(agent_main(small_pages))
}

/// Turns transparent huge pages off for this process (`PR_SET_THP_DISABLE`, checked by the kernel
/// at every page fault, so it also covers the arena the allocator mapped before `main`).
///
/// mimalloc advises its arenas `MADV_HUGEPAGE` unless built with `no_thp` (it is, see Cargo.toml),
/// and on a node whose THP mode is `always` the kernel backs them with huge pages anyway: one
/// touched byte makes 2 MiB resident and faults may stall in compaction. Measured with
/// `api-bench --rows 1kx1-64 --proxies sy-nft`: RSS after the first sync 64.6 MiB with THP (30 MiB
/// of it in huge pages), 41.6 without; first sync 0.17 s against 0.10 s.
fn keep_heap_in_small_pages() -> nix::Result<()> {
    nix::sys::prctl::set_thp_disable(true)
}

/// mimalloc's `mi_option_purge_delay`: its place in v2's `mi_option_t` (`mimalloc.h`), for which
/// the sys crate names no constant. The test below checks it reads the option's documented default.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Makes mimalloc give pages that fall free back to the kernel at once rather than 10 ms later.
///
/// A delayed purge only happens when the same thread allocates again, and the agent's threads go
/// quiet right after a sync, so what a sync freed stayed resident until the next one.
/// Measured with `api-bench --rows 256x1-256 --proxies sy-nft` (environment variable
/// `MIMALLOC_PURGE_DELAY`, same effect): RSS after the first sync 54.4 / 57.4 / 56.9 MiB with the
/// default, 37.8 / 40.2 / 39.6 with 0; first sync 0.11–0.12 s both.
#[allow(unsafe_code)]
fn return_freed_pages_at_once() {
    // SAFETY: stores one word of mimalloc's option table (an atomic store behind a function call);
    // no pointer is passed and 0 is a valid value of this option ("purge at once").
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
}

async fn agent_main(small_pages: nix::Result<()>) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: a Pod's log (kubectl logs, a log shipper) reads plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = small_pages {
        tracing::warn!(error = %e, "could not turn transparent huge pages off; RSS may be higher");
    }
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "switchyard-agent stopped");
            eprintln!("switchyard-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The capabilities, probed and logged.
async fn probed(node: &str) -> Result<switchyard_crds::v1alpha1::Capabilities> {
    let caps = capabilities().await?;
    tracing::info!(node, kernel = caps.kernel_version, modes = ?caps.supported_modes, "capabilities probed");
    Ok(caps)
}

/// `--sync-period`, checked.
fn sync_period(args: &Args) -> Result<Duration> {
    let finite_min = args.min_sync_period.is_none_or(|p| p.is_finite() && p >= 0.0);
    if !(finite_min && args.sync_period.is_finite() && args.sync_period > 0.0) {
        return Err(Error::Config(
            "--min-sync-period must be a finite number >= 0 and --sync-period a finite number > 0".into(),
        ));
    }
    Ok(Duration::from_secs_f64(args.sync_period))
}

async fn capabilities() -> Result<switchyard_crds::v1alpha1::Capabilities> {
    let facts = tokio::task::spawn_blocking(probe::HostFacts::gather)
        .await
        .map_err(|e| Error::Config(format!("probe task: {e}")))?;
    Ok(probe::decide(&facts))
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
    Client::try_from(config).map_err(|source| Error::Kube {
        action: "build client".into(),
        source,
    })
}

fn runtime_config(
    args: &Args,
    node: String,
    caps: switchyard_crds::v1alpha1::Capabilities,
) -> Result<runtime::Config> {
    let mode = ProxyMode::from(args.mode);
    let cidrs = |list: &Option<CidrList>| list.as_ref().map(|c| c.0.clone()).unwrap_or_default();
    let node_port_addresses = args
        .nodeport_addresses
        .clone()
        .unwrap_or_else(|| NodePortAddresses::default_for(mode));
    let sync_period = sync_period(args)?;
    Ok(runtime::Config {
        node_name: node,
        mode,
        iptables_variant: caps.iptables_variant.clone().unwrap_or_else(|| "legacy".into()),
        cluster_cidrs: cidrs(&args.cluster_cidr),
        masquerade_all: args.masquerade_all,
        node_port_addresses,
        proxy_name: args.service_proxy_name.clone(),
        min_sync_period: args.min_sync_period.map(Duration::from_secs_f64),
        sync_period,
        capabilities: caps,
        state_dir: args.state_dir.clone(),
        takeover_kube_proxy: args.takeover_kube_proxy,
        localhost_node_ports: args.iptables_localhost_nodeports,
        nftables_localhost_node_ports: args.nftables_localhost_nodeports,
        service_cidrs: cidrs(&args.service_cidr),
        conntrack: None,
        ipvs: None,
    })
}

async fn run(args: Args) -> Result<()> {
    if args.probe {
        let caps = capabilities().await?;
        println!(
            "{}",
            serde_json::to_string_pretty(&caps).map_err(|e| Error::Config(e.to_string()))?
        );
        return Ok(());
    }
    if args.cleanup {
        let state = switchyard_agent::state_store::StateFile(args.state_dir.join("state.json"));
        let errors = tokio::task::spawn_blocking(move || {
            let mut errors: Vec<String> = backend::cleanup_all().iter().map(ToString::to_string).collect();
            errors.extend(runtime::restore_conntrack_sysctls(&state));
            errors
        })
        .await
        .map_err(|e| Error::Config(format!("cleanup task: {e}")))?;
        for e in &errors {
            eprintln!("switchyard-agent: cleanup: {e}");
        }
        return if errors.is_empty() {
            Ok(())
        } else {
            Err(Error::Config(format!("{} cleanup step(s) failed", errors.len())))
        };
    }
    let node = args
        .node_name
        .clone()
        .ok_or_else(|| Error::Config("--node-name (or NODE_NAME) is required".into()))?;
    tracing::info!(node, version = env!("CARGO_PKG_VERSION"), "agent starting");
    let client = client(
        args.kubeconfig.as_ref(),
        args.apiserver_host.as_deref(),
        args.apiserver_port,
    )
    .await?;
    if args.render {
        return render(&args, &client, node).await;
    }
    // No API call before the proxy loop: an agent started while the apiserver is down must come
    // up and keep the node's rules (the loop registers the NodeProxy once the API answers).
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::Config(format!("signal handler: {e}")))?;
    if args.report_only {
        let caps = probed(&node).await?;
        return report_only(&args, &client, &node, caps, &mut terminate).await;
    }
    // The kernel is probed while intake lists Services and EndpointSlices (tens of ms off a
    // start; the first sync needs both).
    let config = async {
        let caps = probed(&node).await?;
        runtime_config(&args, node.clone(), caps)
    };
    let intake = runtime::Intake {
        node_name: node.clone(),
        proxy_name: args.service_proxy_name.clone(),
        list_page: args.list_page_size,
    };
    let health = Arc::new(ProxyHealth::new(sync_period(&args)?.mul_f64(2.0)));
    let metrics = Arc::new(Metrics::new());
    let router = health::router(HttpState {
        health: health.clone(),
        metrics: metrics.clone(),
    });
    let servers = async {
        let (a, b) = (args.healthz_bind_address, args.metrics_bind_address);
        if a == b {
            health::serve(a, router).await
        } else {
            tokio::try_join!(health::serve(a, router.clone()), health::serve(b, router)).map(|_| ())
        }
    };
    // Exiting never touches the kernel: the data path keeps forwarding while the agent restarts.
    tokio::select! {
        r = runtime::run(client, intake, config, health, metrics, fault_hook(&args)) => r,
        r = servers => r.map_err(|e| Error::Config(format!("health server: {e}"))),
        _ = tokio::signal::ctrl_c() => Ok(()),
        _ = terminate.recv() => Ok(()),
    }
}

/// The driver's fault hook: `--test-pause-at`, or none.
fn fault_hook(args: &Args) -> Arc<dyn FaultHook> {
    match args.test_pause_at {
        Some(phase) => Arc::new(PauseAfter {
            phase: phase.into(),
            pause: Duration::from_secs(60),
        }),
        None => Arc::new(NoFaults),
    }
}

async fn report_only(
    args: &Args,
    client: &Client,
    node: &str,
    mut caps: switchyard_crds::v1alpha1::Capabilities,
    terminate: &mut tokio::signal::unix::Signal,
) -> Result<()> {
    let mut registered = false;
    loop {
        let status = switchyard_crds::v1alpha1::NodeProxyStatus {
            agent_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
            capabilities: Some(caps),
            phase: Some(switchyard_crds::v1alpha1::SwitchPhase::Initializing),
            ..Default::default()
        };
        // API errors are retried (every 5 s), never fatal.
        let mut wait = Duration::from_secs(args.report_interval_seconds);
        let reported = async {
            if !registered {
                report::ensure_registered(client, node).await?;
                registered = true;
            }
            report::apply_status(client, node, &status).await
        };
        if let Err(e) = reported.await {
            tracing::warn!(error = %e, "reporting capabilities failed; retrying");
            wait = wait.min(Duration::from_secs(5));
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = terminate.recv() => return Ok(()),
        }
        caps = capabilities().await?;
    }
}

async fn render(args: &Args, client: &Client, node: String) -> Result<()> {
    use k8s_openapi::api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    };
    let kube_err = |action: &str| {
        let action = action.to_owned();
        move |source| Error::Kube { action, source }
    };
    let services = Api::<Service>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(kube_err("list services"))?;
    let slices = Api::<EndpointSlice>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(kube_err("list endpointslices"))?;
    let node_obj = Api::<Node>::all(client.clone())
        .get_opt(&node)
        .await
        .map_err(kube_err("get node"))?;
    let mut tracker = Tracker::new(args.service_proxy_name.clone());
    tracker.reset_services(&services.items);
    tracker.reset_slices(&slices.items);
    let caps = switchyard_crds::v1alpha1::Capabilities {
        iptables_variant: Some("legacy".into()),
        ..Default::default()
    };
    let config = runtime_config(args, node, caps)?;
    let settings = runtime::node_settings(&config, node_obj.as_ref());
    let backend = backend::new_backend(config.mode, settings, &config.iptables_variant);
    print!("{}", backend.render_text(&tracker.snapshot()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(unsafe_code)]
    fn the_purge_delay_option_is_the_one_mimalloc_documents() {
        // SAFETY: reads one option word; no pointers.
        let read = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(read(), 10, "v2's purge delay defaults to 10 ms");
        }
        return_freed_pages_at_once();
        assert_eq!(read(), 0);
    }

    #[test]
    fn flags_parse_into_typed_values() {
        let args = Args::try_parse_from([
            "switchyard-agent",
            "--mode",
            "ipvs",
            "--cluster-cidr",
            "10.244.0.0/16,fd00:10:244::/56",
            "--nodeport-addresses",
            "10.250.0.0/24",
            "--test-pause-at",
            "CutOver",
        ])
        .expect("parses");
        assert_eq!(ProxyMode::from(args.mode), ProxyMode::Ipvs);
        assert_eq!(args.cluster_cidr.map(|c| c.0.len()), Some(2));
        assert!(matches!(args.nodeport_addresses, Some(NodePortAddresses::Cidrs(c)) if c.len() == 1));
        assert_eq!(
            args.test_pause_at.map(switchyard_agent::switch::Phase::from),
            Some(switchyard_agent::switch::Phase::CutOver)
        );
        let defaults = Args::try_parse_from(["switchyard-agent"]).expect("parses");
        assert_eq!(ProxyMode::from(defaults.mode), ProxyMode::Nftables);
        assert!(defaults.test_pause_at.is_none());
        for bad in [
            ["--mode", "userspace"],
            ["--cluster-cidr", "10.0.0.0/8,10.1.0.0/16"],
            ["--nodeport-addresses", "nowhere"],
            ["--test-pause-at", "cut-over"],
        ] {
            let args = std::iter::once("switchyard-agent").chain(bad);
            assert!(Args::try_parse_from(args).is_err(), "{bad:?} was accepted");
        }
    }
}
