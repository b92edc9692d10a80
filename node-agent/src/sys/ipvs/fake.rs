//! An in-memory IPVS table for tests without root ([`FakeIpvs`]), refusing what the kernel's
//! `ip_vs_ctl.c` refuses, with the kernel's errors: adding an existing service or real server
//! fails [`Exists`](KernelError::Exists); editing or deleting a missing one, a real server of a
//! missing service, or an unknown scheduler fails [`NotFound`](KernelError::NotFound) (the
//! kernel's `ESRCH`/`ENOENT`). Real servers live under their service and go with it; their
//! connection counters are set by the test ([`FakeIpvs::set_connections`]) to play the
//! connections graceful termination waits for. Every op of a batch is applied or refused on its
//! own, as the kernel acks each request of a batch. The connection timeouts start at the kernel's
//! defaults and take the non-zero ones of a write, refusing what the kernel refuses (more than
//! `INT_MAX / HZ` seconds: `EINVAL`). [`Faulty`] wraps any table with injected write failures.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::{Destination, FLAG_HASHED, IpvsTable, Op, Service, ServiceKey, Timeouts, VirtualAddr};
use crate::sys::error::{EIO, KernelError, KernelResult};

/// The schedulers a Debian 6.1 kernel ships (`ip_vs_<name>`; `twos` came with 6.2).
pub const SCHEDULERS: [&str; 13] = [
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh",
];

/// The largest timeout the kernel takes: `INT_MAX / HZ` with Debian's `CONFIG_HZ=250`.
pub const MAX_TIMEOUT: u32 = (i32::MAX / 250) as u32;

/// `EINVAL`.
const EINVAL: i32 = 22;

/// One virtual service and its real servers by (address, port).
type Entry = (Service, BTreeMap<(IpAddr, u16), Destination>);

/// Virtual services in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeIpvs {
    services: BTreeMap<VirtualAddr, Entry>,
    timeouts: Timeouts,
}

impl Default for FakeIpvs {
    fn default() -> Self {
        Self {
            services: BTreeMap::new(),
            timeouts: Timeouts::KERNEL_DEFAULT,
        }
    }
}

impl FakeIpvs {
    /// An empty table with the kernel's default timeouts.
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

    fn timeouts(&self) -> KernelResult<Timeouts> {
        Ok(self.timeouts)
    }

    fn set_timeouts(&mut self, t: &Timeouts) -> KernelResult<()> {
        if [t.tcp, t.tcp_fin, t.udp].iter().any(|s| *s > MAX_TIMEOUT) {
            return Err(KernelError::Refused {
                what: format!("SET_CONFIG tcp {} tcpfin {} udp {}", t.tcp, t.tcp_fin, t.udp),
                errno: EINVAL,
            });
        }
        self.timeouts = t.over(self.timeouts);
        Ok(())
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

    fn timeouts(&self) -> KernelResult<Timeouts> {
        self.inner.timeouts()
    }

    /// Fails whole as a batch does while faults are pending.
    fn set_timeouts(&mut self, t: &Timeouts) -> KernelResult<()> {
        if self.failing > 0 && !t.is_unset() {
            self.failing -= 1;
            return Err(KernelError::Refused {
                what: "injected fault: SET_CONFIG".into(),
                errno: EIO,
            });
        }
        self.inner.set_timeouts(t)
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

    /// The timeouts start at the kernel's defaults; a write changes only its non-zero ones and
    /// one above the kernel's bound is refused whole.
    #[test]
    fn fake_ipvs_holds_the_timeouts_as_the_kernel_does() {
        let mut t = FakeIpvs::new();
        assert_eq!(t.timeouts().expect("get"), Timeouts::KERNEL_DEFAULT);
        let partial = Timeouts {
            tcp: 3600,
            tcp_fin: 0,
            udp: 45,
        };
        t.set_timeouts(&partial).expect("set");
        let want = Timeouts {
            tcp: 3600,
            tcp_fin: 120,
            udp: 45,
        };
        assert_eq!(t.timeouts().expect("get"), want);
        t.set_timeouts(&Timeouts::default()).expect("0 changes nothing");
        assert_eq!(t.timeouts().expect("get"), want);
        let too_long = Timeouts {
            tcp_fin: MAX_TIMEOUT + 1,
            ..Timeouts::KERNEL_DEFAULT
        };
        assert!(matches!(
            t.set_timeouts(&too_long),
            Err(KernelError::Refused { errno: EINVAL, .. })
        ));
        assert_eq!(
            t.timeouts().expect("get"),
            want,
            "a refused write changes nothing"
        );
    }
}
