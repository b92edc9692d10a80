//! Kernel adapters: the only code in the agent that opens netlink sockets, runs commands or reads
//! kernel files. Everything above this layer is pure.

pub mod exec;
pub mod netlink;
pub mod conntrack;
pub mod nft;
pub mod genl;
pub mod host;
pub mod iptables;
pub mod ipset;
pub mod ipvs;
pub mod link;
