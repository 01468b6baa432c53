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

#[cfg(test)]
mod tests {
    use envoy_types::pb::google::protobuf::Duration as ProtoDuration;

    use super::*;

    fn id(pairs: impl IntoIterator<Item = (String, String)>) -> Option<BucketId> {
        Some(BucketId {
            bucket: pairs.into_iter().collect(),
        })
    }

    fn refused(id: Option<BucketId>) -> String {
        match entries(3, id) {
            Ok(entries) => panic!("accepted {entries:?}"),
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::InvalidArgument);
                status.message().to_owned()
            }
        }
    }

    #[test]
    fn a_bucket_id_is_held_to_the_bounds_of_every_api_and_sorted() {
        let pair = |name: &str, value: &str| (name.to_owned(), value.to_owned());
        assert_eq!(
            entries(0, id([pair("b", "1"), pair("a", "")])).ok(),
            Some(vec![pair("a", ""), pair("b", "1")])
        );
        let many = |count: usize| id((0..count).map(|i| (format!("e{i}"), String::new())));
        assert_eq!(
            entries(0, many(MAX_ENTRIES)).map(|e| e.len()).ok(),
            Some(MAX_ENTRIES)
        );
        assert!(refused(many(MAX_ENTRIES + 1)).starts_with("bucket_quota_usages[3]: "));
        assert!(refused(many(0)).contains("1 to 32 entries"));
        assert!(refused(None).contains("1 to 32 entries"));
        let name = "n".repeat(MAX_NAME_BYTES);
        assert!(entries(0, id([pair(&name, "v")])).is_ok());
        let long = refused(id([pair(&format!("{name}n"), "v")]));
        assert!(long.contains("names must be 1 to 256 bytes"), "{long}");
        assert!(refused(id([pair("", "v")])).contains("names must be 1 to 256 bytes"));
        let value = "v".repeat(MAX_VALUE_BYTES);
        assert!(entries(0, id([pair("n", &value)])).is_ok());
        let long = refused(id([pair("n", &format!("{value}v"))]));
        assert!(long.contains("values must be at most 1024 bytes"), "{long}");
    }

    #[test]
    fn time_elapsed_is_a_duration_that_is_neither_negative_nor_malformed() {
        let usage = |seconds, nanos| BucketQuotaUsage {
            time_elapsed: Some(ProtoDuration { seconds, nanos }),
            ..BucketQuotaUsage::default()
        };
        assert_eq!(elapsed(0, &BucketQuotaUsage::default()).ok(), Some(None));
        assert_eq!(elapsed(0, &usage(0, 0)).ok(), Some(None));
        assert_eq!(
            elapsed(0, &usage(2, 999_999_999)).ok(),
            Some(Some(Duration::new(2, 999_999_999)))
        );
        assert_eq!(
            elapsed(0, &usage(0, 1)).ok(),
            Some(Some(Duration::from_nanos(1)))
        );
        for (seconds, nanos, says) in [
            (-1, 0, "must not be negative"),
            (0, -1, "must not be negative"),
            (1, 1_000_000_000, "nanos must be below a second"),
        ] {
            let status = elapsed(5, &usage(seconds, nanos)).expect_err("refused");
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(
                status
                    .message()
                    .starts_with("bucket_quota_usages[5]: time_elapsed"),
                "{status:?}"
            );
            assert!(status.message().contains(says), "{status:?}");
        }
    }
}
