//! The backend conformance kit, shared by every backend's tests: one fixture builder
//! ([`fixtures`]), one golden-file helper ([`golden`]), one network-namespace helper ([`netns`]),
//! and the generic suite ([`suite`]) that every backend must pass, against its fake adapters
//! without root and against the kernel in throwaway network namespaces as root.

pub mod fixtures;
pub mod golden;
pub mod netns;
pub mod suite;
