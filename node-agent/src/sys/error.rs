//! Typed errors at the kernel boundary: what the kernel (or a kernel tool) answered, classified by
//! what callers act on (an object that is missing, one that exists already, one still in use)
//! instead of strings and raw errnos.

/// `ENOENT`.
pub const ENOENT: i32 = 2;
/// `EPERM`.
pub const EPERM: i32 = 1;
/// `EACCES`.
pub const EACCES: i32 = 13;
/// `EIO`.
pub const EIO: i32 = 5;
/// `EROFS`.
pub const EROFS: i32 = 30;
/// `EBUSY`.
pub const EBUSY: i32 = 16;
/// `EEXIST`.
pub const EEXIST: i32 = 17;
/// `EAFNOSUPPORT`.
pub const EAFNOSUPPORT: i32 = 97;
/// `EPROTONOSUPPORT`.
pub const EPROTONOSUPPORT: i32 = 93;
/// `EOPNOTSUPP`.
pub const EOPNOTSUPP: i32 = 95;

/// An error of a kernel adapter.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The object does not exist (`ENOENT`).
    #[error("{what}: no such object")]
    NotFound {
        /// What was asked for.
        what: String,
    },
    /// The object exists already, with other contents (`EEXIST`).
    #[error("{what}: exists already")]
    Exists {
        /// What was asked for.
        what: String,
    },
    /// The object is still in use (`EBUSY`): a chain that is referenced or not empty, a set a
    /// rule reads.
    #[error("{what}: still in use")]
    Busy {
        /// What was asked for.
        what: String,
    },
    /// The caller may not do this (`EPERM`, `EACCES`): not root, or a read-only namespace.
    #[error("{what}: permission denied")]
    PermissionDenied {
        /// What was asked for.
        what: String,
    },
    /// This kernel lacks the feature (`EOPNOTSUPP`, `EAFNOSUPPORT`, `EPROTONOSUPPORT`).
    #[error("{what}: not supported by this kernel")]
    Unsupported {
        /// What was asked for.
        what: String,
    },
    /// Any other refusal, with its errno (positive).
    #[error("{what}: {}", std::io::Error::from_raw_os_error(*errno))]
    Refused {
        /// What was asked for.
        what: String,
        /// The errno the kernel answered (positive).
        errno: i32,
    },
    /// The kernel's answer could not be read (a reply without the attribute asked for).
    #[error("{what}: unreadable answer from the kernel")]
    Malformed {
        /// What was asked for.
        what: String,
    },
    /// The netlink socket itself failed (open, send, receive, timeout).
    #[error(transparent)]
    Transport(#[from] crate::Error),
}

impl KernelError {
    /// The error the kernel's `errno` (positive or negative, as netlink acks carry it) means for
    /// `what`.
    pub fn from_errno(what: impl Into<String>, errno: i32) -> Self {
        let what = what.into();
        match errno.abs() {
            ENOENT => KernelError::NotFound { what },
            EEXIST => KernelError::Exists { what },
            EBUSY => KernelError::Busy { what },
            EPERM | EACCES => KernelError::PermissionDenied { what },
            EOPNOTSUPP | EAFNOSUPPORT | EPROTONOSUPPORT => KernelError::Unsupported { what },
            errno => KernelError::Refused { what, errno },
        }
    }

    /// The errno this error stands for (`None` for transport failures).
    pub fn errno(&self) -> Option<i32> {
        match self {
            KernelError::NotFound { .. } => Some(ENOENT),
            KernelError::Exists { .. } => Some(EEXIST),
            KernelError::Busy { .. } => Some(EBUSY),
            KernelError::PermissionDenied { .. } => Some(EPERM),
            KernelError::Unsupported { .. } => Some(EOPNOTSUPP),
            KernelError::Refused { errno, .. } => Some(*errno),
            KernelError::Malformed { .. } | KernelError::Transport(_) => None,
        }
    }

    /// Whether the object asked for does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, KernelError::NotFound { .. })
    }
}

/// Result of kernel adapters.
pub type KernelResult<T> = std::result::Result<T, KernelError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos_map_to_what_callers_act_on_and_back() {
        let e = |n| KernelError::from_errno("x", n);
        assert!(e(-2).is_not_found());
        assert!(matches!(e(17), KernelError::Exists { .. }));
        assert!(matches!(e(-16), KernelError::Busy { .. }));
        assert!(matches!(e(1), KernelError::PermissionDenied { .. }));
        assert!(matches!(e(95), KernelError::Unsupported { .. }));
        assert!(matches!(e(-22), KernelError::Refused { errno: 22, .. }));
        for n in [2, 17, 16, 1, 95, 22] {
            assert_eq!(e(-n).errno(), Some(n));
        }
        assert_eq!(e(-22).to_string(), "x: Invalid argument (os error 22)");
    }
}
