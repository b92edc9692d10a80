//! nftables backend (in progress).
