//! Nodes that are network namespaces, dual-stack: every IPv4 address has an IPv6 (ULA) twin.
//!
//! ```text
//!   fabric ns: bridge br0 10.250.0.1/24, fd00:10:250::1/64 ── forwards 10.250.0.1:PORT to the
//!      │       apiserver on the root namespace's 127.0.0.1 (a socket made in the fabric, connected
//!      │       out from the root namespace); routes each node's pod CIDRs via its node IPs
//!   node-i ns: eth0 10.250.0.(10+i)/24, fd00:10:250::(10+i)/64, default via 10.250.0.1 and
//!      │       fd00:10:250::1; pod bridge cbr0 10.244.i.1/24, fd00:10:244:i::1/64; routes to other
//!      │       nodes' pod CIDRs via their node IPs (host-gw style)
//!   pod ns:    eth0 10.244.i.(10+k)/24, fd00:10:244:i::(10+k)/64, default via 10.244.i.1 and
//!              fd00:10:244:i::1
//! ```
//! The IPv6 addresses mirror the IPv4 ones digit for digit (node-1 is `10.250.0.11` and
//! `fd00:10:250::11`). The fabric and the nodes forward both families; addresses skip duplicate
//! address detection (`nodad`, `accept_dad=0`) so they are usable at once, and the bridges do no
//! multicast snooping (neighbour discovery is multicast).
//!
//! Private addresses exist only inside these namespaces; nothing is routed to or from the root
//! namespace. Dropping the [`Cluster`] stops the forwarder and deletes every namespace.

use std::{
    fs::File,
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::AsFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use nix::sched::{CloneFlags, setns};

use crate::{Error, Family, Result, controlplane, io_err, run, sweep};

/// The fabric's IPv6 address (its IPv4 one is [`controlplane::ADVERTISE_ADDRESS`]): the nodes'
/// IPv6 default gateway, and the source address of IPv6 traffic from outside the cluster.
pub const FABRIC_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x250, 0, 0, 0, 0, 1);
/// The pod network of every node, IPv4 (`10.244.i.0/24` per node).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The pod network of every node, IPv6 (`fd00:10:244:i::/64` per node).
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/56";
/// The fabric subnet, IPv4.
pub const FABRIC_CIDR: &str = "10.250.0.0/24";
/// The fabric subnet, IPv6.
pub const FABRIC_CIDR6: &str = "fd00:10:250::/64";

/// One node namespace.
#[derive(Debug, Clone)]
pub struct Node {
    /// Node name (also the Kubernetes Node name).
    pub name: String,
    /// Network namespace name.
    pub netns: String,
    /// Node IP on the fabric.
    pub ip: Ipv4Addr,
    /// Node IPv6 address on the fabric, `fd00:10:250::(10+i)`.
    pub ip6: Ipv6Addr,
    /// Pod CIDR `10.244.i.0/24`.
    pub pod_cidr: String,
    /// IPv6 pod CIDR `fd00:10:244:i::/64`.
    pub pod_cidr6: String,
    /// Pods behind this node.
    pub pods: Vec<Pod>,
}

/// One pod namespace.
#[derive(Debug, Clone)]
pub struct Pod {
    /// Pod name.
    pub name: String,
    /// Network namespace name.
    pub netns: String,
    /// Pod IP.
    pub ip: Ipv4Addr,
    /// Pod IPv6 address, `fd00:10:244:i::(10+k)`.
    pub ip6: Ipv6Addr,
}

impl Node {
    /// The node's address of `family`.
    pub fn ip_of(&self, family: Family) -> IpAddr {
        match family {
            Family::V4 => IpAddr::V4(self.ip),
            Family::V6 => IpAddr::V6(self.ip6),
        }
    }
}

impl Pod {
    /// The pod's address of `family`.
    pub fn ip_of(&self, family: Family) -> IpAddr {
        match family {
            Family::V4 => IpAddr::V4(self.ip),
            Family::V6 => IpAddr::V6(self.ip6),
        }
    }
}

/// The fabric's (the outside world's) address of `family`.
pub fn fabric_ip(family: Family) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(controlplane::ADVERTISE_ADDRESS),
        Family::V6 => IpAddr::V6(FABRIC_IP6),
    }
}

/// A fabric with node and pod namespaces.
pub struct Cluster {
    /// Fabric namespace name.
    pub fabric: String,
    /// The nodes.
    pub nodes: Vec<Node>,
    all_netns: Vec<String>,
    stop: Arc<AtomicBool>,
    forwarder: Option<JoinHandle<()>>,
}

fn ip_in(ns: &str, args: &[&str]) -> Result<String> {
    let mut full = vec!["-n", ns];
    full.extend_from_slice(args);
    run("ip", &full)
}

fn ip6_in(ns: &str, args: &[&str]) -> Result<String> {
    let mut full = vec!["-6", "-n", ns];
    full.extend_from_slice(args);
    run("ip", &full)
}

fn sysctl_in(ns: &str, key: &str, value: &str) -> Result<String> {
    run(
        "ip",
        &["netns", "exec", ns, "sysctl", "-qw", &format!("{key}={value}")],
    )
}

/// Parses an IPv6 address written from the IPv4 layout (`fd00:10:250::11` for node-1).
fn v6(text: String) -> Result<Ipv6Addr> {
    text.parse()
        .map_err(|_| Error::Prerequisite(format!("not an IPv6 address: {text}")))
}

/// Node `i`'s pod bridge `cbr0` with the pod gateways `10.244.i.1` and `fd00:10:244:i::1`
/// (returned), and forwarding on in both families.
fn add_pod_bridge(netns: &str, i: usize) -> Result<Ipv6Addr> {
    ip_in(
        netns,
        &["link", "add", "cbr0", "type", "bridge", "mcast_snooping", "0"],
    )?;
    ip_in(
        netns,
        &["addr", "add", &format!("10.244.{i}.1/24"), "dev", "cbr0"],
    )?;
    let gateway6 = v6(format!("fd00:10:244:{i}::1"))?;
    ip6_in(
        netns,
        &["addr", "add", &format!("{gateway6}/64"), "dev", "cbr0", "nodad"],
    )?;
    ip_in(netns, &["link", "set", "cbr0", "up"])?;
    sysctl_in(netns, "net.ipv4.ip_forward", "1")?;
    sysctl_in(netns, "net.ipv6.conf.all.forwarding", "1")?;
    Ok(gateway6)
}

impl Cluster {
    /// Creates `nodes` node namespaces with `pods_per_node` pods each, and forwards the fabric's
    /// apiserver address to `apiserver_port` on the root namespace's loopback.
    pub fn create(nodes: usize, pods_per_node: usize, apiserver_port: u16) -> Result<Self> {
        sweep::sweep_leftovers();
        let (pid, seq) = sweep::next_id();
        let prefix = format!("{}{pid}x{seq}", sweep::PREFIX);
        let fabric = format!("{prefix}-fabric");
        // Made before any namespace, so that dropping it on an error deletes what exists.
        let mut cluster = Cluster {
            fabric: fabric.clone(),
            nodes: Vec::new(),
            all_netns: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            forwarder: None,
        };
        cluster.add_fabric()?;
        for i in 1..=nodes {
            let node = cluster.add_node(&prefix, i, pods_per_node)?;
            cluster.nodes.push(node);
        }
        cluster.add_host_gw_routes()?;
        cluster.start_forwarder(apiserver_port)?;
        Ok(cluster)
    }

    /// The fabric namespace: bridge `br0` with the fabric addresses, forwarding both families.
    fn add_fabric(&mut self) -> Result<()> {
        let fabric = self.fabric.clone();
        self.add_netns(&fabric)?;
        ip_in(
            &fabric,
            &["link", "add", "br0", "type", "bridge", "mcast_snooping", "0"],
        )?;
        ip_in(
            &fabric,
            &[
                "addr",
                "add",
                &format!("{}/24", controlplane::ADVERTISE_ADDRESS),
                "dev",
                "br0",
            ],
        )?;
        ip6_in(
            &fabric,
            &["addr", "add", &format!("{FABRIC_IP6}/64"), "dev", "br0", "nodad"],
        )?;
        ip_in(&fabric, &["link", "set", "br0", "up"])?;
        sysctl_in(&fabric, "net.ipv4.ip_forward", "1")?;
        sysctl_in(&fabric, "net.ipv6.conf.all.forwarding", "1")?;
        Ok(())
    }

    /// Node `i`: its namespace on the fabric, its pod bridge, the fabric's routes to its pod
    /// CIDRs, and its pods.
    fn add_node(&mut self, prefix: &str, i: usize, pods_per_node: usize) -> Result<Node> {
        let name = format!("node-{i}");
        let netns = format!("{prefix}-{name}");
        let ip = Ipv4Addr::new(10, 250, 0, 10 + i as u8);
        let ip6 = v6(format!("fd00:10:250::{}", 10 + i))?;
        self.add_netns(&netns)?;
        self.attach_node_to_fabric(&netns, i, ip, ip6)?;
        let gateway6 = add_pod_bridge(&netns, i)?;
        let pod_cidr = format!("10.244.{i}.0/24");
        let pod_cidr6 = format!("fd00:10:244:{i}::/64");
        ip_in(&self.fabric, &["route", "add", &pod_cidr, "via", &ip.to_string()])?;
        ip6_in(
            &self.fabric,
            &["route", "add", &pod_cidr6, "via", &ip6.to_string()],
        )?;
        let mut node = Node {
            name,
            netns,
            ip,
            ip6,
            pod_cidr,
            pod_cidr6,
            pods: Vec::new(),
        };
        for k in 1..=pods_per_node {
            let pod = self.add_pod(&node, i, k, gateway6)?;
            node.pods.push(pod);
        }
        Ok(node)
    }

    /// The node's `eth0`: a veth to the fabric bridge with the node addresses and default
    /// routes via the fabric.
    fn attach_node_to_fabric(&self, netns: &str, i: usize, ip: Ipv4Addr, ip6: Ipv6Addr) -> Result<()> {
        let fabric = &self.fabric;
        let port = format!("n{i}");
        ip_in(
            fabric,
            &[
                "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", netns,
            ],
        )?;
        ip_in(fabric, &["link", "set", &port, "master", "br0", "up"])?;
        ip_in(netns, &["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        ip6_in(
            netns,
            &["addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"],
        )?;
        ip_in(netns, &["link", "set", "eth0", "up"])?;
        ip_in(
            netns,
            &[
                "route",
                "add",
                "default",
                "via",
                &controlplane::ADVERTISE_ADDRESS.to_string(),
            ],
        )?;
        ip6_in(
            netns,
            &["route", "add", "default", "via", &FABRIC_IP6.to_string()],
        )?;
        Ok(())
    }

    /// Pod `k` of node `i`: a veth to the node's pod bridge (hairpin on) with the pod addresses
    /// and default routes via the bridge.
    fn add_pod(&mut self, node: &Node, i: usize, k: usize, gateway6: Ipv6Addr) -> Result<Pod> {
        let netns = &node.netns;
        let pod_ns = format!("{netns}-p{k}");
        let pod_ip = Ipv4Addr::new(10, 244, i as u8, 10 + k as u8);
        let pod_ip6 = v6(format!("fd00:10:244:{i}::{}", 10 + k))?;
        self.add_netns(&pod_ns)?;
        let port = format!("p{k}");
        ip_in(
            netns,
            &[
                "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &pod_ns,
            ],
        )?;
        ip_in(netns, &["link", "set", &port, "master", "cbr0", "up"])?;
        // As CNI bridge plugins do (hairpinMode): with br_netfilter, a pod reaching itself
        // through a Service is bridged back out of the port it came in on.
        ip_in(
            netns,
            &["link", "set", &port, "type", "bridge_slave", "hairpin", "on"],
        )?;
        ip_in(&pod_ns, &["addr", "add", &format!("{pod_ip}/24"), "dev", "eth0"])?;
        ip6_in(
            &pod_ns,
            &["addr", "add", &format!("{pod_ip6}/64"), "dev", "eth0", "nodad"],
        )?;
        ip_in(&pod_ns, &["link", "set", "eth0", "up"])?;
        ip_in(
            &pod_ns,
            &["route", "add", "default", "via", &format!("10.244.{i}.1")],
        )?;
        ip6_in(
            &pod_ns,
            &["route", "add", "default", "via", &gateway6.to_string()],
        )?;
        Ok(Pod {
            name: format!("{}-pod-{k}", node.name),
            netns: pod_ns,
            ip: pod_ip,
            ip6: pod_ip6,
        })
    }

    /// host-gw routes between nodes: each node reaches the others' pod CIDRs via their node IPs.
    fn add_host_gw_routes(&self) -> Result<()> {
        for a in &self.nodes {
            for b in self.nodes.iter().filter(|b| b.name != a.name) {
                ip_in(&a.netns, &["route", "add", &b.pod_cidr, "via", &b.ip.to_string()])?;
                ip6_in(
                    &a.netns,
                    &["route", "add", &b.pod_cidr6, "via", &b.ip6.to_string()],
                )?;
            }
        }
        Ok(())
    }

    fn add_netns(&mut self, name: &str) -> Result<()> {
        run("ip", &["netns", "add", name])?;
        self.all_netns.push(name.to_owned());
        // Before any interface exists here, so every one (link-local addresses too) inherits it.
        sysctl_in(name, "net.ipv6.conf.all.accept_dad", "0")?;
        sysctl_in(name, "net.ipv6.conf.default.accept_dad", "0")?;
        ip_in(name, &["link", "set", "lo", "up"])?;
        Ok(())
    }

    /// Listens on the fabric's apiserver address and forwards each connection to the apiserver.
    fn start_forwarder(&mut self, apiserver_port: u16) -> Result<()> {
        // Same port as the apiserver's: the `default/kubernetes` EndpointSlice names it.
        let listener = listen_in_netns(
            &self.fabric,
            SocketAddrV4::new(controlplane::ADVERTISE_ADDRESS, apiserver_port),
        )?;
        listener
            .set_nonblocking(true)
            .map_err(io_err("nonblocking listener"))?;
        let stop = self.stop.clone();
        self.forwarder = Some(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((inbound, _)) => {
                        let _ = inbound.set_nonblocking(false);
                        // Runs in the root namespace: the connection goes to its loopback only.
                        if let Ok(outbound) = TcpStream::connect(("127.0.0.1", apiserver_port)) {
                            pipe(inbound, outbound);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }));
        Ok(())
    }

    /// Runs a command inside a namespace and returns stdout.
    pub fn exec(netns: &str, args: &[&str]) -> Result<String> {
        let mut full = vec!["netns", "exec", netns];
        full.extend_from_slice(args);
        run("ip", &full)
    }
}

/// Copies bytes both ways until either side closes.
fn pipe(a: TcpStream, b: TcpStream) {
    for (mut from, mut to) in [(a.try_clone(), b.try_clone()), (b.try_clone(), a.try_clone())]
        .into_iter()
        .filter_map(|(x, y)| Some((x.ok()?, y.ok()?)))
    {
        std::thread::spawn(move || {
            let mut buf = [0u8; 16 * 1024];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = to.shutdown(std::net::Shutdown::Write);
        });
    }
}

/// Binds a TCP listener inside `netns`: this thread enters it, binds, and returns to its own
/// namespace. The socket stays in the namespace it was made in.
fn listen_in_netns(netns: &str, addr: SocketAddrV4) -> Result<TcpListener> {
    let netns = netns.to_owned();
    std::thread::spawn(move || -> Result<TcpListener> {
        let own = File::open("/proc/thread-self/ns/net").map_err(io_err("open own netns"))?;
        let target =
            File::open(format!("/run/netns/{netns}")).map_err(io_err(format!("open netns {netns}")))?;
        setns(target.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Prerequisite(format!("setns {netns}: {e}")))?;
        let listener = TcpListener::bind(addr).map_err(io_err(format!("bind {addr} in {netns}")));
        setns(own.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Prerequisite(format!("setns back: {e}")))?;
        listener
    })
    .join()
    .map_err(|_| Error::Prerequisite("netns thread panicked".into()))?
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.forwarder.take() {
            let _ = handle.join();
        }
        for ns in self.all_netns.iter().rev() {
            // Processes still inside (agents, servers) were started by this harness.
            if let Ok(pids) = run("ip", &["netns", "pids", ns]) {
                for p in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(p),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            let _ = run("ip", &["netns", "del", ns]);
        }
    }
}
