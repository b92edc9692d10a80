//! The conntrack cleaner: owns what the last successful sync programmed and the UDP conntrack
//! cleanups that could not run yet. Each sync's cleanups are planned before it (against what is
//! programmed), run after it succeeded (so no entry is recreated by the old rules), and carried
//! to the next sync when the sync or the deletion failed.

use std::{collections::BTreeMap, sync::Arc};

use crate::{
    backend::Settings,
    conntrack::{Cleanup, UdpDestinations, cleanup_after},
    model::{Changes, DualSnapshot, IpFamily},
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
    /// What the last successful sync programmed (stale UDP flows are found against it).
    programmed: Option<Arc<DualSnapshot>>,
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
                    .as_deref()
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

    /// The sync ended: `programmed` is what it programmed when it succeeded; `unfinished` is
    /// carried to the next sync.
    pub fn finish(&mut self, programmed: Option<Arc<DualSnapshot>>, unfinished: Planned) {
        if let Some(p) = programmed {
            self.programmed = Some(p);
        }
        self.unfinished.extend(unfinished.0);
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::{Protocol, Snapshot, fixtures};

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
        cleaner.finish(Some(Arc::new(first.clone())), planned.run(true, refused));
        // Nothing changed since, yet the failed cleanup runs again.
        let again = cleaner.plan(&first, &Changes::default(), false, &settings);
        assert_eq!(again.families(), [IpFamily::V4]);
        cleaner.finish(Some(Arc::new(first.clone())), again.run(true, ok));
        assert!(
            cleaner
                .plan(&first, &Changes::default(), false, &settings)
                .0
                .is_empty()
        );
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
        cleaner.finish(None, left);
        assert!(cleaner.programmed.is_none());
        assert_eq!(cleaner.unfinished.len(), 1);
    }
}
