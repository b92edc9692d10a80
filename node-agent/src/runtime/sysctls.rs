//! Applies the policy's `proxy.conntrack` to the node's sysctls: reads the current values, writes
//! what [`crate::node_sysctls::plan`] says through the [`Sysctl`] adapter, and keeps the values it
//! replaced in the state file so that they are put back when the policy stops asking (or on
//! `--cleanup`, [`restore_from`]). It runs when the asked-for values change (and once at start),
//! never in a retry loop: a knob the kernel refuses (`nf_conntrack_max` and the hash size are
//! host-global, read-only inside a non-initial network namespace) is logged once with the reason
//! and reported in the `ConntrackSysctls` status condition.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use switchyard_crds::v1alpha1::ConntrackSettings;

use crate::{
    node_sysctls::{self, Knob, Plan, Replaced, Wanted},
    state_store::StateFile,
    sys::{
        host,
        sysctl::{HostSysctl, Sysctl},
    },
};

/// The status condition's type.
pub(super) const CONDITION: &str = "ConntrackSysctls";

/// The adapter's name of a knob: its path under `/proc/sys/`, or the absolute path of a file
/// elsewhere (the hash size under `/sys/module/`; joined to `/proc/sys` an absolute path stays
/// itself).
fn sysctl_name(knob: Knob) -> &'static str {
    knob.path().strip_prefix("/proc/sys/").unwrap_or(knob.path())
}

/// The node's values now; a knob that cannot be read is absent.
fn current() -> BTreeMap<Knob, u64> {
    Knob::ALL
        .into_iter()
        .filter_map(|k| {
            let value = host::sysctl_i64(sysctl_name(k))?;
            u64::try_from(value).ok().map(|v| (k, v))
        })
        .collect()
}

/// The CPUs this agent may run on, as kube-proxy's `runtime.NumCPU()` counts them: the CPU
/// affinity mask, not a cgroup CPU quota (which `available_parallelism` would follow, giving a
/// pod with a CPU limit a smaller table than kube-proxy).
fn cores() -> u32 {
    let affinity = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok();
    let count = affinity.map_or(0, |set| {
        (0..nix::sched::CpuSet::count())
            .filter(|cpu| set.is_set(*cpu).unwrap_or(false))
            .count()
    });
    if count > 0 {
        u32::try_from(count).unwrap_or(u32::MAX)
    } else {
        std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
    }
}

/// Why a refused knob stays as it is, for the log and the condition.
fn refusal(knob: Knob, error: &str) -> String {
    let scope = if knob.per_netns() {
        ""
    } else {
        " (host-global: writable only from the node's initial network namespace)"
    };
    if error.contains(knob.path()) {
        format!("{error}{scope}")
    } else {
        format!("{}: {error}{scope}", knob.path())
    }
}

/// Performs `plan`'s writes; returns the replaced values that hold afterwards and the refusals.
/// A refused write replaces nothing: the values remembered before stay remembered.
fn perform(sysctl: &mut dyn Sysctl, plan: Plan, before: &Replaced) -> (Replaced, BTreeMap<Knob, String>) {
    let mut replaced = plan.replaced;
    let mut refused = BTreeMap::new();
    for (knob, value) in plan.writes {
        if let Err(e) = sysctl.ensure(sysctl_name(knob), &value.to_string()) {
            refused.insert(knob, refusal(knob, &e.to_string()));
            replaced.0.remove(&knob);
            if let Some(old) = before.0.get(&knob) {
                replaced.0.insert(knob, *old);
            }
        }
    }
    (replaced, refused)
}

/// The conntrack sysctls of this node, as the policy asks for them.
#[derive(Debug)]
pub(super) struct ConntrackSysctls {
    file: StateFile,
    sysctl: HostSysctl,
    /// What was asked for at the last pass (none before the first).
    applied: Option<Wanted>,
    replaced: Replaced,
    /// Knobs the kernel refused, with the reason already logged.
    refused: BTreeMap<Knob, String>,
}

impl ConntrackSysctls {
    /// Sysctls of the agent's network namespace, remembering replaced values in `file`.
    pub fn new(file: StateFile) -> Self {
        let replaced = file.load_sysctls();
        Self {
            file,
            sysctl: HostSysctl::new(None),
            applied: None,
            replaced,
            refused: BTreeMap::new(),
        }
    }

    /// Brings the sysctls to what `settings` ask for, if that changed since the last pass;
    /// returns the status condition when it changed (`Some(None)`: no condition any more).
    pub fn apply(&mut self, settings: Option<&ConntrackSettings>) -> Option<Option<Condition>> {
        let wanted = node_sysctls::wanted(settings, cores());
        if self.applied.as_ref() == Some(&wanted) {
            return None;
        }
        let plan = node_sysctls::plan(&wanted, &current(), &self.replaced);
        let writes = plan.writes.clone();
        let (replaced, refused) = perform(&mut self.sysctl, plan, &self.replaced);
        for (knob, why) in &refused {
            if self.refused.get(knob) != Some(why) {
                tracing::warn!(knob = ?knob, reason = %why, "conntrack sysctl not written; the node keeps its value");
            }
        }
        if !writes.is_empty() {
            tracing::info!(?writes, refused = refused.len(), "conntrack sysctls written");
        }
        if replaced != self.replaced {
            if let Err(e) = self.file.store_sysctls(&replaced) {
                tracing::warn!(error = %e, "storing the replaced conntrack sysctl values failed");
            }
            self.replaced = replaced;
        }
        self.refused = refused;
        let condition = condition(&wanted, &self.refused);
        self.applied = Some(wanted);
        Some(condition)
    }
}

/// The `ConntrackSysctls` condition: none when nothing is asked or refused.
fn condition(wanted: &Wanted, refused: &BTreeMap<Knob, String>) -> Option<Condition> {
    if wanted.is_empty() && refused.is_empty() {
        return None;
    }
    let (ok, reason, message) = if refused.is_empty() {
        let values: Vec<String> = wanted
            .iter()
            .map(|(k, v)| format!("{}={v}", k.path().rsplit('/').next().unwrap_or_default()))
            .collect();
        (
            true,
            "Applied",
            format!("set as the policy asks: {}", values.join(", ")),
        )
    } else {
        let why: Vec<&str> = refused.values().map(String::as_str).collect();
        (false, "NotWritable", format!("not written: {}", why.join("; ")))
    };
    Some(Condition {
        type_: CONDITION.into(),
        status: if ok { "True".into() } else { "False".into() },
        reason: reason.into(),
        message,
        last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        ),
        observed_generation: None,
    })
}

/// `--cleanup`: puts back every conntrack sysctl value the agent replaced (remembered in `file`);
/// returns what could not be put back.
pub fn restore_from(file: &StateFile) -> Vec<String> {
    let before = file.load_sysctls();
    if before.0.is_empty() {
        return Vec::new();
    }
    let plan = node_sysctls::restore(&current(), &before);
    let mut sysctl = HostSysctl::new(None);
    let (left, refused) = perform(&mut sysctl, plan, &before);
    let mut errors: Vec<String> = refused.into_values().collect();
    if let Err(e) = file.store_sysctls(&left) {
        errors.push(format!("{}: {e}", file.0.display()));
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::sysctl::FakeSysctl;

    #[test]
    fn refused_writes_replace_nothing_and_are_reported() {
        let mut fake = FakeSysctl::new();
        let want: Wanted = [(Knob::UdpTimeout, 30), (Knob::ConntrackMax, 1000)].into();
        let now = [(Knob::UdpTimeout, 60), (Knob::ConntrackMax, 500)].into();
        let plan = node_sysctls::plan(&want, &now, &Replaced::default());
        let (replaced, refused) = perform(&mut fake, plan, &Replaced::default());
        assert_eq!(fake.get("net/netfilter/nf_conntrack_udp_timeout"), "30");
        assert_eq!(
            replaced.0,
            [(Knob::UdpTimeout, 60), (Knob::ConntrackMax, 500)].into()
        );
        assert!(refused.is_empty());

        let mut read_only = FakeSysctl::new();
        read_only.make_read_only();
        let plan = node_sysctls::plan(&want, &now, &Replaced::default());
        let (replaced, refused) = perform(&mut read_only, plan, &Replaced::default());
        assert!(replaced.0.is_empty(), "nothing was replaced: {replaced:?}");
        assert_eq!(refused.len(), 2);
        assert!(
            refused[&Knob::ConntrackMax].contains("host-global"),
            "{refused:?}"
        );
        let c = condition(&want, &refused).expect("a condition");
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "NotWritable"));
        assert!(c.message.contains("nf_conntrack_max"), "{}", c.message);

        let ok = condition(&want, &BTreeMap::new()).expect("a condition");
        assert_eq!(ok.status, "True");
        assert!(
            ok.message.contains("nf_conntrack_udp_timeout=30"),
            "{}",
            ok.message
        );
        assert!(condition(&Wanted::new(), &BTreeMap::new()).is_none());
    }

    #[test]
    fn knobs_are_named_as_the_adapter_takes_them() {
        assert_eq!(
            sysctl_name(Knob::UdpTimeout),
            "net/netfilter/nf_conntrack_udp_timeout"
        );
        assert_eq!(
            sysctl_name(Knob::HashSize),
            "/sys/module/nf_conntrack/parameters/hashsize"
        );
    }
}
