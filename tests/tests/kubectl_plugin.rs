//! `kubectl switchyard` on a real apiserver: `plan` predicts, before the operator has run, the same
//! waves and nodes the operator then writes into the policy's status (it runs the operator's own
//! planner); `status`, `approve`, `pause` and `resume` do what they say. (`rollback` is exercised in
//! tests/tests/argocd_health.rs.)

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::{Api, api::PostParams};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{PolicyPhase, ProxyPolicy, ProxyPolicyStatus};
use switchyard_e2e::{agent, binaries, controlplane::ControlPlane, eventually, operator::Operator, tools};

const LIMIT: Duration = Duration::from_secs(60);
const POLICY: &str = "general-to-nftables";

async fn wait_status<F>(policies: &Api<ProxyPolicy>, what: &str, ok: F) -> ProxyPolicyStatus
where
    F: Fn(&ProxyPolicy, &ProxyPolicyStatus) -> bool,
{
    let ok = &ok;
    eventually(LIMIT, what, || async move {
        let p = policies.get(POLICY).await.ok()?;
        let s = p.status.clone()?;
        ok(&p, &s).then_some(s)
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}; last: {:#?}",
            futures::executor::block_on(policies.get(POLICY))
                .ok()
                .and_then(|p| p.status)
        )
    })
}

fn plugin_ok(cp: &ControlPlane, args: &[&str]) -> String {
    let (ok, out, err) = tools::plugin(&cp.admin_kubeconfig(), args).expect("run kubectl-switchyard");
    assert!(ok, "kubectl switchyard {}: {out}{err}", args.join(" "));
    println!("$ kubectl switchyard {}\n{out}", args.join(" "));
    out
}

fn waves_of(report: &Value) -> Vec<(String, Vec<String>)> {
    report["waves"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            (
                w["name"].as_str().unwrap_or_default().to_owned(),
                w["nodes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|n| n.as_str().map(String::from))
                    .collect(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plan_matches_the_operator_and_the_commands_steer_it() {
    let cp = ControlPlane::start().await.expect("control plane");
    agent::install_switchyard(&cp).expect("install");
    let admin = cp.admin_client().await.expect("admin");
    let nodes: Api<Node> = Api::all(admin.clone());
    for i in 1..=7 {
        let name = format!("node-{i}");
        let node: Node =
            serde_json::from_value(json!({"metadata": {"name": name, "labels": {"pool": "general"}}}))
                .expect("node");
        let uid = nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("node")
            .metadata
            .uid
            .expect("uid");
        switchyard_e2e::agent::register_node_proxy(&admin, &name, &uid)
            .await
            .expect("np");
        // node-7's kernel is too old for nftables: the sample's fallback (iptables) applies there.
        let modes = if i == 7 {
            json!(["iptables"])
        } else {
            json!(["iptables", "nftables"])
        };
        let status = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "status": {
            "capabilities": {"kernelVersion": if i == 7 { "5.4.0" } else { "6.12.0" }, "supportedModes": modes,
              "nftables": {"usable": i != 7}, "iptablesLegacy": {"usable": true}, "iptablesNft": {"usable": true},
              "ipvs": {"usable": false}, "ipset": {"usable": true}},
            "activeMode": "iptables", "phase": "Active",
        }});
        switchyard_e2e::agent::write_agent_status(&admin, &name, status["status"].clone())
            .await
            .expect("status");
    }
    // The sample without its maintenance window (Mon–Thu office hours): what the planner says
    // must not depend on when the test runs.
    let text = std::fs::read_to_string(
        binaries::workspace_root().join("config/samples/canary-iptables-to-nftables.yaml"),
    )
    .expect("sample");
    let mut in_window = false;
    let without_window: String = text
        .lines()
        .filter(|l| {
            if l.trim_start() == "window:" {
                in_window = true;
                return false;
            }
            if in_window && l.starts_with("      ") {
                return false;
            }
            in_window = false;
            true
        })
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(!without_window.contains("timeZone"), "window removed");
    let sample_path = cp.dir().join("sample-no-window.yaml");
    std::fs::write(&sample_path, without_window).expect("write sample copy");
    let sample = sample_path.display().to_string();
    // Before it is applied: sizes are exact, the order inside waves is not (no UID yet).
    let text = plugin_ok(&cp, &["plan", "-f", &sample]);
    assert!(text.contains("not in the cluster yet"), "{text}");
    cp.kubectl_ok(&["apply", "-f", &sample], None)
        .expect("apply sample");

    // The prediction, before any operator has seen the policy.
    let by_name: Value =
        serde_json::from_str(&plugin_ok(&cp, &["plan", POLICY, "-o", "json"])).expect("json");
    let from_file: Value =
        serde_json::from_str(&plugin_ok(&cp, &["plan", "-f", &sample, "-o", "json"])).expect("json");
    let predicted = waves_of(&by_name[0]);
    assert_eq!(
        predicted,
        waves_of(&from_file[0]),
        "the file and the cluster copy plan alike"
    );
    assert_eq!(by_name[0]["exactOrder"], true);
    assert_eq!(
        predicted
            .iter()
            .map(|(n, m)| (n.as_str(), m.len()))
            .collect::<Vec<_>>(),
        [("canary", 1), ("half", 4), ("rest", 2)],
        "1, then 50% of 7 rounded up, then the rest"
    );
    assert_eq!(by_name[0]["phase"], "AwaitingApproval");
    let node7 = by_name[0]["nodes"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["name"] == "node-7"))
        .cloned()
        .expect("node-7");
    assert_eq!(node7["target"], "iptables", "fallback: {node7}");
    let table = plugin_ok(&cp, &["plan", POLICY]);
    for header in ["WAVE", "STATE", "MEMBERS", "NODE", "ACTIVE", "TARGET"] {
        assert!(table.contains(header), "{table}");
    }
    for (wave, members) in &predicted {
        let row = table
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(wave.as_str()))
            .unwrap_or_default();
        assert!(
            row.contains(&members.join(",")),
            "wave {wave} row lists its nodes: {row}\n{table}"
        );
    }

    // The operator writes the same plan.
    let policies: Api<ProxyPolicy> = Api::all(admin.clone());
    let op = Operator::start(&cp, "op-1", &[]).await.expect("operator");
    let s = wait_status(&policies, "plan in status", |_, s| s.waves.len() == 3).await;
    let actual: Vec<(String, Vec<String>)> = s
        .waves
        .iter()
        .map(|w| (w.name.clone(), w.nodes.clone()))
        .collect();
    assert_eq!(actual, predicted, "kubectl switchyard plan = the operator's plan");
    assert_eq!(s.phase, Some(PolicyPhase::AwaitingApproval));

    // status shows it; approve writes the approval for the current generation.
    let out = plugin_ok(&cp, &["status", POLICY]);
    assert!(
        out.contains("AwaitingApproval") && out.contains("canary") && out.contains("CONDITION"),
        "{out}"
    );
    let out = plugin_ok(&cp, &["status"]);
    assert!(out.contains(POLICY), "{out}");
    let out = plugin_ok(&cp, &["approve", POLICY]);
    assert!(out.contains("wave canary approved for generation 1"), "{out}");
    let p = policies.get(POLICY).await.expect("policy");
    assert_eq!(
        p.metadata
            .annotations
            .unwrap_or_default()
            .get("approve.switchyard.dev/canary")
            .map(String::as_str),
        Some("1")
    );
    // After approval the canary switches.
    wait_status(&policies, "approved", |_, s| {
        matches!(
            s.phase,
            Some(PolicyPhase::Progressing | PolicyPhase::WaitingForWindow)
        )
    })
    .await;
    let (ok, _, err) =
        tools::plugin(&cp.admin_kubeconfig(), &["approve", POLICY, "--wave", "nope"]).expect("run");
    assert!(!ok && err.contains("has no wave \"nope\""), "{err}");

    // pause / resume: a new generation each, so the earlier approval no longer counts.
    plugin_ok(&cp, &["pause", POLICY]);
    wait_status(&policies, "paused", |p, s| {
        s.phase == Some(PolicyPhase::Paused) && s.observed_generation == p.metadata.generation
    })
    .await;
    plugin_ok(&cp, &["resume", POLICY]);
    let s = wait_status(&policies, "resumed", |p, s| {
        p.metadata.generation == Some(3) && s.observed_generation == Some(3)
    })
    .await;
    assert_eq!(
        s.phase,
        Some(PolicyPhase::AwaitingApproval),
        "the approval was for generation 1: {s:#?}"
    );
    drop(op);
}
