//! The one error type of the tower crate.
//!
//! None of these reaches the wrapped service's caller as an `Err`: the layer answers each with
//! an HTTP status (400 for what the request got wrong, 500 for a misconfiguration), because a
//! rate limiter in front of a service must answer every request, and never panic on one.

/// What can go wrong while the layer decides a request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request lacks what the key or the descriptors are built from (a header, the peer
    /// address).
    #[error("the request has no {what}")]
    MissingKey {
        /// What was looked for, such as `header x-api-key`.
        what: String,
    },
    /// What the key is built from is there but unusable (not UTF-8, too long, not an address).
    #[error("invalid {what}: {reason}")]
    InvalidKey {
        /// What was looked at.
        what: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The cost function asked for more than a limit can ever hold: the request could never
    /// pass, so it is refused rather than told to retry.
    #[error("the request costs {cost} tokens, more than the limit {limit} can hold ({capacity})")]
    CostTooHigh {
        /// The request's cost.
        cost: u64,
        /// The limit's name.
        limit: String,
        /// The limit's capacity.
        capacity: u64,
    },
    /// The store refused the check for a reason that is not an outage (a limit the store cannot
    /// represent, say): a configuration error.
    #[error("the store refused the check: {0}")]
    Store(#[from] tollgate::Error),
    /// The policy engine refused the check.
    #[error("the policy refused the check: {0}")]
    Policy(#[from] tollgate_policy::Error),
}

impl Error {
    /// Whether the request is at fault (answered 400) rather than the configuration (500).
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            Error::MissingKey { .. } | Error::InvalidKey { .. } | Error::CostTooHigh { .. }
        )
    }
}
