//! An in-memory IPVS table for tests without root ([`FakeIpvs`]), refusing what the kernel's
//! `ip_vs_ctl.c` refuses, with the kernel's errors: adding an existing service or real server
//! fails [`Exists`](KernelError::Exists); editing or deleting a missing one, a real server of a
//! missing service, or an unknown scheduler fails [`NotFound`](KernelError::NotFound) (the
//! kernel's `ESRCH`/`ENOENT`). Real servers live under their service and go with it; their
//! connection counters are set by the test ([`FakeIpvs::set_connections`]) to play the
//! connections graceful termination waits for. Every op of a batch is applied or refused on its
//! own, as the kernel acks each request of a batch. [`Faulty`] wraps any table with injected
//! write failures.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::{Destination, FLAG_HASHED, IpvsTable, Op, Service, ServiceKey, VirtualAddr};
use crate::sys::error::{EIO, KernelError, KernelResult};

/// The schedulers a Debian kernel ships (`ip_vs_<name>`).
const SCHEDULERS: [&str; 12] = [
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "mh",
];

/// One virtual service and its real servers by (address, port).
type Entry = (Service, BTreeMap<(IpAddr, u16), Destination>);

/// Virtual services in memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeIpvs {
    services: BTreeMap<VirtualAddr, Entry>,
}

impl FakeIpvs {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every service with its real servers, in key order.
    pub fn table(&self) -> impl Iterator<Item = (&Service, impl Iterator<Item = &Destination>)> {
        self.services.values().map(|(s, dests)| (s, dests.values()))
    }

    /// Sets the connection counters of real server `addr:port` of `service`, as traffic would;
    /// returns whether it exists.
    pub fn set_connections(
        &mut self,
        service: &VirtualAddr,
        addr: IpAddr,
        port: u16,
        active: u32,
        inactive: u32,
    ) -> bool {
        match self
            .services
            .get_mut(service)
            .and_then(|(_, dests)| dests.get_mut(&(addr, port)))
        {
            Some(d) => {
                d.active_conns = active;
                d.inactive_conns = inactive;
                true
            }
            None => false,
        }
    }

    fn scheduler_known(svc: &Service, op: &Op) -> KernelResult<()> {
        if SCHEDULERS.contains(&svc.scheduler.as_str()) {
            Ok(())
        } else {
            Err(KernelError::NotFound { what: op.to_string() })
        }
    }

    /// Applies one op as the kernel would.
    fn apply_one(&mut self, op: &Op) -> KernelResult<()> {
        let missing = || KernelError::NotFound { what: op.to_string() };
        let exists = || KernelError::Exists { what: op.to_string() };
        match op {
            Op::AddService(svc) => {
                if self.services.contains_key(&svc.addr) {
                    return Err(exists());
                }
                Self::scheduler_known(svc, op)?;
                let svc = Service {
                    flags: svc.flags & !FLAG_HASHED,
                    ..svc.clone()
                };
                self.services.insert(svc.addr, (svc, BTreeMap::new()));
            }
            Op::UpdateService(svc) => {
                let (current, _) = self.services.get_mut(&svc.addr).ok_or_else(missing)?;
                Self::scheduler_known(svc, op)?;
                *current = Service {
                    flags: svc.flags & !FLAG_HASHED,
                    ..svc.clone()
                };
            }
            Op::DeleteService(addr) => {
                self.services.remove(addr).ok_or_else(missing)?;
            }
            Op::AddDest(addr, d) => {
                let (_, dests) = self.services.get_mut(addr).ok_or_else(missing)?;
                if dests.contains_key(&(d.addr, d.port)) {
                    return Err(exists());
                }
                let fresh = Destination {
                    active_conns: 0,
                    inactive_conns: 0,
                    persist_conns: 0,
                    ..d.clone()
                };
                dests.insert((d.addr, d.port), fresh);
            }
            Op::UpdateDest(addr, d) => {
                let (_, dests) = self.services.get_mut(addr).ok_or_else(missing)?;
                let current = dests.get_mut(&(d.addr, d.port)).ok_or_else(missing)?;
                current.weight = d.weight;
                current.fwd_method = d.fwd_method;
            }
            Op::DeleteDest(addr, ip, port) => {
                let (_, dests) = self.services.get_mut(addr).ok_or_else(missing)?;
                dests.remove(&(*ip, *port)).ok_or_else(missing)?;
            }
        }
        Ok(())
    }
}

impl IpvsTable for FakeIpvs {
    fn services(&self) -> KernelResult<Vec<(ServiceKey, Option<Service>)>> {
        Ok(self
            .services
            .iter()
            .map(|(k, (s, _))| (ServiceKey::Addr(*k), Some(s.clone())))
            .collect())
    }

    fn destinations(&self, service: &VirtualAddr) -> KernelResult<Vec<Destination>> {
        Ok(self
            .services
            .get(service)
            .map(|(_, dests)| dests.values().cloned().collect())
            .unwrap_or_default())
    }

    fn apply(&mut self, ops: &[Op]) -> KernelResult<Vec<(Op, KernelError)>> {
        Ok(ops
            .iter()
            .filter_map(|op| self.apply_one(op).err().map(|e| (op.clone(), e)))
            .collect())
    }
}

/// Any IPVS table with injected faults: the next `n` non-empty batches fail whole (nothing of
/// them is applied), as when the socket fails.
#[derive(Debug, Default)]
pub struct Faulty<T> {
    inner: T,
    failing: usize,
}

impl<T: IpvsTable> Faulty<T> {
    /// `inner` without faults.
    pub fn new(inner: T) -> Self {
        Self { inner, failing: 0 }
    }

    /// Makes the next `n` non-empty batches fail.
    pub fn fail_next(&mut self, n: usize) {
        self.failing = n;
    }

    /// The wrapped table.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// The wrapped table, to play traffic on a fake.
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: IpvsTable> IpvsTable for Faulty<T> {
    fn services(&self) -> KernelResult<Vec<(ServiceKey, Option<Service>)>> {
        self.inner.services()
    }

    fn destinations(&self, service: &VirtualAddr) -> KernelResult<Vec<Destination>> {
        self.inner.destinations(service)
    }

    fn apply(&mut self, ops: &[Op]) -> KernelResult<Vec<(Op, KernelError)>> {
        if self.failing > 0 && !ops.is_empty() {
            self.failing -= 1;
            return Err(KernelError::Refused {
                what: format!("injected fault: a batch of {} IPVS requests", ops.len()),
                errno: EIO,
            });
        }
        self.inner.apply(ops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn svc(port: u16, scheduler: &str) -> Service {
        Service {
            addr: VirtualAddr {
                protocol: Protocol::Tcp,
                addr: "10.96.0.1".parse().expect("ip"),
                port,
            },
            scheduler: scheduler.into(),
            flags: FLAG_HASHED,
            timeout: 0,
        }
    }

    #[test]
    fn fake_ipvs_keeps_real_servers_under_their_service_and_counts_connections() {
        let mut t = FakeIpvs::new();
        let s = svc(80, "rr");
        let rs: IpAddr = "10.244.0.5".parse().expect("ip");
        let ops = [
            Op::AddService(s.clone()),
            Op::AddDest(s.addr, Destination::masq(rs, 8080, 1)),
        ];
        assert!(t.apply(&ops).expect("apply").is_empty());
        assert_eq!(
            t.services().expect("dump")[0].1.as_ref().map(|s| s.flags),
            Some(0),
            "HASHED is the kernel's, never stored"
        );
        assert!(t.set_connections(&s.addr, rs, 8080, 2, 1));
        let quiesce = Op::UpdateDest(s.addr, Destination::masq(rs, 8080, 0));
        assert!(t.apply(&[quiesce]).expect("apply").is_empty());
        let d = &t.destinations(&s.addr).expect("dump")[0];
        assert_eq!((d.weight, d.active_conns, d.inactive_conns), (0, 2, 1));
        assert!(t.apply(&[Op::DeleteService(s.addr)]).expect("apply").is_empty());
        assert!(t.destinations(&s.addr).expect("dump").is_empty());
        let mut faulty = Faulty::new(t);
        faulty.fail_next(1);
        assert!(faulty.apply(&[]).is_ok(), "an empty batch writes nothing");
        assert!(faulty.apply(&[Op::AddService(s.clone())]).is_err());
        assert!(faulty.inner().services().expect("dump").is_empty());
        assert!(faulty.apply(&[Op::AddService(s)]).expect("apply").is_empty());
    }
}
