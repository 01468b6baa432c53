//! The one error type of the core crate.
//!
//! A rejection is not an error: it is a [`Decision`](crate::Decision) with `allowed == false`.
//! Errors are for requests that cannot be decided at all (bad parameters, a cost the bucket can
//! never hold), and none of them changes any state.

/// Everything that can go wrong when building a limit or asking for a decision.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A rate string that does not parse, such as `10/x`.
    #[error("invalid rate {text:?}: {reason}")]
    InvalidRate {
        /// The offending text (at most 64 characters of it).
        text: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A refill rate of zero tokens.
    #[error("refill amount must be greater than zero")]
    ZeroRefill,
    /// A refill period of zero.
    #[error("refill period must be greater than zero")]
    ZeroPeriod,
    /// A bucket that can hold no token.
    #[error("capacity must be greater than zero")]
    ZeroCapacity,
    /// Parameters the exact arithmetic cannot represent: a reduced rate of 2^32 tokens per
    /// nanosecond or more, or a bucket that takes longer than about 146 years to fill.
    #[error(
        "limit out of range: the refill rate must stay below 2^32 tokens per nanosecond and an \
         empty bucket must fill within 146 years"
    )]
    LimitTooLarge,
    /// Window-limit parameters a window cannot hold (see [`Limit::sliding_window`]).
    ///
    /// [`Limit::sliding_window`]: crate::Limit::sliding_window
    #[error("invalid window limit: {reason}")]
    InvalidWindow {
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// Concurrency-limit parameters out of range (see [`LeaseLimit::new`]).
    ///
    /// [`LeaseLimit::new`]: crate::LeaseLimit::new
    #[error("invalid concurrency limit: {reason}")]
    InvalidLease {
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// A lease id that is empty, too long, or not made of ASCII letters, digits, `-` and `_`
    /// (see [`check_lease_id`](crate::check_lease_id)).
    #[error(
        "lease id must be 1 to 64 characters of ASCII letters, digits, '-' and '_' (got {len} bytes)"
    )]
    InvalidLeaseId {
        /// Its length in bytes.
        len: usize,
    },
    /// An acquire under a lease id that is still held.
    #[error("lease id is already held")]
    LeaseIdInUse,
    /// The in-process lease table holds as many live leases as it may.
    #[error("the lease table is full ({max} leases held); try again when some end")]
    TooManyLeases {
        /// The table's bound.
        max: usize,
    },
    /// A cost of zero, or more than the bucket can ever hold (it would wait forever).
    #[error("cost {cost} is invalid: it must be between 1 and the capacity ({capacity})")]
    InvalidCost {
        /// The cost asked for.
        cost: u64,
        /// The capacity of the bucket it was asked of.
        capacity: u64,
    },
    /// The same key twice in one all-or-nothing check.
    #[error("the key at position {index} appears twice in one check")]
    DuplicateKey {
        /// Position of the second occurrence.
        index: usize,
    },
    /// A multi-limit check with nothing in it.
    #[error("a check must name at least one bucket")]
    EmptyCheck,
    /// A retried `request_id` whose key set or costs differ from the first attempt's.
    #[error("request id was already used for a different check")]
    IdempotencyConflict,
    /// A settlement that cannot be made: it names no request id, gives back more than a bucket
    /// was charged, or does not give one amount per bucket (see [`Store::settle`]).
    ///
    /// [`Store::settle`]: crate::Store::settle
    #[error("invalid settlement: {reason}")]
    InvalidSettlement {
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// A `request_id` that is empty or longer than [`MAX_REQUEST_ID_BYTES`](crate::MAX_REQUEST_ID_BYTES).
    #[error("request id must be 1 to 256 bytes long, not {len}")]
    InvalidRequestId {
        /// Its length in bytes.
        len: usize,
    },
    /// A limit this store cannot decide exactly (Redis, for one, computes in doubles and
    /// refuses limits whose figures would pass 2^53).
    #[error("this store cannot represent the limit exactly: {reason}")]
    UnsupportedLimit {
        /// Which bound it passes.
        reason: &'static str,
    },
    /// An operation this store does not offer (see [`Store::reset`]).
    ///
    /// [`Store::reset`]: crate::Store::reset
    #[error("this store cannot {operation}")]
    Unsupported {
        /// The operation, as a verb: `reset`.
        operation: &'static str,
    },
    /// The store could not decide: its state is out of reach. Not a rejection.
    #[error("store unavailable: {reason}")]
    StoreUnavailable {
        /// Why.
        reason: Unavailable,
    },
}

impl Error {
    /// Whether trying again later may succeed: true only for store failures.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::StoreUnavailable { .. })
    }
}

/// Why a store could not decide. A closed set, so it can label metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum Unavailable {
    /// No answer within the store's timeout.
    #[error("timeout")]
    Timeout,
    /// The connection failed or could not be made, or it leads to a store that refuses every
    /// call for now (a Redis replica, a dataset still loading, memory full, ...).
    #[error("connection")]
    Connection,
    /// The circuit breaker is open: the store failed recently and is not being waited on.
    #[error("circuit_open")]
    CircuitOpen,
    /// The store answered something that is not a decision.
    #[error("protocol")]
    Protocol,
    /// The store's script failed.
    #[error("script")]
    Script,
}

impl Unavailable {
    /// A stable lowercase name, for metric labels and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Unavailable::Timeout => "timeout",
            Unavailable::Connection => "connection",
            Unavailable::CircuitOpen => "circuit_open",
            Unavailable::Protocol => "protocol",
            Unavailable::Script => "script",
        }
    }
}
