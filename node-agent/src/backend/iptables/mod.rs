//! iptables backend (in progress).
