//! Table and scenario tests of [`super`]: which policies revert, which nodes a revert covers,
//! a deleted policy's revert walked to its end (budget, in-flight switch, health gate answers,
//! timeout) and nodes leaving a live policy's pool.

use std::collections::BTreeMap;

use switchyard_crds::v1alpha1::{
    Capabilities, NodeProxySpec, NodeProxyStatus, PolicyReference, SwitchResult,
};

use super::*;

const IPT: ProxyMode = ProxyMode::Iptables;
const NFT: ProxyMode = ProxyMode::Nftables;

fn t(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn policy(extra: serde_json::Value, generation: i64) -> PolicyInput {
    let mut spec = serde_json::json!({
        "nodeSelector": {"matchLabels": {"pool": "a"}},
        "mode": "nftables",
        "rollout": {"maxUnavailable": 1},
        "healthGate": {"minHealthySeconds": 3},
        "proxy": {"masqueradeAll": true},
    });
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    PolicyInput {
        name: "pool".into(),
        uid: "uid-pool".into(),
        generation,
        spec: serde_json::from_value(spec).unwrap(),
        approvals: BTreeMap::new(),
        rollback: None,
        annotations: Vec::new(),
        status: None,
    }
}

fn reverting(generation: i64) -> PolicyInput {
    policy(
        serde_json::json!({"onRelease": "Revert", "revertMode": "iptables", "revertTimeoutSeconds": 600}),
        generation,
    )
}

fn node(name: &str, pool: &str) -> NodeInput {
    NodeInput {
        name: name.into(),
        uid: format!("uid-{name}"),
        labels: BTreeMap::from([("pool".to_owned(), pool.to_owned())]),
    }
}

/// A NodeProxy whose spec names `pool` (generation 1) asking for `desired` with `token`, and
/// whose agent runs `active` in `phase`, last answering `last` (token, from, result).
fn np(
    name: &str,
    desired: Option<ProxyMode>,
    token: Option<&str>,
    active: ProxyMode,
    phase: SwitchPhase,
    last: Option<(&str, ProxyMode, ProxyMode, &str)>,
) -> NodeProxyInput {
    NodeProxyInput {
        name: name.into(),
        spec: NodeProxySpec {
            desired_mode: desired,
            // A held node keeps the settings it ran before the policy (here: the agent's own).
            proxy: desired
                .map(|_| serde_json::from_value(serde_json::json!({"masqueradeAll": true})).unwrap()),
            health_gate: None,
            policy: Some(PolicyReference {
                name: "pool".into(),
                uid: Some("uid-pool".into()),
                generation: Some(1),
            }),
            rollout_token: token.map(str::to_owned),
        },
        status: Some(NodeProxyStatus {
            capabilities: Some(Capabilities {
                supported_modes: vec![IPT, NFT],
                ..Default::default()
            }),
            active_mode: Some(active),
            phase: Some(phase),
            last_switch: last.map(|(tok, from, to, result)| SwitchResult {
                from: Some(from),
                to,
                result: result.into(),
                reason: None,
                rollout_token: Some(tok.into()),
                started_at: None,
                finished_at: Some(Time(t("2025-01-06T11:00:00Z"))),
            }),
            ..Default::default()
        }),
    }
}

#[test]
fn revert_mode_table() {
    let cases = [
        (serde_json::json!({}), None),
        (serde_json::json!({"onRelease": "Keep"}), None),
        (
            serde_json::json!({"onRelease": "Revert", "revertMode": "iptables"}),
            Some(IPT),
        ),
        // Stored before the schema's rules: nothing to revert to.
        (serde_json::json!({"onRelease": "Revert"}), None),
    ];
    for (extra, want) in cases {
        assert_eq!(revert_mode(&policy(extra.clone(), 1).spec), want, "{extra}");
    }
    assert_eq!(
        revert_timeout(&policy(serde_json::json!({}), 1).spec),
        Duration::from_secs(1800)
    );
    assert_eq!(revert_timeout(&reverting(1).spec), Duration::from_secs(600));
}

#[test]
fn members_are_the_nodes_naming_the_policy_that_no_live_policy_selects() {
    let nodes = [
        node("mine", "a"),
        node("left", "b"),
        node("taken", "c"),
        node("other", "a"),
    ];
    let mut other = np("other", None, None, IPT, SwitchPhase::Active, None);
    other.spec.policy = Some(PolicyReference {
        name: "else".into(),
        uid: Some("uid-else".into()),
        generation: Some(1),
    });
    let proxies = [
        np("mine", None, None, IPT, SwitchPhase::Active, None),
        np("left", None, None, IPT, SwitchPhase::Active, None),
        np("taken", None, None, IPT, SwitchPhase::Active, None),
        other,
    ];
    let p = reverting(2);
    let mut c = policy(serde_json::json!({}), 1);
    c.name = "c".into();
    c.spec.node_selector = serde_json::from_value(serde_json::json!({"matchLabels": {"pool": "c"}})).unwrap();
    let names = |live: &[PolicyInput]| -> Vec<String> {
        members(&p, live, &nodes, &proxies)
            .iter()
            .map(|n| n.name.clone())
            .collect()
    };
    // Deleted: every node naming it, except one another policy selects.
    assert_eq!(names(std::slice::from_ref(&c)), ["mine", "left"]);
    // Live: only the ones its own selector no longer selects.
    assert_eq!(names(&[p.clone(), c]), ["left"]);
}

/// Applies the plan's writes to the proxies (as the operator does).
fn apply(proxies: &mut [NodeProxyInput], r: &RevertPlan) {
    for w in &r.plan.writes {
        let np = proxies.iter_mut().find(|n| n.name == w.node).unwrap();
        np.spec = w.spec.clone();
    }
}

/// The agent on `name` answers its spec's token with `result`.
fn answer(proxies: &mut [NodeProxyInput], name: &str, result: &str) {
    let np = proxies.iter_mut().find(|n| n.name == name).unwrap();
    let st = np.status.as_mut().unwrap();
    let to = np.spec.desired_mode.unwrap();
    let from = st.active_mode.unwrap();
    if result == "Succeeded" {
        st.active_mode = Some(to);
    }
    st.phase = Some(SwitchPhase::Active);
    st.last_switch = Some(SwitchResult {
        from: Some(from),
        to,
        result: result.into(),
        reason: Some("test".into()),
        rollout_token: np.spec.rollout_token.clone(),
        started_at: None,
        finished_at: Some(Time(t("2025-01-06T12:00:05Z"))),
    });
}

fn desired(r: &RevertPlan) -> Vec<(String, Option<ProxyMode>, Option<String>)> {
    r.plan
        .writes
        .iter()
        .map(|w| (w.node.clone(), w.spec.desired_mode, w.spec.rollout_token.clone()))
        .collect()
}

fn reverting_reason(r: &RevertPlan) -> (String, String) {
    let c = r
        .plan
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == REVERTING)
        .unwrap();
    (c.status.clone(), c.reason.clone())
}

/// Deleted mid-rollout: `done` switched to nftables, `busy` is verifying its switch, `held`
/// never left iptables. The revert waits for `busy`'s switch, then returns the nftables nodes
/// one at a time (maxUnavailable 1) with the revert token, the gate and no `spec.proxy`; the
/// policy may go once every node is back.
#[test]
fn a_deleted_policy_reverts_its_nodes_one_at_a_time_then_is_done() {
    let nodes = [node("busy", "a"), node("done", "a"), node("held", "a")];
    let mut proxies = vec![
        np(
            "busy",
            Some(NFT),
            Some("pool-g1-nftables"),
            IPT,
            SwitchPhase::Verifying,
            None,
        ),
        np(
            "done",
            Some(NFT),
            Some("pool-g1-nftables"),
            NFT,
            SwitchPhase::Active,
            Some(("pool-g1-nftables", IPT, NFT, "Succeeded")),
        ),
        np("held", None, None, IPT, SwitchPhase::Active, None),
    ];
    let p = reverting(2);
    let (deleted, now) = (t("2025-01-06T12:00:00Z"), t("2025-01-06T12:01:00Z"));
    let r = plan_revert(&p, &[], &nodes, &proxies, deleted, now).unwrap();
    // busy switches (unavailable): nothing else may start; busy keeps its spec.
    assert!(!desired(&r).iter().any(|w| w.0 == "busy"), "{:?}", desired(&r));
    assert!(
        !desired(&r).iter().any(|w| w.0 == "done" && w.1 == Some(IPT)),
        "{:?}",
        desired(&r)
    );
    assert_eq!(r.remaining, ["busy", "done"]);
    assert_eq!(reverting_reason(&r), ("True".into(), "PolicyDeleted".into()));
    assert_eq!(r.deadline, Some(t("2025-01-06T12:10:00Z")));
    apply(&mut proxies, &r);

    // busy's switch succeeds: it runs nftables; now one nftables node reverts at a time.
    answer(&mut proxies, "busy", "Succeeded");
    let mut reverted = Vec::new();
    for _ in 0..2 {
        let r = plan_revert(&p, &[], &nodes, &proxies, deleted, now).unwrap();
        let asked: Vec<_> = desired(&r)
            .into_iter()
            .filter(|w| w.1 == Some(IPT) && w.2.as_deref() == Some("pool-g2-iptables"))
            .filter(|w| w.0 != "held")
            .collect();
        assert_eq!(asked.len(), 1, "one at a time: {:?}", desired(&r));
        let w = r.plan.writes.iter().find(|w| w.node == asked[0].0).unwrap();
        assert_eq!(w.spec.proxy, None, "the agent's own settings");
        assert_eq!(
            w.spec.health_gate,
            Some(p.spec.health_gate.clone()),
            "under the gate"
        );
        assert!(!r.done);
        apply(&mut proxies, &r);
        answer(&mut proxies, &asked[0].0, "Succeeded");
        reverted.push(asked[0].0.clone());
    }
    reverted.sort();
    assert_eq!(reverted, ["busy", "done"]);
    let r = plan_revert(&p, &[], &nodes, &proxies, deleted, now).unwrap();
    assert!(r.done && !r.timed_out, "{:?}", r.remaining);
    assert_eq!(r.settled, ["busy", "done", "held"]);
    assert_eq!(reverting_reason(&r), ("False".into(), "Reverted".into()));
}

/// A revert that fails its gate on one node (failure budget 0, pause): the others wait; past
/// the deadline the plan says timed out, naming the nodes left as they are.
#[test]
fn a_stuck_revert_times_out_and_names_the_nodes_left() {
    let nodes = [node("a1", "a"), node("a2", "a")];
    let mut proxies = vec![
        np(
            "a1",
            Some(IPT),
            Some("pool-g2-iptables"),
            NFT,
            SwitchPhase::Active,
            Some(("pool-g2-iptables", NFT, IPT, "RolledBack")),
        ),
        np(
            "a2",
            Some(NFT),
            Some("pool-g1-nftables"),
            NFT,
            SwitchPhase::Active,
            Some(("pool-g1-nftables", IPT, NFT, "Succeeded")),
        ),
    ];
    proxies[0].spec.policy.as_mut().unwrap().generation = Some(2);
    let p = reverting(2);
    let deleted = t("2025-01-06T12:00:00Z");
    let before = plan_revert(&p, &[], &nodes, &proxies, deleted, t("2025-01-06T12:05:00Z")).unwrap();
    assert!(!before.done && !before.timed_out);
    assert_eq!(before.remaining, ["a2"], "a1 failed: it keeps nftables");
    assert!(
        !desired(&before).iter().any(|w| w.0 == "a2" && w.1 == Some(IPT)),
        "the spent budget holds a2"
    );
    assert!(before.plan.requeue_after <= Duration::from_secs(300));
    let after = plan_revert(&p, &[], &nodes, &proxies, deleted, t("2025-01-06T12:10:00Z")).unwrap();
    assert!(after.timed_out && !after.done);
    let c = after
        .plan
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == REVERTING)
        .unwrap();
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "TimedOut"));
    assert!(
        c.message.contains("1 of 2 nodes not back on iptables (a2)"),
        "{}",
        c.message
    );
}

#[test]
fn keep_policies_plan_no_revert() {
    let p = policy(serde_json::json!({"onRelease": "Keep"}), 2);
    let nodes = [node("n", "a")];
    let proxies = [np(
        "n",
        Some(NFT),
        Some("pool-g1-nftables"),
        NFT,
        SwitchPhase::Active,
        None,
    )];
    let at = t("2025-01-06T12:00:00Z");
    assert!(plan_revert(&p, &[], &nodes, &proxies, at, at).is_none());
    assert!(plan_departing(&p, std::slice::from_ref(&p), &nodes, &proxies, at).is_none());
}

/// A node relabelled out of a live Revert policy's pool returns to iptables with a token of the
/// policy's generation; a departed node already on iptables is settled (to be released); the
/// pool's nodes are not the departing plan's business.
#[test]
fn departing_nodes_of_a_live_policy_revert_then_settle() {
    let nodes = [node("gone", "b"), node("stays", "a"), node("gone-ipt", "b")];
    let proxies = vec![
        np(
            "gone",
            Some(NFT),
            Some("pool-g1-nftables"),
            NFT,
            SwitchPhase::Active,
            Some(("pool-g1-nftables", IPT, NFT, "Succeeded")),
        ),
        np(
            "stays",
            Some(NFT),
            Some("pool-g1-nftables"),
            NFT,
            SwitchPhase::Active,
            Some(("pool-g1-nftables", IPT, NFT, "Succeeded")),
        ),
        np("gone-ipt", None, None, IPT, SwitchPhase::Active, None),
    ];
    let p = reverting(1);
    let at = t("2025-01-06T12:00:00Z");
    let r = plan_departing(&p, std::slice::from_ref(&p), &nodes, &proxies, at).unwrap();
    assert_eq!(r.remaining, ["gone"]);
    assert_eq!(r.settled, ["gone-ipt"]);
    assert!(
        desired(&r).contains(&("gone".into(), Some(IPT), Some("pool-g1-iptables".into()))),
        "{:?}",
        desired(&r)
    );
    assert!(!desired(&r).iter().any(|w| w.0 == "stays"));
    assert!(
        r.plan.status.conditions.iter().all(|c| c.type_ != REVERTING),
        "no deletion, no Reverting condition"
    );
}
