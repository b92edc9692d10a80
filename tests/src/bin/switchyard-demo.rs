//! The local demo: a real etcd + kube-apiserver, Switchyard's CRDs and RBAC, three
//! network-namespace nodes each running `switchyard-agent`; prints the NodeProxies and keeps
//! running until Ctrl-C, then removes everything it created.

use std::{process::ExitCode, time::Duration};

use switchyard_e2e::agent::TestEnv;

const NODES: usize = 3;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("switchyard-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> switchyard_e2e::Result<()> {
    println!("starting etcd + kube-apiserver, installing CRDs and RBAC, creating {NODES} namespace nodes ...");
    let mut env = TestEnv::start(NODES, 2).await?;
    env.start_agents(&["--report-interval-seconds", "30"]).await?;
    let kubeconfig = env.cp.admin_kubeconfig();
    let kubectl = env.cp.bin.join("kubectl");
    // Wait until every agent has reported.
    for _ in 0..300 {
        let out = env.cp.kubectl_ok(&["get", "nodeproxies", "-o", "jsonpath={.items[*].status.capabilities.kernelVersion}"], None)?;
        if out.split_whitespace().count() == NODES {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("{}", env.cp.kubectl_ok(&["get", "nodeproxies", "-o", "wide"], None)?);
    println!("The control plane keeps running. In another shell:");
    println!("  {} --kubeconfig {} get nodeproxies -o wide", kubectl.display(), kubeconfig.display());
    println!("  {} --kubeconfig {} get nodeproxy node-1 -o yaml", kubectl.display(), kubeconfig.display());
    println!("Press Ctrl-C to stop and clean up.");
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| switchyard_e2e::Error::Prerequisite(e.to_string()))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    println!("stopping agents, deleting namespaces, stopping the control plane ...");
    drop(env);
    Ok(())
}
