//! `plan-bench`: planning time of the wave planner at 100, 1,000 and 5,000 nodes (plus any sizes
//! given as arguments), printed as a table. Each size plans a cluster in the middle of a rollout:
//! three policies (two overlapping), three waves, a quarter of the nodes already switched, some
//! switching, one failed within budget.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

use std::time::Instant;

use jiff::Timestamp;
use serde_json::json;
use switchyard_crds::v1alpha1::{
    Capabilities, NodeProxySpec, NodeProxyStatus, PolicyReference, ProxyMode, SwitchPhase, SwitchResult,
};
use switchyard_operator::planner::{self, NodeInput, NodeProxyInput, PolicyInput};

/// Planner inputs: policies, nodes, NodeProxies.
type Inputs = (Vec<PolicyInput>, Vec<NodeInput>, Vec<NodeProxyInput>);

fn inputs(n: usize) -> Result<Inputs, serde_json::Error> {
    let policy = |name: &str,
                  selector: serde_json::Value,
                  priority: i32,
                  mode: &str|
     -> Result<PolicyInput, serde_json::Error> {
        Ok(PolicyInput {
            name: name.into(),
            uid: format!("uid-{name}"),
            generation: 1,
            spec: serde_json::from_value(json!({
                "nodeSelector": selector, "priority": priority, "mode": mode,
                "rollout": {"maxUnavailable": "5%", "maxFailures": 10, "waves": [
                    {"name": "canary", "nodes": 1}, {"name": "half", "nodes": "50%"}, {"name": "rest", "nodes": "100%"}]},
            }))?,
            approvals: Default::default(),
            annotations: Vec::new(),
            rollback: None,
            status: None,
        })
    };
    let policies = vec![
        policy("pool-a", json!({"matchLabels": {"pool": "a"}}), 0, "nftables")?,
        policy(
            "pool-b",
            json!({"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]}),
            0,
            "nftables",
        )?,
        policy("everything", json!({}), -1, "iptables")?,
    ];
    let mut nodes = Vec::with_capacity(n);
    let mut proxies = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("node-{i:05}");
        let pool = if i % 2 == 0 { "a" } else { "b" };
        nodes.push(NodeInput {
            name: name.clone(),
            uid: format!("{i:08x}-0000-4000-8000-000000000000"),
            labels: [
                ("pool".to_owned(), pool.to_owned()),
                ("zone".to_owned(), format!("z{}", i % 3)),
            ]
            .into(),
        });
        let policy_name = format!("pool-{pool}");
        let switched = i % 4 == 0;
        let token = format!("{policy_name}-g1-nftables");
        let (spec, active, last) = if switched || i % 97 == 1 {
            let result = if i % 997 == 1 { "RolledBack" } else { "Succeeded" };
            let active = if switched && result == "Succeeded" {
                ProxyMode::Nftables
            } else {
                ProxyMode::Iptables
            };
            let last = (switched || result == "RolledBack").then(|| SwitchResult {
                from: Some(ProxyMode::Iptables),
                to: ProxyMode::Nftables,
                result: result.into(),
                reason: None,
                rollout_token: Some(token.clone()),
                started_at: None,
                finished_at: None,
            });
            let spec = NodeProxySpec {
                desired_mode: Some(ProxyMode::Nftables),
                policy: Some(PolicyReference {
                    name: policy_name,
                    uid: None,
                    generation: Some(1),
                }),
                rollout_token: Some(token),
                ..Default::default()
            };
            (spec, active, last)
        } else {
            (NodeProxySpec::default(), ProxyMode::Iptables, None)
        };
        proxies.push(NodeProxyInput {
            name,
            spec,
            status: Some(NodeProxyStatus {
                capabilities: Some(Capabilities {
                    supported_modes: vec![ProxyMode::Iptables, ProxyMode::Nftables],
                    ..Default::default()
                }),
                active_mode: Some(active),
                phase: Some(SwitchPhase::Active),
                last_switch: last,
                ..Default::default()
            }),
        });
    }
    Ok((policies, nodes, proxies))
}

fn main() -> Result<(), serde_json::Error> {
    let mut sizes: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = vec![100, 1000, 5000];
    }
    let now = Timestamp::now();
    println!(
        "{:>7} {:>9} {:>10} {:>10} {:>10} {:>8}",
        "nodes", "policies", "min ms", "median ms", "max ms", "writes"
    );
    for n in sizes {
        let (policies, nodes, proxies) = inputs(n)?;
        let runs = if n <= 1000 { 50 } else { 15 };
        let mut times = Vec::with_capacity(runs);
        let mut writes = 0;
        for _ in 0..runs {
            let start = Instant::now();
            let plan = planner::plan(&policies, &nodes, &proxies, now);
            times.push(start.elapsed().as_secs_f64() * 1000.0);
            writes = plan.policies.iter().map(|p| p.writes.len()).sum::<usize>();
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!(
            "{n:>7} {:>9} {:>10.2} {median:>10.2} {:>10.2} {writes:>8}",
            policies.len(),
            times[0],
            times[times.len() - 1]
        );
    }
    Ok(())
}
