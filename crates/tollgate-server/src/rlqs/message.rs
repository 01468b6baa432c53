//! The protocol's messages: reports read and checked, assignments written.
//!
//! A report is checked whole before anything is charged, against the same bounds as every
//! other API's descriptors, so that a bad one changes nothing.

use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::google::protobuf::UInt32Value;
use tonic::Status;

use crate::http::{MAX_ENTRIES, MAX_NAME_BYTES, MAX_VALUE_BYTES};

/// A bucket: its entries sorted by name, as `BucketId` entries have no order.
pub(super) type Entries = Vec<(String, String)>;

pub(super) fn invalid(message: impl Into<String>) -> Status {
    Status::invalid_argument(message.into())
}

fn duration(d: Duration) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// A bucket's entries, checked against the bounds of every other API and sorted by name.
pub(super) fn entries(index: usize, id: Option<BucketId>) -> Result<Entries, Status> {
    let bucket = id.map(|id| id.bucket).unwrap_or_default();
    if bucket.is_empty() || bucket.len() > MAX_ENTRIES {
        return Err(invalid(format!(
            "bucket_quota_usages[{index}]: a bucket_id needs 1 to {MAX_ENTRIES} entries"
        )));
    }
    let mut entries: Entries = bucket.into_iter().collect();
    for (key, value) in &entries {
        if key.is_empty() || key.len() > MAX_NAME_BYTES {
            return Err(invalid(format!(
                "bucket_quota_usages[{index}]: entry names must be 1 to {MAX_NAME_BYTES} bytes"
            )));
        }
        if value.len() > MAX_VALUE_BYTES {
            return Err(invalid(format!(
                "bucket_quota_usages[{index}]: entry values must be at most {MAX_VALUE_BYTES} bytes"
            )));
        }
    }
    entries.sort_unstable();
    Ok(entries)
}

/// The reported `time_elapsed`: `None` when absent or zero.
pub(super) fn elapsed(index: usize, usage: &BucketQuotaUsage) -> Result<Option<Duration>, Status> {
    let Some(elapsed) = usage.time_elapsed else {
        return Ok(None);
    };
    let (Ok(seconds), Ok(nanos)) = (u64::try_from(elapsed.seconds), u32::try_from(elapsed.nanos))
    else {
        return Err(invalid(format!(
            "bucket_quota_usages[{index}]: time_elapsed must not be negative"
        )));
    };
    if nanos >= 1_000_000_000 {
        return Err(invalid(format!(
            "bucket_quota_usages[{index}]: time_elapsed nanos must be below a second"
        )));
    }
    let elapsed = Duration::new(seconds, nanos);
    Ok((!elapsed.is_zero()).then_some(elapsed))
}

pub(super) fn blanket(rule: BlanketRule) -> RateLimitStrategy {
    RateLimitStrategy {
        strategy: Some(Strategy::BlanketRule(rule as i32)),
    }
}

pub(super) fn token_bucket(rate: u32, fill: Duration) -> RateLimitStrategy {
    RateLimitStrategy {
        strategy: Some(Strategy::TokenBucket(TokenBucket {
            max_tokens: rate,
            tokens_per_fill: Some(UInt32Value { value: rate }),
            fill_interval: Some(duration(fill)),
        })),
    }
}

pub(super) fn quota(strategy: RateLimitStrategy, ttl: Duration) -> Action {
    Action::QuotaAssignmentAction(QuotaAssignmentAction {
        assignment_time_to_live: Some(duration(ttl)),
        rate_limit_strategy: Some(strategy),
    })
}
