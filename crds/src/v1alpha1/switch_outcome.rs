//! Typed views of what an agent reports as strings in `NodeProxy.status`: the outcome of its last
//! switch ([`SwitchOutcome`], `lastSwitch.result`) and the `Healthy` condition ([`HEALTHY_CONDITION`],
//! [`HealthyReason`]).
//!
//! The wire format stays the strings the schema names (`Succeeded`, `RolledBack`, `Failed`); a
//! string outside them (an agent newer or older than the reader) decodes as `Unknown` with the text
//! kept, so one odd report never fails a typed list or watch (as with the tolerant int-or-string fields).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{NodeProxyStatus, SwitchResult};

/// Type of the condition an agent sets on its NodeProxy: True while the node runs its desired mode
/// and the last switch for the current rollout token passed its health gate.
pub const HEALTHY_CONDITION: &str = "Healthy";

/// How a mode switch ended: `lastSwitch.result`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SwitchOutcome {
    /// The new mode serves and passed its health gate.
    Succeeded,
    /// The health gate failed; the old mode serves again.
    RolledBack,
    /// The switch could not complete (and could not be rolled back cleanly).
    Failed,
    /// A string this version does not know, kept as read.
    Unknown(String),
}

impl SwitchOutcome {
    /// The string on the wire.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Succeeded => "Succeeded",
            Self::RolledBack => "RolledBack",
            Self::Failed => "Failed",
            Self::Unknown(s) => s,
        }
    }

    /// Reads a wire string; never fails (unknown strings are [`SwitchOutcome::Unknown`]).
    pub fn parse(s: &str) -> Self {
        match s {
            "Succeeded" => Self::Succeeded,
            "RolledBack" => Self::RolledBack,
            "Failed" => Self::Failed,
            other => Self::Unknown(other.to_owned()),
        }
    }

    /// The switch did not leave the node in its new mode (rolled back or failed).
    pub fn is_failure(&self) -> bool {
        matches!(self, Self::RolledBack | Self::Failed)
    }
}

impl fmt::Display for SwitchOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for SwitchOutcome {
    fn from(s: &str) -> Self {
        Self::parse(s)
    }
}

impl Serialize for SwitchOutcome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for SwitchOutcome {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self::parse(&String::deserialize(d)?))
    }
}

/// Reason of the agent's [`HEALTHY_CONDITION`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HealthyReason {
    /// True: the switch for the current rollout token passed its health gate.
    GatePassed,
    /// True: the node runs its desired mode (no switch for the current token).
    Active,
    /// False: a switch is under way.
    Switching,
    /// False: the switch for the current token was rolled back.
    RolledBack,
    /// False: the switch for the current token failed.
    Failed,
    /// A reason this version does not know, kept as read.
    Unknown(String),
}

impl HealthyReason {
    /// The string on the wire.
    pub fn as_str(&self) -> &str {
        match self {
            Self::GatePassed => "GatePassed",
            Self::Active => "Active",
            Self::Switching => "Switching",
            Self::RolledBack => "RolledBack",
            Self::Failed => "Failed",
            Self::Unknown(s) => s,
        }
    }

    /// Reads a wire string; never fails.
    pub fn parse(s: &str) -> Self {
        match s {
            "GatePassed" => Self::GatePassed,
            "Active" => Self::Active,
            "Switching" => Self::Switching,
            "RolledBack" => Self::RolledBack,
            "Failed" => Self::Failed,
            other => Self::Unknown(other.to_owned()),
        }
    }
}

impl From<&SwitchOutcome> for HealthyReason {
    /// The reason of a `Healthy=False` condition after a switch that did not succeed.
    fn from(o: &SwitchOutcome) -> Self {
        Self::parse(o.as_str())
    }
}

impl fmt::Display for HealthyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl SwitchResult {
    /// The typed [`SwitchResult::result`].
    pub fn outcome(&self) -> SwitchOutcome {
        SwitchOutcome::parse(&self.result)
    }
}

impl NodeProxyStatus {
    /// Whether any [`HEALTHY_CONDITION`] says `False` (absent or `Unknown` is not unhealthy).
    pub fn reports_unhealthy(&self) -> bool {
        self.conditions
            .iter()
            .any(|c| c.type_ == HEALTHY_CONDITION && c.status == "False")
    }

    /// The reason of the first [`HEALTHY_CONDITION`], typed.
    pub fn healthy_reason(&self) -> Option<HealthyReason> {
        self.conditions
            .iter()
            .find(|c| c.type_ == HEALTHY_CONDITION)
            .map(|c| HealthyReason::parse(&c.reason))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    use super::*;
    use crate::v1alpha1::ProxyMode;

    #[test]
    fn outcomes_keep_the_wire_strings() {
        let cases = [
            ("Succeeded", SwitchOutcome::Succeeded, false),
            ("RolledBack", SwitchOutcome::RolledBack, true),
            ("Failed", SwitchOutcome::Failed, true),
            ("Exploded", SwitchOutcome::Unknown("Exploded".into()), false),
            ("", SwitchOutcome::Unknown(String::new()), false),
        ];
        for (wire, typed, failure) in cases {
            let json = serde_json::to_string(wire).unwrap();
            let read: SwitchOutcome = serde_json::from_str(&json).unwrap();
            assert_eq!(read, typed, "{wire}");
            assert_eq!(serde_json::to_string(&typed).unwrap(), json, "{wire}");
            assert_eq!(typed.to_string(), wire);
            assert_eq!(typed.is_failure(), failure, "{wire}");
        }
    }

    #[test]
    fn a_switch_result_with_an_odd_string_decodes() {
        let json = serde_json::json!({"to": "nftables", "result": "Weird", "rolloutToken": "p-g1-nftables"});
        let r: SwitchResult = serde_json::from_value(json).unwrap();
        assert_eq!(r.to, ProxyMode::Nftables);
        assert_eq!(r.outcome(), SwitchOutcome::Unknown("Weird".into()));
        let ok = SwitchResult {
            result: "RolledBack".into(),
            ..r
        };
        assert_eq!(ok.outcome(), SwitchOutcome::RolledBack);
    }

    fn healthy(status: &str, reason: &str) -> Condition {
        Condition {
            type_: HEALTHY_CONDITION.into(),
            status: status.into(),
            reason: reason.into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        }
    }

    #[test]
    fn healthy_condition_table() {
        // (conditions, reports unhealthy, first reason)
        let cases: Vec<(Vec<Condition>, bool, Option<HealthyReason>)> = vec![
            (vec![], false, None),
            (
                vec![healthy("True", "GatePassed")],
                false,
                Some(HealthyReason::GatePassed),
            ),
            (
                vec![healthy("False", "RolledBack")],
                true,
                Some(HealthyReason::RolledBack),
            ),
            (
                vec![healthy("Unknown", "Switching")],
                false,
                Some(HealthyReason::Switching),
            ),
            (
                vec![healthy("True", "Active"), healthy("False", "Odd")],
                true,
                Some(HealthyReason::Active),
            ),
        ];
        for (conditions, unhealthy, reason) in cases {
            let st = NodeProxyStatus {
                conditions: conditions.clone(),
                ..Default::default()
            };
            assert_eq!(st.reports_unhealthy(), unhealthy, "{conditions:?}");
            assert_eq!(st.healthy_reason(), reason, "{conditions:?}");
        }
        assert_eq!(HealthyReason::from(&SwitchOutcome::Failed), HealthyReason::Failed);
        assert_eq!(HealthyReason::parse("Nope").to_string(), "Nope");
    }
}
