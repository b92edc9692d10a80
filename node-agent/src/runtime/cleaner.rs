//! The conntrack cleaner: owns what the last successful sync programmed and the UDP conntrack
//! cleanups that could not run yet. Each sync's cleanups are planned before it (against what is
//! programmed), run after it succeeded (so no entry is recreated by the old rules), and carried
//! to the next sync when the sync or the deletion failed. What is programmed is kept of the UDP
//! service ports only, the one protocol with stale flows to delete.

use std::collections::BTreeMap;

use crate::{
    backend::Settings,
    conntrack::{Cleanup, UdpDestinations, cleanup_after},
    model::{Changes, DualSnapshot, IpFamily, Protocol, ServiceName, Snapshot, ports_of, remove_ports_of},
};

/// The cleanups of one sync, per family.
#[derive(Debug, Default)]
pub(super) struct Planned(Vec<(IpFamily, Cleanup)>);

impl Planned {
    /// After the sync (`synced`: it succeeded), deletes the stale entries with `delete`; returns
    /// what is left to carry over (everything when the sync failed). Blocks: run it beside the sync.
    pub fn run<E: std::fmt::Display>(
        self,
        synced: bool,
        delete: impl Fn(IpFamily, &Cleanup) -> Result<usize, E>,
    ) -> Planned {
        if !synced {
            return self;
        }
        let mut unfinished = Vec::new();
        for (family, cleanup) in self.0 {
            match delete(family, &cleanup) {
                Ok(0) => {}
                Ok(deleted) => tracing::info!(%family, deleted, "deleted stale UDP conntrack entries"),
                Err(e) => {
                    tracing::warn!(%family, error = %e, "deleting stale UDP conntrack entries failed; retrying after the next sync");
                    unfinished.push((family, cleanup));
                }
            }
        }
        Planned(unfinished)
    }

    /// The families with a cleanup.
    #[cfg(test)]
    fn families(&self) -> Vec<IpFamily> {
        self.0.iter().map(|(f, _)| *f).collect()
    }
}

/// What the cleaner keeps between syncs.
#[derive(Debug, Default)]
pub(super) struct ConntrackCleaner {
    /// The UDP service ports (with their endpoints) the last successful sync programmed: stale UDP
    /// flows are judged against them, and nothing else of the state (a whole snapshot held here
    /// made the tracker keep a second one, 38 MiB at 44k Services). Kept up to date per changed
    /// Service.
    programmed: Option<DualSnapshot>,
    /// A sync failed since `programmed` was last brought up to date: the changes it took are not
    /// in it, so the next successful sync rebuilds it whole.
    behind: bool,
    /// Cleanups that could not run yet.
    unfinished: BTreeMap<IpFamily, Cleanup>,
}

impl ConntrackCleaner {
    /// Plans the cleanups of a sync to `snapshot`. A full sync may follow a failed one whose
    /// changes are gone: it compares every Service then.
    pub fn plan(
        &mut self,
        snapshot: &DualSnapshot,
        changes: &Changes,
        full: bool,
        settings: &Settings,
    ) -> Planned {
        let compared = if full {
            Changes {
                services: self
                    .programmed
                    .as_ref()
                    .into_iter()
                    .chain(std::iter::once(snapshot))
                    .flat_map(|d| d.families())
                    .flat_map(|s| s.services.keys().map(|k| k.service.clone()))
                    .collect(),
            }
        } else {
            changes.clone()
        };
        let mut planned = Vec::new();
        for family in IpFamily::ALL {
            let old = self.programmed.as_ref().map(|p| p.get(family));
            let node_ports = settings.node_port_addresses.of(family);
            let new = snapshot.get(family);
            let cleanup = cleanup_after(old, new, &compared, &settings.node, node_ports);
            let cleanup = match (cleanup, self.unfinished.remove(&family)) {
                // Judged against what is programmed now, not when it was planned.
                (cleanup, Some(carried)) => {
                    let mut c = cleanup.unwrap_or_else(|| Cleanup {
                        current: UdpDestinations::of(new, &settings.node, node_ports),
                        ..Default::default()
                    });
                    c.merge(carried);
                    Some(c)
                }
                (cleanup, None) => cleanup,
            };
            planned.extend(cleanup.map(|c| (family, c)));
        }
        Planned(planned)
    }

    /// The sync of `changes` (`full`: of everything) ended: `programmed` is what it programmed
    /// when it succeeded; `unfinished` is carried to the next sync.
    pub fn finish(
        &mut self,
        programmed: Option<&DualSnapshot>,
        changes: &Changes,
        full: bool,
        unfinished: Planned,
    ) {
        match (programmed, &mut self.programmed) {
            (None, _) => self.behind = true,
            (Some(now), Some(kept)) if !full && !self.behind => {
                for name in &changes.services {
                    for family in IpFamily::ALL {
                        copy_udp_ports(now.get(family), kept.get_mut(family), name);
                    }
                }
            }
            (Some(now), _) => {
                self.programmed = Some(udp_only(now));
                self.behind = false;
            }
        }
        self.unfinished.extend(unfinished.0);
    }
}

/// The UDP service ports of `snapshot` with their endpoints.
fn udp_only(snapshot: &DualSnapshot) -> DualSnapshot {
    let mut udp = DualSnapshot::default();
    for family in IpFamily::ALL {
        let (from, to) = (snapshot.get(family), udp.get_mut(family));
        for (name, port) in from.services.iter().filter(|(k, _)| k.protocol == Protocol::Udp) {
            to.services.insert(name.clone(), port.clone());
            if let Some(eps) = from.endpoints.get(name) {
                to.endpoints.insert(name.clone(), eps.clone());
            }
        }
    }
    udp
}

/// Replaces Service `name`'s UDP ports (and their endpoints) in `to` with those in `from`.
fn copy_udp_ports(from: &Snapshot, to: &mut Snapshot, name: &ServiceName) {
    remove_ports_of(&mut to.services, name);
    remove_ports_of(&mut to.endpoints, name);
    for (port_name, port) in ports_of(&from.services, name).filter(|(k, _)| k.protocol == Protocol::Udp) {
        to.services.insert(port_name.clone(), port.clone());
        if let Some(eps) = from.endpoints.get(port_name) {
            to.endpoints.insert(port_name.clone(), eps.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::fixtures;

    fn udp_service(endpoint: u8) -> DualSnapshot {
        let mut s = Snapshot::new(IpFamily::V4);
        let port = fixtures::cluster_ip(
            fixtures::port_name("ns", "dns", "", Protocol::Udp),
            Ipv4Addr::new(10, 96, 0, 10),
            53,
        );
        fixtures::add(
            &mut s,
            port,
            vec![fixtures::ready(Ipv4Addr::new(10, 244, 1, endpoint), 53, "n2")],
        );
        DualSnapshot::from(s)
    }

    fn ok(_: IpFamily, _: &Cleanup) -> Result<usize, String> {
        Ok(1)
    }

    fn refused(_: IpFamily, _: &Cleanup) -> Result<usize, String> {
        Err("netlink: operation not permitted".into())
    }

    #[test]
    fn cleanups_that_fail_are_carried_to_the_next_sync() {
        let settings = Settings::default();
        let mut cleaner = ConntrackCleaner::default();
        let first = udp_service(5);
        let planned = cleaner.plan(&first, &Changes::default(), true, &settings);
        assert_eq!(
            planned.families(),
            [IpFamily::V4],
            "the first sync checks every UDP destination"
        );
        cleaner.finish(
            Some(&first),
            &Changes::default(),
            true,
            planned.run(true, refused),
        );
        // Nothing changed since, yet the failed cleanup runs again.
        let again = cleaner.plan(&first, &Changes::default(), false, &settings);
        assert_eq!(again.families(), [IpFamily::V4]);
        cleaner.finish(Some(&first), &Changes::default(), false, again.run(true, ok));
        assert!(
            cleaner
                .plan(&first, &Changes::default(), false, &settings)
                .0
                .is_empty()
        );
    }

    /// One TCP and one UDP Service, each with one endpoint.
    fn tcp_and_udp(tcp_endpoint: u8, udp_endpoint: u8) -> DualSnapshot {
        let mut s = udp_service(udp_endpoint);
        let port = fixtures::cluster_ip(
            fixtures::port_name("ns", "web", "", Protocol::Tcp),
            Ipv4Addr::new(10, 96, 0, 80),
            80,
        );
        fixtures::add(
            &mut s.v4,
            port,
            vec![fixtures::ready(Ipv4Addr::new(10, 244, 2, tcp_endpoint), 80, "n2")],
        );
        s
    }

    #[test]
    fn what_is_kept_as_programmed_is_the_udp_part_and_follows_every_sync() {
        let mut cleaner = ConntrackCleaner::default();
        let first = tcp_and_udp(1, 5);
        cleaner.finish(Some(&first), &Changes::default(), true, Planned::default());
        assert_eq!(cleaner.programmed, Some(udp_service(5)), "TCP is not kept");
        // Partial syncs: only the changed Services are copied, and the result is the same.
        let second = tcp_and_udp(2, 6);
        cleaner.finish(
            Some(&second),
            &fixtures::changes(&["dns", "web"]),
            false,
            Planned::default(),
        );
        assert_eq!(cleaner.programmed, Some(udp_service(6)));
        let empty = DualSnapshot::default();
        cleaner.finish(
            Some(&empty),
            &fixtures::changes(&["dns", "web"]),
            false,
            Planned::default(),
        );
        assert_eq!(cleaner.programmed, Some(DualSnapshot::default()), "both deleted");
        // A failed sync's changes never reach the cleaner: the next success rebuilds it whole,
        // even a partial one that does not name them.
        cleaner.finish(None, &fixtures::changes(&["dns"]), false, Planned::default());
        cleaner.finish(
            Some(&second),
            &fixtures::changes(&["web"]),
            false,
            Planned::default(),
        );
        assert_eq!(cleaner.programmed, Some(udp_service(6)));
    }

    #[test]
    fn a_failed_sync_keeps_its_cleanups_and_what_was_programmed() {
        let settings = Settings::default();
        let mut cleaner = ConntrackCleaner::default();
        let first = udp_service(5);
        let planned = cleaner.plan(&first, &Changes::default(), true, &settings);
        let left = planned.run(false, |_, _| -> Result<usize, String> {
            panic!("ran after a failed sync")
        });
        assert_eq!(left.families(), [IpFamily::V4]);
        cleaner.finish(None, &Changes::default(), true, left);
        assert!(cleaner.programmed.is_none());
        assert_eq!(cleaner.unfinished.len(), 1);
    }
}
