//! Table and scenario tests of the planner: every gate, with a small simulated cluster whose
//! "agents" answer switch requests the way the real agent does.

use std::collections::{BTreeMap, BTreeSet};

use jiff::{SignedDuration, Timestamp};
use serde_json::json;
use switchyard_crds::v1alpha1::{
    Capabilities, NodeProxyStatus, PolicyPhase, ProxyMode, ProxyPolicySpec, SwitchPhase, SwitchResult,
    WaveState,
};

use super::{
    policy::{parse_token_for_tests, rollback_token, switch_token},
    *,
};

const T0: &str = "2025-01-06T12:00:00Z";

fn t0() -> Timestamp {
    T0.parse().unwrap()
}

fn node(name: &str, labels: &[(&str, &str)]) -> NodeInput {
    NodeInput {
        name: name.into(),
        uid: format!("uid-{name}"),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

fn status(active: ProxyMode, supported: &[ProxyMode]) -> NodeProxyStatus {
    NodeProxyStatus {
        capabilities: Some(Capabilities {
            supported_modes: supported.to_vec(),
            ..Default::default()
        }),
        active_mode: Some(active),
        phase: Some(SwitchPhase::Active),
        ..Default::default()
    }
}

fn policy(name: &str, spec: serde_json::Value) -> PolicyInput {
    let spec: ProxyPolicySpec = serde_json::from_value(spec).unwrap();
    PolicyInput {
        name: name.into(),
        uid: format!("uid-{name}"),
        generation: 1,
        spec,
        approvals: BTreeMap::new(),
        annotations: Vec::new(),
        rollback: None,
        status: None,
    }
}

const IPT: ProxyMode = ProxyMode::Iptables;
const NFT: ProxyMode = ProxyMode::Nftables;
const IPVS: ProxyMode = ProxyMode::Ipvs;
const EXT: ProxyMode = ProxyMode::External;
const BOTH: &[ProxyMode] = &[IPT, NFT];

/// A tiny cluster: the planner's writes are applied, and agents answer like the real one.
struct Sim {
    policies: Vec<PolicyInput>,
    nodes: Vec<NodeInput>,
    proxies: BTreeMap<String, NodeProxyInput>,
    now: Timestamp,
    /// Nodes whose next switch (not rollback) fails its health gate.
    failing: BTreeSet<String>,
    events: Vec<(String, EventReason, String)>,
    last: Plan,
}

impl Sim {
    fn new(policies: Vec<PolicyInput>, n: usize, active: ProxyMode) -> Self {
        let nodes: Vec<NodeInput> = (1..=n)
            .map(|i| node(&format!("node-{i}"), &[("pool", "a")]))
            .collect();
        let proxies = nodes
            .iter()
            .map(|n| {
                (
                    n.name.clone(),
                    NodeProxyInput {
                        name: n.name.clone(),
                        spec: Default::default(),
                        status: Some(status(active, BOTH)),
                    },
                )
            })
            .collect();
        Self {
            policies,
            nodes,
            proxies,
            now: t0(),
            failing: BTreeSet::new(),
            events: Vec::new(),
            last: Plan::default(),
        }
    }

    fn plan(&self) -> Plan {
        let proxies: Vec<NodeProxyInput> = self.proxies.values().cloned().collect();
        plan(&self.policies, &self.nodes, &proxies, self.now)
    }

    /// One reconcile of every policy: plan, apply NodeProxy specs, write status, record events.
    fn step(&mut self) -> &Plan {
        let plan = self.plan();
        for pp in &plan.policies {
            for w in &pp.writes {
                let np = self
                    .proxies
                    .entry(w.node.clone())
                    .or_insert_with(|| NodeProxyInput {
                        name: w.node.clone(),
                        ..Default::default()
                    });
                np.spec = w.spec.clone();
            }
            for e in &pp.events {
                self.events.push((pp.name.clone(), e.reason, e.note.clone()));
            }
            if let Some(p) = self.policies.iter_mut().find(|p| p.name == pp.name) {
                p.status = Some(pp.status.clone());
            }
        }
        self.last = plan;
        &self.last
    }

    /// Every agent answers its pending request.
    fn agents(&mut self) {
        for np in self.proxies.values_mut() {
            let (Some(desired), Some(token)) = (np.spec.desired_mode, np.spec.rollout_token.clone()) else {
                continue;
            };
            let Some(st) = np.status.as_mut() else { continue };
            // A settings switch leaves the mode as it is and is answered like a mode switch.
            let settings = token.contains("-settings-");
            if st.last_switch.as_ref().and_then(|l| l.rollout_token.as_ref()) == Some(&token)
                || (st.active_mode == Some(desired) && !settings)
            {
                continue;
            }
            let fail = self.failing.contains(&np.name) && !token.contains("-rollback-");
            let from = st.active_mode;
            if !fail {
                st.active_mode = Some(desired);
            }
            st.last_switch = Some(SwitchResult {
                from,
                to: desired,
                result: if fail { "RolledBack" } else { "Succeeded" }.into(),
                reason: fail.then(|| "probe default/kubernetes: no endpoint answered".into()),
                rollout_token: Some(token),
                started_at: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(self.now)),
                finished_at: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(self.now)),
            });
        }
    }

    fn pp(&self, name: &str) -> &PolicyPlan {
        self.last.policy(name).unwrap()
    }

    fn switching(&self) -> Vec<String> {
        self.proxies
            .values()
            .filter(|np| {
                let st = np.status.as_ref();
                let answered = st
                    .and_then(|s| s.last_switch.as_ref())
                    .and_then(|l| l.rollout_token.as_ref())
                    == np.spec.rollout_token.as_ref();
                np.spec.desired_mode.is_some()
                    && np.spec.desired_mode != st.and_then(|s| s.active_mode)
                    && !answered
            })
            .map(|np| np.name.clone())
            .collect()
    }

    fn active(&self, node: &str) -> Option<ProxyMode> {
        self.proxies[node].status.as_ref().and_then(|s| s.active_mode)
    }

    fn event_reasons(&self) -> Vec<EventReason> {
        self.events.iter().map(|e| e.1).collect()
    }

    fn condition(&self, policy: &str, type_: &str) -> (String, String, String) {
        let c = self
            .pp(policy)
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    fn wave_states(&self, policy: &str) -> Vec<WaveState> {
        self.pp(policy).status.waves.iter().map(|w| w.state).collect()
    }
}

fn three_waves(extra: serde_json::Value) -> serde_json::Value {
    let mut spec = json!({
        "nodeSelector": {"matchLabels": {"pool": "a"}},
        "mode": "nftables",
        "rollout": {"waves": [{"name": "canary", "nodes": 1}, {"name": "half", "nodes": "50%"}, {"name": "rest", "nodes": "100%"}]},
    });
    if let (Some(r), Some(e)) = (spec["rollout"].as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            r.insert(k.clone(), v.clone());
        }
    }
    spec
}

#[test]
fn tokens_parse_and_differ_for_rollback() {
    assert_eq!(switch_token("pool-a", 3, NFT), "pool-a-g3-nftables");
    assert_eq!(rollback_token("pool-a", 3, IPT), "pool-a-g3-rollback-iptables");
    assert_eq!(
        parse_token_for_tests("pool-a", "pool-a-g3-nftables"),
        Some((3, false))
    );
    assert_eq!(
        parse_token_for_tests("pool-a", "pool-a-g3-rollback-iptables"),
        Some((3, true))
    );
    assert_eq!(parse_token_for_tests("pool", "pool-a-g3-nftables"), None);
    assert_eq!(parse_token_for_tests("pool-a", "other-g3-nftables"), None);
}

#[test]
fn wave_sizes_table() {
    // (pool size, waves, expected sizes)
    let cases: Vec<(usize, serde_json::Value, Vec<usize>)> = vec![
        (
            6,
            json!([{"name": "canary", "nodes": 1}, {"name": "half", "nodes": "50%"}, {"name": "rest", "nodes": "100%"}]),
            vec![1, 3, 2],
        ),
        (
            5,
            json!([{"name": "canary", "nodes": 1}, {"name": "half", "nodes": "50%"}, {"name": "rest", "nodes": 1}]),
            vec![1, 3, 1],
        ),
        (
            3,
            json!([{"name": "a", "nodes": "10%"}, {"name": "b", "nodes": 1}]),
            vec![1, 2],
        ),
        (
            2,
            json!([{"name": "a", "nodes": 5}, {"name": "b", "nodes": 5}]),
            vec![2, 0],
        ),
        (4, json!([]), vec![4]),
        (
            0,
            json!([{"name": "a", "nodes": 1}, {"name": "b", "nodes": 1}]),
            vec![0, 0],
        ),
    ];
    for (i, (n, waves, want)) in cases.into_iter().enumerate() {
        let p = policy(
            "p",
            json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"waves": waves, "paused": true}}),
        );
        let mut sim = Sim::new(vec![p], n, IPT);
        sim.step();
        let sizes: Vec<usize> = sim.pp("p").status.waves.iter().map(|w| w.nodes.len()).collect();
        assert_eq!(sizes, want, "case {i}");
    }
}

#[test]
fn explicit_wave_selectors_take_their_nodes_first() {
    let p = policy(
        "p",
        json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"paused": true, "waves": [
            {"name": "canary", "nodes": 1},
            {"name": "zone-b", "nodeSelector": {"matchLabels": {"zone": "b"}}},
            {"name": "rest", "nodes": "100%"}
        ]}}),
    );
    let mut sim = Sim::new(vec![p], 0, IPT);
    for i in 1..=6 {
        let zone = if i % 2 == 0 { "b" } else { "a" };
        sim.nodes.push(node(&format!("node-{i}"), &[("zone", zone)]));
        sim.proxies.insert(
            format!("node-{i}"),
            NodeProxyInput {
                name: format!("node-{i}"),
                spec: Default::default(),
                status: Some(status(IPT, BOTH)),
            },
        );
    }
    sim.step();
    let waves = &sim.pp("p").status.waves;
    assert_eq!(
        waves[1].nodes,
        ["node-2", "node-4", "node-6"],
        "zone-b takes every zone b node, even before the canary fills"
    );
    assert_eq!(waves[0].nodes.len(), 1);
    assert!(!waves[0].nodes[0].ends_with(['2', '4', '6']));
    assert_eq!(waves[2].nodes.len(), 2);
}

#[test]
fn wave_order_is_stable_and_seeded_by_the_policy() {
    let mk = |uid: &str| {
        let mut p = policy(
            "p",
            json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"paused": true, "waves": [{"name": "one", "nodes": 3}, {"name": "rest", "nodes": 1}]}}),
        );
        p.uid = uid.into();
        p
    };
    let mut a = Sim::new(vec![mk("u1")], 20, IPT);
    a.step();
    let first = a.pp("p").status.waves[0].nodes.clone();
    // Same inputs in another order: same plan.
    a.nodes.reverse();
    a.policies[0].status = None;
    a.step();
    assert_eq!(a.pp("p").status.waves[0].nodes, first);
    // Another policy UID: another order (20 choose 3, a collision is very unlikely and deterministic).
    let mut b = Sim::new(vec![mk("u2")], 20, IPT);
    b.step();
    assert_ne!(b.pp("p").status.waves[0].nodes, first);
}

#[test]
fn paused_is_a_dry_run_with_the_full_plan() {
    let mut sim = Sim::new(vec![policy("p", three_waves(json!({"paused": true})))], 6, IPT);
    sim.step();
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Paused));
    assert_eq!(
        pp.status.waves.iter().map(|w| w.nodes.len()).collect::<Vec<_>>(),
        [1, 3, 2]
    );
    assert_eq!(pp.status.current_wave.as_deref(), Some("canary"));
    assert!(
        pp.writes
            .iter()
            .all(|w| w.spec.desired_mode.is_none() && w.spec.policy.is_some()),
        "{:?}",
        pp.writes
    );
    let (s, reason, msg) = sim.condition("p", "Paused");
    assert_eq!((s.as_str(), reason.as_str()), ("True", "SpecPaused"));
    assert!(
        msg.contains("dry run") && msg.contains("kubectl patch proxypolicy p"),
        "{msg}"
    );
    assert_eq!(sim.condition("p", "Ready").0, "False");
    assert_eq!(sim.event_reasons(), [EventReason::Paused]);
    sim.agents();
    sim.step();
    assert!(sim.switching().is_empty());
    assert_eq!(
        sim.event_reasons(),
        [EventReason::Paused],
        "no repeated event while nothing changes"
    );
    assert!(sim.pp("p").writes.is_empty(), "a second reconcile writes nothing");
}

#[test]
fn three_waves_progress_only_as_nodes_report_healthy() {
    let mut sim = Sim::new(vec![policy("p", three_waves(json!({})))], 6, IPT);
    let mut history = Vec::new();
    for _ in 0..20 {
        sim.step();
        let switching = sim.switching();
        assert!(switching.len() <= 1, "maxUnavailable 1 exceeded: {switching:?}");
        history.push((sim.pp("p").status.current_wave.clone(), sim.wave_states("p")));
        // Without agent answers, another reconcile must not release more.
        sim.step();
        assert_eq!(sim.switching(), switching);
        sim.agents();
    }
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Ready));
    assert_eq!(
        (
            pp.status.target_nodes,
            pp.status.updated_nodes,
            pp.status.healthy_nodes
        ),
        (6, 6, 6)
    );
    assert_eq!(sim.condition("p", "Ready").0, "True");
    assert!(sim.nodes.iter().all(|n| sim.active(&n.name) == Some(NFT)));
    // Waves ran in order; a completed wave never went back.
    let order: Vec<Option<String>> = history.iter().map(|h| h.0.clone()).collect();
    let mut seen: Vec<Option<String>> = order.clone();
    seen.dedup();
    assert_eq!(
        seen,
        [
            Some("canary".into()),
            Some("half".into()),
            Some("rest".into()),
            None
        ]
    );
    let reasons = sim.event_reasons();
    let started = reasons.iter().filter(|r| **r == EventReason::WaveStarted).count();
    let completed = reasons
        .iter()
        .filter(|r| **r == EventReason::WaveCompleted)
        .count();
    assert_eq!((started, completed), (3, 3), "{:?}", sim.events);
    // Steady state: nothing to write, no events.
    let before = sim.events.len();
    sim.step();
    assert!(sim.pp("p").writes.is_empty());
    assert_eq!(sim.events.len(), before);
}

#[test]
fn max_unavailable_table() {
    // (nodes, maxUnavailable, nodes unavailable before the start, expected first admissions)
    let cases: Vec<(usize, serde_json::Value, usize, usize)> = vec![
        (10, json!(1), 0, 1),
        (10, json!(3), 0, 3),
        (10, json!("30%"), 0, 3),
        (10, json!("5%"), 0, 1),
        (10, json!(3), 1, 2),
        (10, json!(1), 1, 0),
        (10, json!("100%"), 2, 8),
    ];
    for (i, (n, mu, down, want)) in cases.into_iter().enumerate() {
        let p = policy(
            "p",
            json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"maxUnavailable": mu}}),
        );
        let mut sim = Sim::new(vec![p], n, IPT);
        for k in 1..=down {
            if let Some(st) = sim
                .proxies
                .get_mut(&format!("node-{k}"))
                .and_then(|np| np.status.as_mut())
            {
                st.phase = Some(SwitchPhase::Failed);
            }
        }
        sim.step();
        assert_eq!(sim.switching().len(), want, "case {i}");
        if want == 0 {
            assert!(
                sim.condition("p", "Progressing").2.contains("unavailable"),
                "case {i}: {:?}",
                sim.condition("p", "Progressing")
            );
        }
    }
}

#[test]
fn nodes_without_agent_report_count_as_unavailable() {
    let p = policy("p", json!({"nodeSelector": {}, "mode": "nftables"}));
    let mut sim = Sim::new(vec![p], 3, IPT);
    sim.proxies.remove("node-1");
    sim.step();
    assert!(sim.switching().is_empty());
    let node1 = sim.pp("p").nodes.iter().find(|n| n.name == "node-1").unwrap();
    assert_eq!(node1.state, NodeState::Unknown);
    // The NodeProxy is created (held: policy reference only).
    assert!(
        sim.proxies
            .get("node-1")
            .is_some_and(|np| np.spec.desired_mode.is_none() && np.spec.policy.is_some())
    );
}

#[test]
fn soak_holds_the_next_wave() {
    let spec = json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"waves": [{"name": "canary", "nodes": 1, "soakSeconds": 60}, {"name": "rest", "nodes": 1}]}});
    let mut sim = Sim::new(vec![policy("p", spec)], 3, IPT);
    sim.step();
    sim.agents();
    sim.step();
    assert_eq!(sim.wave_states("p"), [WaveState::Soaking, WaveState::Pending]);
    assert!(sim.switching().is_empty());
    assert!(sim.pp("p").requeue_after <= std::time::Duration::from_secs(61));
    assert!(
        sim.condition("p", "Progressing").2.contains("soaks"),
        "{:?}",
        sim.condition("p", "Progressing")
    );
    sim.now = t0().checked_add(SignedDuration::from_secs(30)).unwrap();
    sim.step();
    assert_eq!(sim.wave_states("p"), [WaveState::Soaking, WaveState::Pending]);
    assert!(sim.switching().is_empty());
    sim.now = t0().checked_add(SignedDuration::from_secs(61)).unwrap();
    sim.step();
    assert_eq!(
        sim.wave_states("p"),
        [WaveState::Completed, WaveState::Progressing]
    );
    assert_eq!(sim.switching().len(), 1);
}

#[test]
fn approval_is_bound_to_the_generation() {
    let spec = json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"waves": [{"name": "canary", "nodes": 1, "requireApproval": true}, {"name": "rest", "nodes": 1}]}});
    let mut p = policy("p", spec);
    p.generation = 4;
    let mut sim = Sim::new(vec![p], 3, IPT);
    // (approval annotation, admitted?)
    let cases = [
        (None, false),
        (Some("3"), false),
        (Some("x"), false),
        (Some("4"), true),
    ];
    for (value, admitted) in cases {
        match value {
            Some(v) => sim.policies[0].approvals.insert("canary".into(), v.into()),
            None => sim.policies[0].approvals.remove("canary"),
        };
        sim.step();
        assert_eq!(!sim.switching().is_empty(), admitted, "approval {value:?}");
        if !admitted {
            assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::AwaitingApproval));
            assert_eq!(sim.wave_states("p")[0], WaveState::AwaitingApproval);
            let msg = sim.condition("p", "Paused").2;
            assert!(msg.contains("wave canary waits for approval: kubectl annotate --overwrite proxypolicy p approve.switchyard.dev/canary=4"), "{msg}");
        }
    }
    // "x" is not a generation: reported, not silently ignored.
    assert_eq!(
        sim.event_reasons(),
        [
            EventReason::Paused,
            EventReason::UnknownAnnotations,
            EventReason::WaveStarted
        ]
    );
}

#[test]
fn an_empty_wave_does_not_skip_its_approval() {
    // The canary's selector matches no node (a typo): the rollout waits for its approval.
    let spec = json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"waves": [
        {"name": "canary", "nodeSelector": {"matchLabels": {"canray": "true"}}, "requireApproval": true},
        {"name": "rest", "nodes": "100%"}]}});
    let mut sim = Sim::new(vec![policy("p", spec)], 3, IPT);
    sim.step();
    assert!(sim.switching().is_empty());
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::AwaitingApproval));
    let msg = sim.condition("p", "Paused").2;
    assert!(msg.contains("the wave has no node"), "{msg}");
    sim.policies[0].approvals.insert("canary".into(), "1".into());
    sim.step();
    assert!(!sim.switching().is_empty());
}

#[test]
fn unusable_values_hold_the_rollout_with_a_condition() {
    let cases = [
        (
            json!({"maxUnavailable": "2147483648"}),
            "spec.rollout.maxUnavailable is \"2147483648\"",
        ),
        (
            json!({"waves": [{"name": "a", "nodes": "3000000000"}]}),
            "spec.rollout.waves[0].nodes is \"3000000000\"",
        ),
        (
            json!({"waves": [{"name": "a", "nodeSelector": {"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["1"]}]}}]}),
            "spec.rollout.waves[0].nodeSelector.matchExpressions[0].operator \"Gt\"",
        ),
    ];
    for (rollout, needle) in cases {
        let spec = json!({"nodeSelector": {}, "mode": "nftables", "rollout": rollout});
        let mut sim = Sim::new(vec![policy("p", spec)], 2, IPT);
        sim.step();
        assert!(sim.switching().is_empty(), "{needle}");
        let (status, reason, msg) = sim.condition("p", "InvalidSpec");
        assert_eq!((status.as_str(), reason.as_str()), ("True", "InvalidSpec"));
        assert!(msg.contains(needle), "{msg}");
        assert!(sim.event_reasons().contains(&EventReason::InvalidSpec));
    }
}

#[test]
fn a_policy_named_too_long_for_a_label_governs_no_node() {
    let spec = json!({"nodeSelector": {}, "mode": "nftables", "priority": 10});
    let long = "l".repeat(64);
    let mut sim = Sim::new(
        vec![
            policy(&long, spec.clone()),
            policy("short", json!({"nodeSelector": {}, "mode": "nftables"})),
        ],
        2,
        IPT,
    );
    sim.step();
    assert_eq!(sim.pp(&long).status.target_nodes, 0);
    assert_eq!(sim.pp("short").status.target_nodes, 2);
    assert_eq!(sim.condition(&long, "InvalidSpec").0, "True");
}

#[test]
fn unknown_annotations_are_reported() {
    let spec = json!({"nodeSelector": {}, "mode": "nftables"});
    let mut p = policy("p", spec);
    p.rollback = Some("now".into());
    p.approvals.insert("nope".into(), "1".into());
    p.annotations.push("switchyard.dev/pause".into());
    let mut sim = Sim::new(vec![p], 2, IPT);
    sim.step();
    let (status, _, msg) = sim.condition("p", "UnknownAnnotations");
    assert_eq!(status, "True");
    for needle in [
        "approve.switchyard.dev/nope names no wave",
        "switchyard.dev/rollback=\"now\" is not a generation",
        "switchyard.dev/pause is not an annotation",
    ] {
        assert!(msg.contains(needle), "{needle}: {msg}");
    }
}

#[test]
fn maintenance_window_gates_starts() {
    // T0 is Monday 12:00 UTC. (window, admitted?)
    let cases = [
        (json!({"start": "11:00", "end": "13:00"}), true),
        (json!({"start": "13:00", "end": "14:00"}), false),
        (json!({"start": "11:00", "end": "13:00", "days": ["Tue"]}), false),
        (
            json!({"start": "12:30", "end": "13:30", "timeZone": "Europe/Berlin"}),
            true,
        ),
        (
            json!({"start": "13:30", "end": "14:30", "timeZone": "Europe/Berlin"}),
            false,
        ),
        (
            json!({"start": "11:00", "end": "13:00", "timeZone": "Nowhere/Atlantis"}),
            false,
        ),
    ];
    for (i, (window, admitted)) in cases.into_iter().enumerate() {
        let p = policy(
            "p",
            json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"window": window}}),
        );
        let mut sim = Sim::new(vec![p], 2, IPT);
        sim.step();
        assert_eq!(!sim.switching().is_empty(), admitted, "case {i}");
        if !admitted && i == 5 {
            // An unknown time zone is reported at once, not when the window gate is reached.
            assert_eq!(sim.condition("p", "Paused").1, "InvalidSpec");
            assert!(sim.condition("p", "InvalidSpec").2.contains("Nowhere/Atlantis"));
        } else if !admitted {
            assert_eq!(
                sim.pp("p").status.phase,
                Some(PolicyPhase::WaitingForWindow),
                "case {i}"
            );
            assert_eq!(sim.condition("p", "Paused").1, "OutsideWindow");
        }
    }
}

#[test]
fn failure_with_pause_stops_later_waves() {
    let mut sim = Sim::new(
        vec![policy("p", three_waves(json!({"maxUnavailable": 3})))],
        6,
        IPT,
    );
    sim.step();
    let canary = sim.switching();
    assert_eq!(canary.len(), 1);
    sim.failing.insert(canary[0].clone());
    sim.agents();
    for _ in 0..3 {
        sim.step();
        sim.agents();
    }
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Degraded));
    assert_eq!(pp.status.failed_nodes, 1);
    assert_eq!(
        sim.wave_states("p"),
        [WaveState::Failed, WaveState::Pending, WaveState::Pending]
    );
    assert!(sim.switching().is_empty());
    assert_eq!(
        sim.active(&canary[0]),
        Some(IPT),
        "the agent rolled the node back itself"
    );
    assert!(
        sim.nodes.iter().all(|n| sim.active(&n.name) == Some(IPT)),
        "later waves never started"
    );
    let (s, reason, msg) = sim.condition("p", "Degraded");
    assert_eq!((s.as_str(), reason.as_str()), ("True", "FailureBudgetSpent"));
    assert!(
        msg.contains(&canary[0])
            && msg.contains("no endpoint answered")
            && msg.contains("later waves will not start"),
        "{msg}"
    );
    assert_eq!(sim.condition("p", "Paused").1, "FailureBudgetSpent");
    let reasons = sim.event_reasons();
    assert!(
        reasons.contains(&EventReason::NodeSwitchFailed) && reasons.contains(&EventReason::Paused),
        "{reasons:?}"
    );
    assert_eq!(
        reasons
            .iter()
            .filter(|r| **r == EventReason::NodeSwitchFailed)
            .count(),
        1
    );

    // A new generation retries the failed node with a new token.
    sim.failing.clear();
    sim.policies[0].generation = 2;
    sim.step();
    let np = &sim.proxies[&canary[0]];
    assert_eq!(np.spec.rollout_token.as_deref(), Some("p-g2-nftables"));
    for _ in 0..20 {
        sim.agents();
        sim.step();
    }
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::Ready));
}

#[test]
fn failures_within_budget_continue() {
    let mut sim = Sim::new(vec![policy("p", three_waves(json!({"maxFailures": 1})))], 6, IPT);
    sim.step();
    sim.failing.insert(sim.switching()[0].clone());
    for _ in 0..20 {
        sim.agents();
        sim.step();
    }
    let pp = sim.pp("p");
    assert_eq!((pp.status.failed_nodes, pp.status.healthy_nodes), (1, 5));
    assert_eq!(
        pp.status.phase,
        Some(PolicyPhase::Degraded),
        "every wave ran; the failed node is reported"
    );
    assert_eq!(sim.condition("p", "Degraded").1, "NodesFailed");
    assert_eq!(sim.condition("p", "Ready").0, "False");
    assert!(sim.wave_states("p").iter().all(|s| *s == WaveState::Completed));
}

#[test]
fn failure_with_rollback_returns_switched_nodes() {
    let spec = json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"failurePolicy": "rollback", "maxUnavailable": 2,
        "waves": [{"name": "canary", "nodes": 1}, {"name": "half", "nodes": 2}, {"name": "rest", "nodes": 1}]}});
    let mut sim = Sim::new(vec![policy("p", spec)], 5, IPT);
    sim.step();
    sim.agents();
    sim.step(); // canary done, half admits two
    let half = sim.switching();
    assert_eq!(half.len(), 2);
    sim.failing.insert(half[0].clone());
    sim.agents();
    sim.step();
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::RollingBack));
    let rolled: Vec<&NodeWrite> = pp
        .writes
        .iter()
        .filter(|w| w.spec.rollout_token.as_deref() == Some("p-g1-rollback-iptables"))
        .collect();
    assert_eq!(
        rolled.len(),
        2,
        "the canary and the healthy half node go back: {:?}",
        pp.writes
    );
    assert!(rolled.iter().all(|w| w.spec.desired_mode == Some(IPT)));
    assert!(sim.event_reasons().contains(&EventReason::RolledBack));
    sim.agents();
    sim.step();
    sim.step();
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Degraded));
    assert!(sim.nodes.iter().all(|n| sim.active(&n.name) == Some(IPT)));
    assert_eq!(
        sim.wave_states("p"),
        [WaveState::RolledBack, WaveState::RolledBack, WaveState::Pending]
    );
    assert!(pp.writes.is_empty(), "settled: {:?}", pp.writes);
}

#[test]
fn conflicts_resolve_by_priority_then_name() {
    // (priority of a, priority of b, winner)
    let cases = [(0, 0, "a"), (0, 5, "b"), (5, 0, "a"), (-1, -2, "a")];
    for (pa, pb, winner) in cases {
        let a = policy(
            "a",
            json!({"nodeSelector": {}, "priority": pa, "mode": "nftables"}),
        );
        let b = policy(
            "b",
            json!({"nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}, "priority": pb, "mode": "iptables", "rollout": {"maxUnavailable": "100%"}}),
        );
        let mut sim = Sim::new(vec![a, b], 2, ProxyMode::Ipvs);
        sim.nodes.push(node("node-x", &[("pool", "other")]));
        sim.proxies.insert(
            "node-x".into(),
            NodeProxyInput {
                name: "node-x".into(),
                spec: Default::default(),
                status: Some(status(IPVS, &[IPT, IPVS, NFT])),
            },
        );
        for np in sim.proxies.values_mut() {
            if let Some(st) = np.status.as_mut() {
                st.capabilities = Some(Capabilities {
                    supported_modes: vec![IPT, IPVS, NFT],
                    ..Default::default()
                });
            }
        }
        for _ in 0..6 {
            sim.step();
            sim.agents();
        }
        let loser = if winner == "a" { "b" } else { "a" };
        let (s, _, msg) = sim.condition(loser, "Conflict");
        assert_eq!(s, "True", "{pa} {pb}");
        assert!(
            msg.contains("node(s) node-1, node-2 are governed by proxypolicy ") && msg.contains(winner),
            "{msg}"
        );
        assert_eq!(sim.condition(winner, "Conflict").0, "False");
        let want = if winner == "a" { NFT } else { IPT };
        assert_eq!(sim.active("node-1"), Some(want), "{pa} {pb}");
        assert_eq!(sim.active("node-2"), Some(want));
        assert_eq!(sim.active("node-x"), Some(NFT), "only a selects node-x");
        assert!(sim.event_reasons().contains(&EventReason::Conflict));
        assert_eq!(
            sim.pp(loser).status.target_nodes,
            if loser == "a" { 1 } else { 0 }
        );
    }
}

#[test]
fn compatibility_table() {
    // (mode, fallback, supported modes, expected state, expected target)
    let cases: Vec<(&str, Option<&str>, Vec<ProxyMode>, NodeState, Option<ProxyMode>)> = vec![
        ("ipvs", None, vec![IPT, NFT], NodeState::Incompatible, None),
        (
            "ipvs",
            Some("skip"),
            vec![IPT, NFT],
            NodeState::Incompatible,
            None,
        ),
        (
            "ipvs",
            Some("nftables"),
            vec![IPT, NFT],
            NodeState::Switching,
            Some(NFT),
        ),
        ("ipvs", Some("nftables"), vec![IPT], NodeState::Incompatible, None),
        ("ipvs", None, vec![IPT, IPVS], NodeState::Switching, Some(IPVS)),
        (
            "nftables",
            Some("ipvs"),
            vec![IPT, IPVS],
            NodeState::Switching,
            Some(IPVS),
        ),
        // Every node can hand over to another proxy, listed or not (older agents do not list it).
        ("external", None, vec![IPT, NFT], NodeState::Switching, Some(EXT)),
        ("external", None, vec![], NodeState::Switching, Some(EXT)),
        (
            "ipvs",
            Some("external"),
            vec![IPT],
            NodeState::Switching,
            Some(EXT),
        ),
    ];
    for (i, (mode, fallback, supported, state, target)) in cases.into_iter().enumerate() {
        let mut spec = json!({"nodeSelector": {}, "mode": mode});
        if let Some(f) = fallback {
            spec["fallback"] = json!(f);
        }
        let mut sim = Sim::new(vec![policy("p", spec)], 1, IPT);
        if let Some(st) = sim.proxies.get_mut("node-1").and_then(|np| np.status.as_mut()) {
            st.capabilities = Some(Capabilities {
                supported_modes: supported,
                ..Default::default()
            });
        }
        sim.step();
        let n = &sim.pp("p").nodes[0];
        assert_eq!((n.state, n.target), (state, target), "case {i}");
        let st = &sim.pp("p").status;
        if state == NodeState::Incompatible {
            assert_eq!(st.incompatible_nodes, 1, "case {i}");
            assert_eq!(st.phase, Some(PolicyPhase::Ready), "case {i}");
            assert!(sim.condition("p", "Ready").2.contains("incompatible"), "case {i}");
            assert!(
                sim.proxies["node-1"].spec.desired_mode.is_none(),
                "case {i}: left alone"
            );
            assert!(
                n.reason.as_deref().unwrap_or_default().contains("cannot run"),
                "case {i}"
            );
        }
        let ipvs = sim.condition("p", "IPVSDeprecated").0;
        assert_eq!(
            ipvs == "True",
            mode == "ipvs" || fallback == Some("ipvs"),
            "case {i}"
        );
    }
}

#[test]
fn nodes_already_on_the_mode_need_no_switch() {
    let mut sim = Sim::new(vec![policy("p", three_waves(json!({})))], 4, NFT);
    sim.step();
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Ready));
    assert_eq!(pp.status.healthy_nodes, 4);
    assert!(pp.writes.iter().all(
        |w| w.spec.desired_mode == Some(NFT) && w.spec.rollout_token.as_deref() == Some("p-g1-nftables")
    ));
    assert_eq!(sim.wave_states("p"), [WaveState::Completed; 3]);
}

#[test]
fn a_new_leader_continues_without_rerunning_finished_waves() {
    let mut sim = Sim::new(vec![policy("p", three_waves(json!({})))], 6, IPT);
    // Canary done, half in progress.
    for _ in 0..3 {
        sim.step();
        sim.agents();
    }
    sim.step();
    let status = sim.pp("p").status.clone();
    assert_eq!(status.waves[0].state, WaveState::Completed);
    let tokens: Vec<Option<String>> = sim
        .proxies
        .values()
        .map(|np| np.spec.rollout_token.clone())
        .collect();
    // A "new leader" plans from the objects alone (status as stored): no writes, no events.
    let again = sim.plan();
    let pp = again.policy("p").unwrap();
    assert!(pp.writes.is_empty(), "{:?}", pp.writes);
    assert!(pp.events.is_empty(), "{:?}", pp.events);
    assert_eq!(pp.status, status);
    // Even without the previous status, finished waves stay finished and tokens stay.
    sim.policies[0].status = None;
    let fresh = sim.plan();
    let pp = fresh.policy("p").unwrap();
    assert_eq!(pp.status.waves[0].state, WaveState::Completed);
    assert!(pp.writes.is_empty(), "{:?}", pp.writes);
    assert_eq!(
        tokens,
        sim.proxies
            .values()
            .map(|np| np.spec.rollout_token.clone())
            .collect::<Vec<_>>()
    );
    assert!(
        !pp.events
            .iter()
            .any(|e| e.reason == EventReason::WaveStarted && e.note.contains("canary"))
    );
}

#[test]
fn a_node_joining_later_does_not_reshuffle_the_plan() {
    let mut sim = Sim::new(vec![policy("p", three_waves(json!({"paused": true})))], 6, IPT);
    sim.step();
    let before: Vec<Vec<String>> = sim.pp("p").status.waves.iter().map(|w| w.nodes.clone()).collect();
    sim.nodes.push(node("node-7", &[("pool", "a")]));
    sim.proxies.insert(
        "node-7".into(),
        NodeProxyInput {
            name: "node-7".into(),
            spec: Default::default(),
            status: Some(status(IPT, BOTH)),
        },
    );
    sim.step();
    let after: Vec<Vec<String>> = sim.pp("p").status.waves.iter().map(|w| w.nodes.clone()).collect();
    for (b, a) in before.iter().zip(&after) {
        assert!(b.iter().all(|n| a.contains(n)), "{before:?} -> {after:?}");
    }
    assert_eq!(after.iter().map(Vec::len).sum::<usize>(), 7);
}

#[test]
fn empty_selection_is_pending() {
    let p = policy(
        "p",
        json!({"nodeSelector": {"matchLabels": {"pool": "none"}}, "mode": "nftables"}),
    );
    let mut sim = Sim::new(vec![p], 2, IPT);
    sim.step();
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::Pending));
    assert!(sim.pp("p").writes.is_empty());
}

#[test]
fn manual_rollback_returns_switched_nodes_until_the_spec_changes() {
    let spec = json!({"nodeSelector": {}, "mode": "nftables", "rollout": {"maxUnavailable": 2,
        "waves": [{"name": "canary", "nodes": 1}, {"name": "rest", "nodes": "100%"}]}});
    let mut sim = Sim::new(vec![policy("p", spec)], 4, IPT);
    sim.step();
    sim.agents();
    sim.step(); // canary done, rest admits two
    sim.agents();
    sim.step();
    let switched: Vec<String> = sim
        .nodes
        .iter()
        .filter(|n| sim.active(&n.name) == Some(NFT))
        .map(|n| n.name.clone())
        .collect();
    assert_eq!(switched.len(), 3, "canary and two of the rest switched");
    // A stale rollback annotation (another generation) is ignored.
    sim.policies[0].rollback = Some("7".into());
    sim.step();
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::Progressing));
    // Switched or switching now: every node asked for nftables.
    let released: Vec<String> = sim
        .proxies
        .values()
        .filter(|np| np.spec.desired_mode == Some(NFT))
        .map(|np| np.name.clone())
        .collect();
    assert_eq!(released.len(), 4, "the last node is switching");
    // The annotation for the current generation rolls the switched nodes back.
    sim.policies[0].rollback = Some("1".into());
    sim.step();
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::RollingBack), "{:?}", pp.status);
    assert!(
        pp.status
            .conditions
            .iter()
            .any(|c| c.type_ == "Progressing" && c.reason == "RollingBack")
    );
    let rolled: BTreeSet<&str> = pp
        .writes
        .iter()
        .filter(|w| w.spec.rollout_token.as_deref() == Some("p-g1-rollback-iptables"))
        .map(|w| w.node.as_str())
        .collect();
    assert_eq!(
        rolled,
        released.iter().map(String::as_str).collect(),
        "{:?}",
        pp.writes
    );
    assert!(
        pp.writes.iter().all(|w| w.spec.desired_mode == Some(IPT)),
        "nothing new switches"
    );
    assert!(sim.event_reasons().contains(&EventReason::RolledBack));
    sim.agents();
    sim.step();
    sim.step();
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Paused), "{:?}", pp.status);
    let (status, reason, message) = sim.condition("p", "Paused");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "RollbackRequested"),
        "{message}"
    );
    assert_eq!(sim.condition("p", "Degraded").0, "False");
    assert!(sim.nodes.iter().all(|n| sim.active(&n.name) == Some(IPT)));
    assert!(sim.switching().is_empty());
    assert!(pp.writes.is_empty(), "settled: {:?}", pp.writes);
    // A new generation makes the annotation stale: the rollout starts again.
    sim.policies[0].generation = 2;
    sim.step();
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::Progressing));
    assert!(!sim.switching().is_empty());
}

#[test]
fn external_rolls_out_in_waves_like_any_mode_and_back() {
    let mut spec = three_waves(json!({}));
    spec["mode"] = json!("external");
    let mut sim = Sim::new(vec![policy("p", spec)], 4, NFT);
    sim.step();
    assert_eq!(sim.switching().len(), 1, "the canary alone hands over first");
    for _ in 0..6 {
        sim.agents();
        sim.step();
    }
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Ready), "{:?}", pp.status);
    assert!(sim.nodes.iter().all(|n| sim.active(&n.name) == Some(EXT)));
    assert_eq!(sim.wave_states("p"), [WaveState::Completed; 3]);
    let proxies: Vec<NodeProxyInput> = sim.proxies.values().cloned().collect();
    let labels = labels::label_changes(&sim.nodes, &proxies);
    assert_eq!(labels.len(), 4, "every handed-over node is labelled");
    assert!(labels.iter().all(|c| c.external));

    // And taken over again: a new generation asks for nftables.
    sim.policies[0].spec.mode = NFT;
    sim.policies[0].generation = 2;
    sim.step();
    assert_eq!(sim.switching().len(), 1, "the canary takes over first");
    for _ in 0..6 {
        sim.agents();
        sim.step();
    }
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::Ready));
    assert!(sim.nodes.iter().all(|n| sim.active(&n.name) == Some(NFT)));
}

/// A policy `p` over the pool running nftables in two waves of 2 (the first soaks 60 s), with
/// `spec.proxy` = `proxy`.
fn settings_policy(proxy: serde_json::Value, rollout: serde_json::Value) -> PolicyInput {
    let mut spec = json!({
        "nodeSelector": {"matchLabels": {"pool": "a"}},
        "mode": "nftables",
        "rollout": {"waves": [{"name": "first", "nodes": 2, "soakSeconds": 60}, {"name": "rest", "nodes": "100%"}]},
        "proxy": proxy,
    });
    for (k, v) in rollout.as_object().unwrap() {
        spec["rollout"][k] = v.clone();
    }
    policy("p", spec)
}

/// The policy's next generation with `edit` applied to its spec (as JSON).
fn next_generation(sim: &mut Sim, edit: impl FnOnce(&mut serde_json::Value)) {
    let p = &mut sim.policies[0];
    let mut spec = serde_json::to_value(&p.spec).unwrap();
    edit(&mut spec);
    p.spec = serde_json::from_value(spec).unwrap();
    p.generation += 1;
}

/// Steps and answers, a minute apart (soaks end), until nothing changes any more (bounded).
fn run(sim: &mut Sim) {
    for _ in 0..10 {
        sim.step();
        sim.agents();
        sim.now += SignedDuration::from_secs(61);
    }
    sim.step();
}

fn masquerade_all(sim: &Sim, node: &str) -> Option<bool> {
    sim.proxies[node]
        .spec
        .proxy
        .as_ref()
        .and_then(|p| p.masquerade_all)
}

fn settings_generations(sim: &Sim) -> Vec<Option<i64>> {
    sim.pp("p").nodes.iter().map(|n| n.settings_generation).collect()
}

#[test]
fn a_settings_change_rolls_out_in_waves_and_a_pause_keeps_the_old_settings() {
    let mut sim = Sim::new(
        vec![settings_policy(json!({"masqueradeAll": false}), json!({}))],
        4,
        NFT,
    );
    run(&mut sim);
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::Ready));
    assert_eq!(sim.pp("p").status.settings_updated_nodes, 4);
    let first_tokens: Vec<Option<String>> = sim
        .proxies
        .values()
        .map(|np| np.spec.rollout_token.clone())
        .collect();
    assert!(
        first_tokens
            .iter()
            .all(|t| t.as_deref() == Some("p-g1-settings-nftables")),
        "{first_tokens:?}"
    );

    // Generation 2: only the settings change. The first wave is admitted, the rest keeps its spec.
    next_generation(&mut sim, |s| s["proxy"]["masqueradeAll"] = json!(true));
    let before: BTreeMap<String, _> = sim
        .proxies
        .iter()
        .map(|(n, np)| (n.clone(), np.spec.clone()))
        .collect();
    sim.step();
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Progressing));
    let first: Vec<String> = pp.status.waves[0].nodes.clone();
    let rest: Vec<String> = pp.status.waves[1].nodes.clone();
    // maxUnavailable 1: one node of the wave at a time.
    assert_eq!(pp.writes.len(), 1, "{:?}", pp.writes);
    for w in &pp.writes {
        assert!(first.contains(&w.node), "{w:?}");
        assert_eq!(w.spec.rollout_token.as_deref(), Some("p-g2-settings-nftables"));
        assert_eq!(w.spec.desired_mode, Some(NFT));
    }
    for n in &rest {
        assert_eq!(sim.proxies[n].spec, before[n], "{n} waits with its spec");
    }
    // Switching until its agent answers: the wave waits for it.
    sim.step();
    assert!(sim.pp("p").writes.is_empty(), "{:?}", sim.pp("p").writes);
    assert_eq!(sim.pp("p").status.waves[0].state, WaveState::Progressing);
    for _ in 0..4 {
        sim.agents();
        sim.step();
    }
    assert_eq!(sim.pp("p").status.waves[0].state, WaveState::Soaking);

    // Paused (generation 3, settings unchanged) while the first wave soaks: the rest keeps the
    // old settings, also once the soak is over.
    next_generation(&mut sim, |s| s["rollout"]["paused"] = json!(true));
    sim.now += SignedDuration::from_secs(120);
    run(&mut sim);
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Paused));
    assert_eq!(pp.status.settings_updated_nodes, 2);
    for n in &first {
        assert_eq!(masquerade_all(&sim, n), Some(true), "{n}");
        assert_eq!(
            sim.proxies[n].spec.rollout_token.as_deref(),
            Some("p-g2-settings-nftables")
        );
    }
    for n in &rest {
        assert_eq!(masquerade_all(&sim, n), Some(false), "{n}");
        assert_eq!(
            sim.proxies[n].spec.rollout_token.as_deref(),
            Some("p-g1-settings-nftables")
        );
    }
    // Which node runs which generation's settings: the paused ones generation 1's.
    let by_node: BTreeMap<String, Option<i64>> = pp
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.settings_generation))
        .collect();
    for n in &first {
        assert_eq!(
            by_node[n],
            Some(3),
            "{n}: generation 3's settings are generation 2's"
        );
    }
    for n in &rest {
        assert_eq!(by_node[n], Some(1), "{n}");
    }

    // Resumed: the rest switches its settings, no node switches its mode.
    next_generation(&mut sim, |s| s["rollout"]["paused"] = json!(false));
    run(&mut sim);
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Ready));
    assert_eq!(pp.status.settings_updated_nodes, 4);
    assert_eq!(settings_generations(&sim), [Some(4); 4]);
    for n in &rest {
        assert_eq!(masquerade_all(&sim, n), Some(true), "{n}");
        assert_eq!(
            sim.proxies[n].spec.rollout_token.as_deref(),
            Some("p-g4-settings-nftables")
        );
    }
    assert!(sim.proxies.keys().all(|n| sim.active(n) == Some(NFT)));
}

#[test]
fn a_generation_without_a_settings_change_re_rolls_nothing() {
    let mut sim = Sim::new(
        vec![settings_policy(json!({"masqueradeAll": true}), json!({}))],
        4,
        IPT,
    );
    run(&mut sim);
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::Ready));
    let tokens: Vec<Option<String>> = sim
        .proxies
        .values()
        .map(|np| np.spec.rollout_token.clone())
        .collect();
    // The mode and the settings came in one switch.
    assert!(
        tokens.iter().all(|t| t.as_deref() == Some("p-g1-nftables")),
        "{tokens:?}"
    );
    next_generation(&mut sim, |s| {
        s["rollout"]["waves"] = json!([{"name": "all", "nodes": "100%"}])
    });
    sim.step();
    for w in &sim.pp("p").writes {
        assert_eq!(w.spec.rollout_token.as_deref(), Some("p-g1-nftables"), "{w:?}");
        assert_eq!(w.spec.policy.as_ref().and_then(|r| r.generation), Some(2));
    }
    run(&mut sim);
    let pp = sim.pp("p");
    assert_eq!(pp.status.phase, Some(PolicyPhase::Ready));
    assert_eq!(pp.status.settings_updated_nodes, 4);
    let after: Vec<Option<String>> = sim
        .proxies
        .values()
        .map(|np| np.spec.rollout_token.clone())
        .collect();
    assert_eq!(after, tokens);
}

#[test]
fn a_failed_settings_switch_keeps_its_answer_and_halts_the_wave() {
    let mut sim = Sim::new(
        vec![settings_policy(json!({"masqueradeAll": false}), json!({}))],
        4,
        NFT,
    );
    run(&mut sim);
    next_generation(&mut sim, |s| s["proxy"]["masqueradeAll"] = json!(true));
    sim.step();
    let admitted: Vec<String> = sim.pp("p").writes.iter().map(|w| w.node.clone()).collect();
    sim.failing.insert(admitted[0].clone());
    run(&mut sim);
    let pp = sim.pp("p");
    assert_eq!(pp.status.failed_nodes, 1);
    assert_eq!(pp.status.phase, Some(PolicyPhase::Degraded));
    assert_eq!(pp.status.settings_updated_nodes, 0);
    let failed = pp.nodes.iter().find(|n| n.name == admitted[0]).unwrap();
    assert_eq!(
        (failed.state, failed.settings_generation),
        (NodeState::Failed, None)
    );
    // The answered spec stays (its agent keeps the settings it put back); the rest is not started.
    assert_eq!(
        sim.proxies[&admitted[0]].spec.rollout_token.as_deref(),
        Some("p-g2-settings-nftables")
    );
    for n in &pp.status.waves[1].nodes {
        assert_eq!(masquerade_all(&sim, n), Some(false), "{n}");
    }
    assert!(
        sim.event_reasons().contains(&EventReason::NodeSwitchFailed),
        "{:?}",
        sim.event_reasons()
    );

    // A later generation (settings unchanged) retries the failed node's settings switch.
    sim.failing.clear();
    next_generation(&mut sim, |s| s["rollout"]["maxFailures"] = json!(1));
    sim.step();
    let retry = sim
        .pp("p")
        .nodes
        .iter()
        .find(|n| n.name == admitted[0])
        .unwrap()
        .clone();
    assert_eq!(
        (retry.state, retry.settings_generation),
        (NodeState::Switching, None)
    );
    assert_eq!(
        sim.proxies[&admitted[0]].spec.rollout_token.as_deref(),
        Some("p-g3-settings-nftables")
    );
    run(&mut sim);
    assert_eq!(sim.pp("p").status.phase, Some(PolicyPhase::Ready));
    assert_eq!(sim.pp("p").status.settings_updated_nodes, 4);
}
