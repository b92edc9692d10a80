//! What a cell shows, reduced to what both proxies must agree on: the endpoints that answered and
//! the source address each saw (named by owner), whether any attempt was refused (a reset or an ICMP
//! unreachable before the attempt's limit) or dropped (no answer within it), other errors, a
//! spread's uniformity, and a health check's status. Two verdicts agree when they are equal.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
};

use crate::{
    stats::check_uniform,
    traffic::{Outcome, tally},
};

use super::cell::Check;

/// The key under which a sticky cell's one endpoint is shown: which of the endpoints a client
/// sticks to is a random choice, that it sticks is the semantic.
pub const STICKY: &str = "one endpoint (sticky)";

/// What one cell showed through one proxy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Answering endpoint → the owners of the source addresses it saw.
    pub answers: BTreeMap<String, BTreeSet<String>>,
    /// Some attempt was refused.
    pub refused: bool,
    /// Some attempt got no answer within its limit.
    pub dropped: bool,
    /// Other failures (`Connection reset by peer`, `No route to host`, …).
    pub errors: BTreeSet<String>,
    /// A spread cell: whether the answers passed `stats::check_uniform` over the endpoints.
    pub uniform: Option<bool>,
    /// A health-check cell: the HTTP status (0: no HTTP answer).
    pub http: Option<u16>,
}

/// Reduces `outcomes` of a cell checked by `check` (with `endpoints` the pods that may answer;
/// `owner` names a source address) to its verdict.
pub fn of_outcomes(
    outcomes: &[Outcome],
    check: Check,
    endpoints: &[String],
    owner: impl Fn(std::net::IpAddr) -> String,
) -> Verdict {
    let mut v = Verdict::default();
    for o in outcomes {
        match o {
            Outcome::Answered { server, .. } => {
                let source = o.peer_ip().map(&owner).unwrap_or_else(|| "?".into());
                v.answers.entry(server.clone()).or_default().insert(source);
            }
            Outcome::Refused => v.refused = true,
            Outcome::Timeout => v.dropped = true,
            Outcome::Error(line) => {
                v.errors
                    .insert(line.strip_prefix("error ").unwrap_or(line).to_owned());
            }
        }
    }
    let all_answered = outcomes.iter().all(|o| o.server().is_some());
    if check == Check::Spread && all_answered {
        let names: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        v.uniform = Some(check_uniform(&tally(outcomes), &names).is_ok());
    }
    if check == Check::Sticky && all_answered && v.answers.len() == 1 {
        v.answers = v.answers.into_values().map(|s| (STICKY.to_owned(), s)).collect();
    }
    v
}

/// The verdict of a health-check GET that returned `code` (0: no HTTP answer).
pub fn of_http(code: u16) -> Verdict {
    Verdict {
        http: Some(code),
        ..Verdict::default()
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(code) = self.http {
            parts.push(format!("HTTP {code}"));
        }
        for (server, sources) in &self.answers {
            let sources: Vec<&str> = sources.iter().map(String::as_str).collect();
            parts.push(format!("{server} ← {}", sources.join(", ")));
        }
        match self.uniform {
            Some(true) => parts.push("uniform".into()),
            Some(false) => parts.push("SKEWED".into()),
            None => {}
        }
        if self.refused {
            parts.push("refused".into());
        }
        if self.dropped {
            parts.push("dropped".into());
        }
        for e in &self.errors {
            parts.push(format!("error: {e}"));
        }
        if parts.is_empty() {
            parts.push("nothing".into());
        }
        write!(f, "{}", parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(server: &str, peer: &str) -> Outcome {
        Outcome::Answered {
            server: server.into(),
            peer: peer.into(),
        }
    }

    fn owner(ip: std::net::IpAddr) -> String {
        if ip.to_string() == "10.250.0.11" {
            "node-1".into()
        } else {
            ip.to_string()
        }
    }

    #[test]
    fn answers_are_grouped_by_endpoint_and_source_owner() {
        let o = [
            answered("a", "10.250.0.11:4000"),
            answered("a", "10.250.0.11:4001"),
            answered("b", "[fd00::1]:5"),
        ];
        let v = of_outcomes(&o, Check::Cover, &[], owner);
        assert_eq!(v.to_string(), "a ← node-1; b ← fd00::1");
        assert!(!v.refused && !v.dropped);
    }

    #[test]
    fn refusals_drops_and_errors_are_kept_apart() {
        let o = [
            Outcome::Refused,
            Outcome::Timeout,
            Outcome::Error("error Connection reset by peer (os error 104)".into()),
        ];
        let v = of_outcomes(&o, Check::Cover, &[], owner);
        assert_eq!(
            v.to_string(),
            "refused; dropped; error: Connection reset by peer (os error 104)"
        );
        assert_ne!(v, of_outcomes(&[Outcome::Refused], Check::Cover, &[], owner));
    }

    #[test]
    fn a_sticky_client_on_any_one_endpoint_is_the_same_verdict() {
        let on = |s: &str| vec![answered(s, "10.0.0.1:1"); 20];
        let a = of_outcomes(&on("a"), Check::Sticky, &[], owner);
        let b = of_outcomes(&on("b"), Check::Sticky, &[], owner);
        assert_eq!(a, b);
        let mut mixed = on("a");
        mixed.push(answered("b", "10.0.0.1:1"));
        assert_ne!(of_outcomes(&mixed, Check::Sticky, &[], owner), a);
    }

    #[test]
    fn a_spread_is_judged_uniform_or_skewed() {
        let eps: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let even: Vec<Outcome> = (0..600).map(|i| answered(&eps[i % 3], "10.0.0.1:1")).collect();
        assert_eq!(of_outcomes(&even, Check::Spread, &eps, owner).uniform, Some(true));
        let skewed: Vec<Outcome> = (0..600)
            .map(|i| answered(&eps[if i % 4 < 2 { 0 } else { i % 4 - 1 }], "10.0.0.1:1"))
            .collect();
        assert_eq!(
            of_outcomes(&skewed, Check::Spread, &eps, owner).uniform,
            Some(false)
        );
    }
}
