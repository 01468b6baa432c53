//! Flags every process sharing the store reads: settings an operator changes once for a whole
//! fleet rather than instance by instance, such as the incident switch that puts every limit
//! in shadow mode.
//!
//! A flag is one string at `PREFIX flag:NAME`, set and cleared by one process and read by
//! every process on its own schedule, so a change reaches the fleet within one read interval
//! without any process knowing the others. Reads and writes go through the store's timeout
//! and circuit breaker like decisions do: a dead Redis answers [`Error::StoreUnavailable`],
//! and a reader keeps what it last read.
//!
//! Besides the commands buckets use, a least-privileged Redis user needs `+get +set +del` for
//! flags.

use redis::Value;
use tollgate::{Error, Unavailable};

use crate::store::{RedisStore, classify};

/// The longest a flag's name or value may be: flags are short settings, and a bound keeps a
/// reader's allocation small whatever was written.
pub const MAX_FLAG_BYTES: usize = 4096;

impl RedisStore {
    /// The value of flag `name`, or `None` when it is not set.
    ///
    /// # Errors
    ///
    /// [`Error::StoreUnavailable`] when Redis cannot answer in time, or answers with something
    /// other than a string of at most [`MAX_FLAG_BYTES`].
    pub async fn read_flag(&self, name: &str) -> Result<Option<String>, Error> {
        let key = self.flag_key(name)?;
        let work = async {
            let mut cmd = redis::cmd("GET");
            cmd.arg(&key);
            let reply = self
                .link
                .get()
                .query::<Value>(&cmd)
                .await
                .map_err(|err| classify(&err))?;
            Ok(match reply {
                Value::Nil => Ok(None),
                Value::BulkString(bytes) if bytes.len() <= MAX_FLAG_BYTES => {
                    String::from_utf8(bytes)
                        .map(Some)
                        .map_err(|_| Error::StoreUnavailable {
                            reason: Unavailable::Protocol,
                        })
                }
                _ => Err(Error::StoreUnavailable {
                    reason: Unavailable::Protocol,
                }),
            })
        };
        self.guarded(std::slice::from_ref(&key), work).await
    }

    /// Sets flag `name` to `value`, or clears it (`None`).
    ///
    /// # Errors
    ///
    /// [`Error::UnsupportedLimit`] for a name or value longer than [`MAX_FLAG_BYTES`];
    /// [`Error::StoreUnavailable`] when Redis cannot answer in time (the write may still have
    /// happened: write again).
    pub async fn write_flag(&self, name: &str, value: Option<&str>) -> Result<(), Error> {
        let key = self.flag_key(name)?;
        if value.is_some_and(|v| v.len() > MAX_FLAG_BYTES) {
            return Err(Error::UnsupportedLimit {
                reason: "a flag's value is at most 4096 bytes",
            });
        }
        let work = async {
            let cmd = match value {
                Some(value) => {
                    let mut cmd = redis::cmd("SET");
                    cmd.arg(&key).arg(value);
                    cmd
                }
                None => {
                    let mut cmd = redis::cmd("DEL");
                    cmd.arg(&key);
                    cmd
                }
            };
            self.link
                .get()
                .query::<Value>(&cmd)
                .await
                .map_err(|err| classify(&err))?;
            Ok(Ok(()))
        };
        self.guarded(std::slice::from_ref(&key), work).await
    }

    /// Flag `name` as stored.
    fn flag_key(&self, name: &str) -> Result<String, Error> {
        if name.is_empty() || name.len() > MAX_FLAG_BYTES {
            return Err(Error::UnsupportedLimit {
                reason: "a flag's name is 1 to 4096 bytes",
            });
        }
        Ok(format!("{}flag:{name}", self.config.prefix))
    }
}
