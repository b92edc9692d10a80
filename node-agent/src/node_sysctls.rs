//! The node's connection-tracking sysctls a ProxyPolicy's `proxy.conntrack` asks for,
//! `route_localnet` that localhost NodePorts need, and IPVS mode's `strictARP` (`arp_ignore=1`,
//! `arp_announce=2`, as kube-proxy writes them): which values to write, and which to put back
//! when nothing asks any more (hand-back, cleanup, a field removed, localhost NodePorts turned
//! off). Pure: the caller reads the current values and performs the writes.
//!
//! The semantics follow kube-proxy's (`cmd/kube-proxy/app/conntrack.go`): `nf_conntrack_max` is
//! `maxPerCore × cores`, raised to `min`, and only when `maxPerCore > 0`; with it the conntrack
//! hash table grows to a quarter of the maximum (never shrinks); each timeout is written only
//! when it is above 0; `tcpBeLiberal` is only ever switched on. A value already in place is not
//! written. Unlike kube-proxy, the agent remembers each value it replaced, so a node that leaves
//! the policy gets its own values back instead of keeping the policy's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use switchyard_crds::v1alpha1::ConntrackSettings;

/// One knob the conntrack settings may write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Knob {
    /// `net.netfilter.nf_conntrack_max` (global: writable only from the initial network namespace).
    ConntrackMax,
    /// The `nf_conntrack` module's `hashsize` parameter (global).
    HashSize,
    /// `net.netfilter.nf_conntrack_tcp_timeout_established`.
    TcpEstablishedTimeout,
    /// `net.netfilter.nf_conntrack_tcp_timeout_close_wait`.
    TcpCloseWaitTimeout,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal`.
    TcpBeLiberal,
    /// `net.netfilter.nf_conntrack_udp_timeout`.
    UdpTimeout,
    /// `net.netfilter.nf_conntrack_udp_timeout_stream`.
    UdpStreamTimeout,
    /// `net.ipv4.conf.all.route_localnet`: 1 while a data plane serves NodePorts on 127.0.0.1
    /// (see [`with_route_localnet`]).
    RouteLocalnet,
    /// `net.ipv4.conf.all.arp_ignore`: 1 while IPVS serves with strictARP (see [`with_strict_arp`]).
    ArpIgnore,
    /// `net.ipv4.conf.all.arp_announce`: 2 while IPVS serves with strictARP.
    ArpAnnounce,
}

impl Knob {
    /// Every knob, in the order they are written.
    pub const ALL: [Knob; 10] = [
        Knob::ConntrackMax,
        Knob::HashSize,
        Knob::TcpEstablishedTimeout,
        Knob::TcpCloseWaitTimeout,
        Knob::TcpBeLiberal,
        Knob::UdpTimeout,
        Knob::UdpStreamTimeout,
        Knob::RouteLocalnet,
        Knob::ArpIgnore,
        Knob::ArpAnnounce,
    ];

    /// The conntrack knobs (every one but [`Knob::RouteLocalnet`] and the strictARP ones).
    pub fn is_conntrack(self) -> bool {
        !self.is_data_plane()
    }

    /// The knobs a data plane needs rather than `proxy.conntrack` asks for: `route_localnet` and
    /// the strictARP ones.
    pub fn is_data_plane(self) -> bool {
        matches!(self, Knob::RouteLocalnet | Knob::ArpIgnore | Knob::ArpAnnounce)
    }

    /// The file that holds the knob's value.
    pub fn path(self) -> &'static str {
        match self {
            Knob::ConntrackMax => "/proc/sys/net/netfilter/nf_conntrack_max",
            Knob::HashSize => "/sys/module/nf_conntrack/parameters/hashsize",
            Knob::TcpEstablishedTimeout => "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established",
            Knob::TcpCloseWaitTimeout => "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait",
            Knob::TcpBeLiberal => "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
            Knob::UdpTimeout => "/proc/sys/net/netfilter/nf_conntrack_udp_timeout",
            Knob::UdpStreamTimeout => "/proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream",
            Knob::RouteLocalnet => "/proc/sys/net/ipv4/conf/all/route_localnet",
            Knob::ArpIgnore => "/proc/sys/net/ipv4/conf/all/arp_ignore",
            Knob::ArpAnnounce => "/proc/sys/net/ipv4/conf/all/arp_announce",
        }
    }

    /// Whether the value is per network namespace (the timeouts and `tcp_be_liberal` are; the
    /// table size and the hash size belong to the whole host).
    pub fn per_netns(self) -> bool {
        !matches!(self, Knob::ConntrackMax | Knob::HashSize)
    }
}

/// The values the settings ask for; a knob they leave alone is absent.
pub type Wanted = BTreeMap<Knob, u64>;

/// The values the agent replaced, by knob: what to put back when the policy stops asking.
/// Kept in the agent's state file, so a restart does not forget them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replaced(pub BTreeMap<Knob, u64>);

/// The writes that bring the node to the wanted values, and what is replaced afterwards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Writes in order (the maximum before the hash size that follows from it).
    pub writes: Vec<(Knob, u64)>,
    /// The replaced values once the writes are done.
    pub replaced: Replaced,
}

/// What `settings` ask for on a node with `cores` CPUs.
pub fn wanted(settings: Option<&ConntrackSettings>, cores: u32) -> Wanted {
    let mut wanted = Wanted::new();
    let Some(s) = settings else {
        return wanted;
    };
    if let Some(max) = conntrack_max(s, cores) {
        wanted.insert(Knob::ConntrackMax, max);
    }
    let timeouts = [
        (Knob::TcpEstablishedTimeout, s.tcp_established_timeout_seconds),
        (Knob::TcpCloseWaitTimeout, s.tcp_close_wait_timeout_seconds),
        (Knob::UdpTimeout, s.udp_timeout_seconds),
        (Knob::UdpStreamTimeout, s.udp_stream_timeout_seconds),
    ];
    for (knob, seconds) in timeouts {
        if let Some(seconds) = positive(seconds) {
            wanted.insert(knob, seconds);
        }
    }
    if s.tcp_be_liberal == Some(true) {
        wanted.insert(Knob::TcpBeLiberal, 1);
    }
    wanted
}

/// `wanted` plus `route_localnet=1` when `localhost` (a data plane serves NodePorts on
/// 127.0.0.1). As with the conntrack knobs, a node that has 1 already keeps it and nothing is
/// remembered; a 0 the agent replaced is put back once no data plane needs it.
pub fn with_route_localnet(mut wanted: Wanted, localhost: bool) -> Wanted {
    if localhost {
        wanted.insert(Knob::RouteLocalnet, 1);
    }
    wanted
}

/// `wanted` plus `arp_ignore=1` and `arp_announce=2` when `strict_arp` (IPVS serves with
/// strictARP, so the node does not answer ARP for the service addresses on its dummy link). As
/// with `route_localnet`, the values the agent replaced are put back once IPVS no longer asks.
pub fn with_strict_arp(mut wanted: Wanted, strict_arp: bool) -> Wanted {
    if strict_arp {
        wanted.insert(Knob::ArpIgnore, 1);
        wanted.insert(Knob::ArpAnnounce, 2);
    }
    wanted
}

/// `maxPerCore × cores`, at least `min`; none when `maxPerCore` is absent or 0.
fn conntrack_max(s: &ConntrackSettings, cores: u32) -> Option<u64> {
    let per_core = positive(s.max_per_core)?;
    let scaled = per_core.saturating_mul(u64::from(cores.max(1)));
    Some(scaled.max(positive(s.min).unwrap_or(0)))
}

fn positive(value: Option<i32>) -> Option<u64> {
    value.and_then(|v| u64::try_from(v).ok()).filter(|v| *v > 0)
}

/// The writes from `current` (the node's values now; a knob that cannot be read is absent) to
/// `wanted`, given what the agent `replaced` before: a wanted value not in place is written and
/// the value it replaces remembered (the first one only: a second change keeps the node's own);
/// a knob the agent replaced but no longer wants gets its remembered value back. The hash size
/// follows the maximum: a quarter of it, only ever raised, and put back with the maximum.
pub fn plan(wanted: &Wanted, current: &BTreeMap<Knob, u64>, replaced: &Replaced) -> Plan {
    let mut target = wanted.clone();
    if let Some(max) = wanted.get(&Knob::ConntrackMax) {
        let quarter = max / 4;
        if current.get(&Knob::HashSize).is_some_and(|h| *h < quarter) {
            target.insert(Knob::HashSize, quarter);
        }
    }
    let mut next = replaced.clone();
    let mut writes = Vec::new();
    for knob in Knob::ALL {
        let now = current.get(&knob).copied();
        match (target.get(&knob), replaced.0.get(&knob)) {
            (Some(want), _) if now == Some(*want) => {}
            (Some(want), _) => {
                if let Some(now) = now {
                    next.0.entry(knob).or_insert(now);
                }
                writes.push((knob, *want));
            }
            // Kept raised while the maximum is still wanted (a hash table never needs shrinking
            // under a maximum that stays).
            (None, Some(_)) if knob == Knob::HashSize && target.contains_key(&Knob::ConntrackMax) => {}
            (None, Some(original)) => {
                if now != Some(*original) {
                    writes.push((knob, *original));
                }
                next.0.remove(&knob);
            }
            (None, None) => {}
        }
    }
    Plan {
        writes,
        replaced: next,
    }
}

/// The writes that put back every value the agent replaced (hand-back, cleanup).
pub fn restore(current: &BTreeMap<Knob, u64>, replaced: &Replaced) -> Plan {
    plan(&Wanted::new(), current, replaced)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> ConntrackSettings {
        ConntrackSettings::default()
    }

    fn map(entries: &[(Knob, u64)]) -> BTreeMap<Knob, u64> {
        entries.iter().copied().collect()
    }

    /// A table row: name, settings, cores, the wanted values.
    type Case = (&'static str, ConntrackSettings, u32, Vec<(Knob, u64)>);

    #[test]
    fn wanted_follows_kube_proxy_rules() {
        use Knob::*;
        let cases: Vec<Case> = vec![
            ("absent fields leave everything alone", settings(), 4, vec![]),
            (
                "max per core times cores",
                ConntrackSettings {
                    max_per_core: Some(32768),
                    ..settings()
                },
                4,
                vec![(ConntrackMax, 131072)],
            ),
            (
                "raised to min",
                ConntrackSettings {
                    max_per_core: Some(1000),
                    min: Some(131072),
                    ..settings()
                },
                2,
                vec![(ConntrackMax, 131072)],
            ),
            (
                "min alone writes nothing (as kube-proxy)",
                ConntrackSettings {
                    max_per_core: Some(0),
                    min: Some(131072),
                    ..settings()
                },
                2,
                vec![],
            ),
            (
                "zero timeouts leave the kernel's",
                ConntrackSettings {
                    tcp_established_timeout_seconds: Some(0),
                    udp_timeout_seconds: Some(30),
                    ..settings()
                },
                2,
                vec![(UdpTimeout, 30)],
            ),
            (
                "be_liberal false is never written",
                ConntrackSettings {
                    tcp_be_liberal: Some(false),
                    ..settings()
                },
                2,
                vec![],
            ),
            (
                "everything",
                ConntrackSettings {
                    max_per_core: Some(10),
                    min: Some(5),
                    tcp_established_timeout_seconds: Some(86400),
                    tcp_close_wait_timeout_seconds: Some(3600),
                    tcp_be_liberal: Some(true),
                    udp_timeout_seconds: Some(30),
                    udp_stream_timeout_seconds: Some(120),
                },
                3,
                vec![
                    (ConntrackMax, 30),
                    (TcpEstablishedTimeout, 86400),
                    (TcpCloseWaitTimeout, 3600),
                    (TcpBeLiberal, 1),
                    (UdpTimeout, 30),
                    (UdpStreamTimeout, 120),
                ],
            ),
        ];
        for (name, s, cores, expected) in cases {
            assert_eq!(wanted(Some(&s), cores), map(&expected), "{name}");
        }
        assert!(wanted(None, 8).is_empty());
    }

    #[test]
    fn plan_writes_what_differs_and_remembers_the_first_value() {
        use Knob::*;
        let want = map(&[(UdpTimeout, 30), (TcpBeLiberal, 1)]);
        let now = map(&[(UdpTimeout, 60), (TcpBeLiberal, 1)]);
        let first = plan(&want, &now, &Replaced::default());
        assert_eq!(first.writes, vec![(UdpTimeout, 30)]);
        assert_eq!(first.replaced.0, map(&[(UdpTimeout, 60)]));

        // A second policy value replaces ours, not the node's: the node's 60 is still remembered.
        let after = map(&[(UdpTimeout, 30), (TcpBeLiberal, 1)]);
        let second = plan(&map(&[(UdpTimeout, 45)]), &after, &first.replaced);
        assert_eq!(second.writes, vec![(UdpTimeout, 45)]);
        assert_eq!(second.replaced.0, map(&[(UdpTimeout, 60)]));

        // In place: nothing to do (idempotent).
        let done = plan(
            &map(&[(UdpTimeout, 45)]),
            &map(&[(UdpTimeout, 45)]),
            &second.replaced,
        );
        assert!(done.writes.is_empty());
        assert_eq!(done.replaced, second.replaced);
    }

    #[test]
    fn a_knob_no_longer_wanted_gets_the_nodes_value_back() {
        use Knob::*;
        let replaced = Replaced(map(&[(UdpTimeout, 60), (TcpBeLiberal, 0)]));
        let now = map(&[(UdpTimeout, 30), (TcpBeLiberal, 1)]);
        let p = plan(&map(&[(UdpTimeout, 30)]), &now, &replaced);
        assert_eq!(p.writes, vec![(TcpBeLiberal, 0)]);
        assert_eq!(p.replaced.0, map(&[(UdpTimeout, 60)]));

        let back = restore(&now, &replaced);
        assert_eq!(back.writes, vec![(TcpBeLiberal, 0), (UdpTimeout, 60)]);
        assert!(back.replaced.0.is_empty());
        // Restoring again writes nothing.
        let now = map(&[(UdpTimeout, 60), (TcpBeLiberal, 0)]);
        assert!(restore(&now, &back.replaced).writes.is_empty());
    }

    #[test]
    fn the_hash_size_follows_the_maximum_upwards_only() {
        use Knob::*;
        let want = map(&[(ConntrackMax, 262144)]);
        let small = map(&[(ConntrackMax, 65536), (HashSize, 16384)]);
        let p = plan(&want, &small, &Replaced::default());
        assert_eq!(p.writes, vec![(ConntrackMax, 262144), (HashSize, 65536)]);
        assert_eq!(p.replaced.0, map(&[(ConntrackMax, 65536), (HashSize, 16384)]));

        // Once raised it stays while the maximum is wanted.
        let raised = map(&[(ConntrackMax, 262144), (HashSize, 65536)]);
        assert!(plan(&want, &raised, &p.replaced).writes.is_empty());

        // A larger hash table than needed is left alone.
        let big = map(&[(ConntrackMax, 65536), (HashSize, 1 << 20)]);
        assert_eq!(
            plan(&want, &big, &Replaced::default()).writes,
            vec![(ConntrackMax, 262144)]
        );

        // Restore puts both back.
        let back = restore(&raised, &p.replaced);
        assert_eq!(back.writes, vec![(ConntrackMax, 65536), (HashSize, 16384)]);
    }

    #[test]
    fn an_unreadable_knob_is_written_but_nothing_is_remembered_for_it() {
        let want = map(&[(Knob::UdpTimeout, 30)]);
        let p = plan(&want, &BTreeMap::new(), &Replaced::default());
        assert_eq!(p.writes, vec![(Knob::UdpTimeout, 30)]);
        assert!(p.replaced.0.is_empty());
    }

    #[test]
    fn paths_and_scope() {
        for knob in Knob::ALL {
            assert!(knob.path().starts_with('/'));
        }
        assert!(!Knob::ConntrackMax.per_netns());
        assert!(Knob::UdpTimeout.per_netns());
        assert!(Knob::RouteLocalnet.per_netns());
        assert!(!Knob::RouteLocalnet.is_conntrack());
    }

    /// strictARP: both knobs written and the node's values remembered; off, they come back (a
    /// node already at the values keeps them and nothing is remembered).
    #[test]
    fn strict_arp_is_set_while_wanted_and_the_nodes_values_come_back() {
        use Knob::{ArpAnnounce, ArpIgnore};
        let want = with_strict_arp(Wanted::new(), true);
        assert_eq!(want, map(&[(ArpIgnore, 1), (ArpAnnounce, 2)]));
        assert!(with_strict_arp(Wanted::new(), false).is_empty());
        assert!(!ArpIgnore.is_conntrack() && ArpAnnounce.is_data_plane());
        let node = map(&[(ArpIgnore, 0), (ArpAnnounce, 1)]);
        let on = plan(&want, &node, &Replaced::default());
        assert_eq!(on.writes, vec![(ArpIgnore, 1), (ArpAnnounce, 2)]);
        assert_eq!(on.replaced.0, node);
        let off = restore(&want, &on.replaced);
        assert_eq!(off.writes, vec![(ArpIgnore, 0), (ArpAnnounce, 1)]);
        assert!(off.replaced.0.is_empty());
        let kept = plan(&want, &want, &Replaced::default());
        assert!(kept.writes.is_empty() && kept.replaced.0.is_empty());
    }

    #[test]
    fn route_localnet_is_set_while_wanted_and_the_nodes_value_comes_back() {
        use Knob::RouteLocalnet;
        let want = with_route_localnet(Wanted::new(), true);
        assert_eq!(want, map(&[(RouteLocalnet, 1)]));
        assert!(with_route_localnet(Wanted::new(), false).is_empty());
        let on = plan(&want, &map(&[(RouteLocalnet, 0)]), &Replaced::default());
        assert_eq!(on.writes, vec![(RouteLocalnet, 1)]);
        assert_eq!(on.replaced.0, map(&[(RouteLocalnet, 0)]));
        // Turned off: the 0 comes back and is forgotten.
        let off = plan(&Wanted::new(), &map(&[(RouteLocalnet, 1)]), &on.replaced);
        assert_eq!(off.writes, vec![(RouteLocalnet, 0)]);
        assert!(off.replaced.0.is_empty());
        // A node with 1 already keeps it, then and afterwards.
        let kept = plan(&want, &map(&[(RouteLocalnet, 1)]), &Replaced::default());
        assert!(kept.writes.is_empty() && kept.replaced.0.is_empty());
        assert!(
            plan(&Wanted::new(), &map(&[(RouteLocalnet, 1)]), &kept.replaced)
                .writes
                .is_empty()
        );
    }
}
