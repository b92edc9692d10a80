//! `kubectl-switchyard`: a kubectl plugin (`kubectl switchyard ...`) to plan, watch and steer
//! Switchyard rollouts. Uses the kubeconfig the way kubectl does: `--kubeconfig`, else
//! `$KUBECONFIG`, else `~/.kube/config`, else the in-cluster service account.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use kube::{
    Api, Client, Config,
    api::{ListParams, Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use kubectl_switchyard::{
    Error, ROLLBACK_ANNOTATION, Result, approve_patch, pause_patch, plan_for, policies_from_yaml,
    render_plan, render_status, rollback_patch, table, wave_to_approve,
};
use switchyard_crds::v1alpha1::{NodeProxy, ProxyPolicy};

/// Plan, inspect and steer Switchyard ProxyPolicy rollouts.
#[derive(Parser, Debug)]
#[command(name = "kubectl switchyard", version, about)]
struct Args {
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long, global = true)]
    context: Option<String>,
    #[command(subcommand)]
    command: Command,
}

/// Output format of `plan`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Output {
    /// A readable table.
    Table,
    /// JSON (the waves, nodes and states).
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the waves and nodes the operator will use for a policy (its own planner, over the
    /// cluster's Nodes, NodeProxies and other policies). Changes nothing.
    Plan {
        /// Policy in the cluster (omit with -f to plan every policy in the file).
        name: Option<String>,
        /// Plan the ProxyPolicy (or policies) in this YAML file instead of the cluster's copy.
        #[arg(short = 'f', long)]
        filename: Option<PathBuf>,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value = "table")]
        output: Output,
    },
    /// Show a policy's rollout status (all policies when no name is given).
    Status {
        /// Policy name.
        name: Option<String>,
    },
    /// Approve a wave for the policy's current generation (annotation
    /// approve.switchyard.dev/<wave>=<generation>).
    Approve {
        /// Policy name.
        name: String,
        /// Wave to approve; default: the wave that awaits approval now.
        #[arg(long)]
        wave: Option<String>,
    },
    /// Stop starting new switches (spec.rollout.paused=true); switches under way finish.
    Pause {
        /// Policy name.
        name: String,
    },
    /// Start switching again (spec.rollout.paused=false); also ends a manual rollback.
    Resume {
        /// Policy name.
        name: String,
    },
    /// Pause and return every node this rollout switched to its previous mode (annotation
    /// switchyard.dev/rollback=<generation>). `resume` rolls forward again.
    Rollback {
        /// Policy name.
        name: String,
    },
    /// Show the mode advisor's recommendation for each node (a policy's, or every node) with
    /// the figures it used, and the summary over them. Changes nothing.
    Advise {
        /// Policy whose nodes to show (omit for every node).
        name: Option<String>,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value = "table")]
        output: Output,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kubectl-switchyard: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn client(args: &Args) -> Result<Client> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| Error::Usage(format!("kubeconfig {}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(kc, &options)
                .await
                .map_err(|e| Error::Usage(format!("kubeconfig {}: {e}", path.display())))?
        }
        None if args.context.is_some() => Config::from_kubeconfig(&options)
            .await
            .map_err(|e| Error::Usage(format!("kubeconfig: {e}")))?,
        None => Config::infer()
            .await
            .map_err(|e| Error::Usage(format!("no kubeconfig: {e}")))?,
    };
    Client::try_from(config).map_err(|source| Error::Kube {
        action: "build client".into(),
        source,
    })
}

fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| Error::Kube { action, source }
}

async fn get_policy(api: &Api<ProxyPolicy>, name: &str) -> Result<ProxyPolicy> {
    api.get(name)
        .await
        .map_err(kube_err(format!("get proxypolicy {name}")))
}

async fn patch(api: &Api<ProxyPolicy>, name: &str, body: &serde_json::Value) -> Result<ProxyPolicy> {
    api.patch(name, &PatchParams::default(), &Patch::Merge(body))
        .await
        .map_err(kube_err(format!(
            "patch proxypolicy {name} (if it changed meanwhile, run the command again)"
        )))
}

async fn run(args: Args) -> Result<()> {
    let client = client(&args).await?;
    let policies: Api<ProxyPolicy> = Api::all(client.clone());
    match args.command {
        Command::Plan {
            name,
            filename,
            output,
        } => plan(&client, &policies, name, filename, output).await,
        Command::Status { name: Some(name) } => {
            print!("{}", render_status(&get_policy(&policies, &name).await?));
            Ok(())
        }
        Command::Status { name: None } => status_all(&policies).await,
        Command::Approve { name, wave } => {
            let p = get_policy(&policies, &name).await?;
            let wave = wave_to_approve(&p, wave.as_deref())?;
            let done = patch(&policies, &name, &approve_patch(&p, &wave)).await?;
            println!(
                "proxypolicy/{name}: wave {wave} approved for generation {}",
                done.metadata.generation.unwrap_or(0)
            );
            Ok(())
        }
        Command::Pause { name } => {
            patch(&policies, &name, &pause_patch(true)).await?;
            println!("proxypolicy/{name} paused: no new switches start (running ones finish)");
            Ok(())
        }
        Command::Resume { name } => resume(&policies, &name).await,
        Command::Rollback { name } => rollback(&policies, &name).await,
        Command::Advise { name, output } => advise(&client, &policies, name, output).await,
    }
}

/// `advise`: the agents' recommendations from the NodeProxies, summed as the operator sums them.
async fn advise(
    client: &Client,
    policies: &Api<ProxyPolicy>,
    name: Option<String>,
    output: Output,
) -> Result<()> {
    let policy = match &name {
        Some(n) => Some(get_policy(policies, n).await?),
        None => None,
    };
    let proxies = list(&Api::<NodeProxy>::all(client.clone()), "nodeproxies").await?;
    let report = kubectl_switchyard::advise::advise_report(policy.as_ref(), &proxies);
    match output {
        Output::Json => {
            let text =
                serde_json::to_string_pretty(&report).map_err(|e| Error::Usage(format!("json: {e}")))?;
            println!("{text}");
        }
        Output::Table => print!("{}", kubectl_switchyard::advise::render_advice(&report)),
    }
    Ok(())
}

async fn list<K>(api: &Api<K>, what: &str) -> Result<Vec<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list(&ListParams::default())
        .await
        .map_err(kube_err(format!("list {what}")))?
        .items)
}

/// The policies `plan` plans: from the file (all, or the one named), else the cluster's copy.
fn plan_targets(
    cluster: &[ProxyPolicy],
    name: Option<String>,
    filename: Option<PathBuf>,
) -> Result<Vec<ProxyPolicy>> {
    match (&filename, &name) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path).map_err(|e| Error::File {
                path: path.display().to_string(),
                detail: e.to_string(),
            })?;
            let all = policies_from_yaml(&path.display().to_string(), &text)?;
            let chosen: Vec<ProxyPolicy> = all
                .into_iter()
                .filter(|p| name.is_none() || p.metadata.name == name)
                .collect();
            if chosen.is_empty() {
                return Err(Error::Usage(format!(
                    "{}: no ProxyPolicy{} in the file",
                    path.display(),
                    name.as_deref().map(|n| format!(" named {n}")).unwrap_or_default()
                )));
            }
            Ok(chosen)
        }
        (None, Some(n)) => Ok(vec![
            cluster
                .iter()
                .find(|p| p.metadata.name.as_deref() == Some(n.as_str()))
                .cloned()
                .ok_or_else(|| {
                    Error::Usage(format!(
                        "proxypolicy {n} not found (use -f FILE for a policy not applied yet)"
                    ))
                })?,
        ]),
        (None, None) => Err(Error::Usage("name a policy, or pass -f FILE".into())),
    }
}

async fn plan(
    client: &Client,
    policies: &Api<ProxyPolicy>,
    name: Option<String>,
    filename: Option<PathBuf>,
    output: Output,
) -> Result<()> {
    let cluster = list(policies, "proxypolicies").await?;
    let targets = plan_targets(&cluster, name, filename)?;
    let nodes = list(&Api::<Node>::all(client.clone()), "nodes").await?;
    let proxies = list(&Api::<NodeProxy>::all(client.clone()), "nodeproxies").await?;
    // Policies from the file also take part in each other's precedence.
    let mut universe = cluster.clone();
    for t in &targets {
        if !universe.iter().any(|p| p.metadata.name == t.metadata.name) {
            universe.push(t.clone());
        }
    }
    let now = Timestamp::now();
    let mut reports = Vec::new();
    for t in &targets {
        reports.push(plan_for(t, &universe, &nodes, &proxies, now)?);
    }
    match output {
        Output::Json => {
            let text =
                serde_json::to_string_pretty(&reports).map_err(|e| Error::Usage(format!("json: {e}")))?;
            println!("{text}");
        }
        Output::Table => {
            let texts: Vec<String> = reports.iter().map(render_plan).collect();
            print!("{}", texts.join("\n"));
        }
    }
    Ok(())
}

async fn status_all(policies: &Api<ProxyPolicy>) -> Result<()> {
    let list = list(policies, "proxypolicies").await?;
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|p| {
            let s = p.status.clone().unwrap_or_default();
            vec![
                p.metadata.name.clone().unwrap_or_default(),
                p.spec.mode.to_string(),
                p.spec.priority.to_string(),
                s.phase.map(|x| format!("{x:?}")).unwrap_or_else(|| "-".into()),
                s.current_wave.unwrap_or_else(|| "-".into()),
                format!("{}/{}", s.healthy_nodes, s.target_nodes),
                s.failed_nodes.to_string(),
                s.conditions
                    .iter()
                    .find(|c| c.type_ == "Ready")
                    .map(|c| c.message.clone())
                    .unwrap_or_default(),
            ]
        })
        .collect();
    print!(
        "{}",
        table(
            &[
                "NAME", "MODE", "PRIORITY", "PHASE", "WAVE", "HEALTHY", "FAILED", "MESSAGE"
            ],
            &rows
        )
    );
    Ok(())
}

async fn resume(policies: &Api<ProxyPolicy>, name: &str) -> Result<()> {
    let p = get_policy(policies, name).await?;
    let rollback_in_force = p
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ROLLBACK_ANNOTATION))
        .is_some_and(|v| v.trim().parse::<i64>().ok() == p.metadata.generation);
    if !p.spec.rollout.paused && rollback_in_force {
        return Err(Error::Usage(format!(
            "proxypolicy/{name} is not paused but rolled back for generation {}: the rollback holds until the spec changes (edit the spec, e.g. pause and resume)",
            p.metadata.generation.unwrap_or(0)
        )));
    }
    patch(policies, name, &pause_patch(false)).await?;
    println!("proxypolicy/{name} resumed");
    Ok(())
}

async fn rollback(policies: &Api<ProxyPolicy>, name: &str) -> Result<()> {
    let p = get_policy(policies, name).await?;
    let (target, body) = rollback_patch(&p);
    let done = patch(policies, name, &body).await?;
    let generation = done.metadata.generation.unwrap_or(0);
    if generation != target {
        // The generation moved differently than expected: name the one it has now.
        let fix =
            serde_json::json!({"metadata": {"annotations": {ROLLBACK_ANNOTATION: generation.to_string()}}});
        patch(policies, name, &fix).await?;
    }
    println!(
        "proxypolicy/{name} paused and rolling back (generation {generation}): nodes this rollout switched return to their previous mode; `kubectl switchyard resume {name}` rolls forward again"
    );
    Ok(())
}
