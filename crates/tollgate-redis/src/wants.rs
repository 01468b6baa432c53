//! A board of wants per global bucket: processes in several regions that share one limit each
//! post how many of its tokens they want, and read everyone else's, so that each can size a
//! fair share of the limit without asking Redis on every request.
//!
//! A bucket's board is one hash at `PREFIX wants:KEY` (a key's `{hash tag}` keeps it in the
//! bucket's cluster slot), field the participant, value its tokens and the millisecond its
//! want expires on Redis' `TIME`. `scripts/wants.lua` posts a want in one atomic step: drop the
//! expired wants, set (or, for zero tokens, remove) this participant's, expire the hash with
//! its longest live want, and reply every live want. A participant that stops posting (a
//! process that died, a region cut off) drops off the board when its want expires, and an
//! abandoned board disappears: nobody has to clean up after a process that cannot.
//!
//! Posts go through the store's timeout and circuit breaker like decisions do, so a dead or
//! slow Redis comes back as [`Error::StoreUnavailable`]. A post that times out after Redis ran
//! it has still been recorded; posting again is harmless (the last post counts).
//!
//! Besides the commands buckets use, a least-privileged Redis user needs `+hgetall +hset +hdel
//! +pexpire` for wants.

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Cmd, ErrorKind, ServerErrorKind, Value};
use tollgate::{Error, Unavailable};

use crate::store::{RedisStore, classify};

/// One participant's want, as the board holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    /// Who wants the tokens, as it named itself when it posted.
    pub participant: String,
    /// How many tokens of the bucket it wants.
    pub tokens: u64,
}

/// The most tokens a want may name: 2^53 - 1, the largest integer Lua's doubles hold exactly.
pub const MAX_WANT_TOKENS: u64 = (1 << 53) - 1;

/// The longest a want may live: a day. A want is renewed by posting again, far more often than
/// that; the bound keeps a board's expiry from outliving a forgotten participant for long.
pub const MAX_WANT_TTL: Duration = Duration::from_secs(24 * 3600);

/// The script, as Redis is sent it: hashed once per process, as `EVALSHA` names it by its
/// SHA1.
struct WantsScript {
    source: &'static str,
    sha: String,
}

static SCRIPT: LazyLock<WantsScript> = LazyLock::new(|| {
    let source = include_str!("../scripts/wants.lua");
    WantsScript {
        source,
        sha: redis::Script::new(source).get_hash().to_owned(),
    }
});

/// What the script replied for a board.
#[derive(Debug, PartialEq, Eq)]
enum Board {
    /// Every live want, sorted by participant.
    Wants(Vec<Want>),
    /// The key holds something that is not a board (another program's, or corrupted), or a
    /// participant that is not UTF-8 (no tollgate wrote it): Redis answered, but the board
    /// cannot be read.
    Unreadable,
}

impl Board {
    /// The script's reply: `{ 1, participant, tokens, ... }` or `{ -2 }`. `None` for anything
    /// else, which the script never sends.
    fn parse(value: Value) -> Option<Self> {
        let Value::Array(items) = value else {
            return None;
        };
        let mut items = items.into_iter();
        match items.next()? {
            Value::Int(1) => {}
            Value::Int(-2) if items.len() == 0 => return Some(Board::Unreadable),
            _ => return None,
        }
        if items.len() % 2 != 0 {
            return None;
        }
        let mut wants = Vec::with_capacity(items.len() / 2);
        let mut foreign = false;
        while let (Some(participant), Some(tokens)) = (items.next(), items.next()) {
            let (Value::BulkString(participant), Value::Int(tokens)) = (participant, tokens) else {
                return None;
            };
            let tokens = u64::try_from(tokens)
                .ok()
                .filter(|tokens| (1..=MAX_WANT_TOKENS).contains(tokens))?;
            match String::from_utf8(participant) {
                Ok(participant) => wants.push(Want {
                    participant,
                    tokens,
                }),
                Err(_) => foreign = true,
            }
        }
        if foreign {
            return Some(Board::Unreadable);
        }
        wants.sort_unstable_by(|a, b| a.participant.cmp(&b.participant));
        Some(Board::Wants(wants))
    }
}

/// `ttl` as the script takes it: whole milliseconds, rounded up (a want lives at least as long
/// as asked), from 1 to [`MAX_WANT_TTL`].
fn ttl_ms(ttl: Duration) -> Result<u64, Error> {
    if ttl.is_zero() || ttl > MAX_WANT_TTL {
        return Err(Error::UnsupportedLimit {
            reason: "a want's ttl must be more than zero and at most a day",
        });
    }
    let ms = ttl.as_millis() + u128::from(!ttl.subsec_nanos().is_multiple_of(1_000_000));
    // At most a day's milliseconds, checked above.
    Ok(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// The script call for `board` as `verb` (`EVALSHA` with the hash, or `EVAL` with the source).
fn command(
    verb: &str,
    script: &str,
    board: &str,
    participant: &str,
    tokens: &str,
    ttl: &str,
) -> Cmd {
    let mut cmd = redis::cmd(verb);
    cmd.arg(script)
        .arg(1)
        .arg(board)
        .arg(participant)
        .arg(tokens)
        .arg(ttl);
    cmd
}

impl RedisStore {
    /// The board of bucket `key`, as stored.
    fn wants_board(&self, key: &str) -> String {
        let prefix = &self.config.prefix;
        let mut stored = String::with_capacity(prefix.len() + 6 + key.len());
        stored.push_str(prefix);
        stored.push_str("wants:");
        stored.push_str(key);
        stored
    }

    /// Records that `participant` wants `tokens` of the bucket `key` until `ttl` from now (on
    /// Redis' `TIME`), and returns every participant's live want, this one's included, sorted
    /// by participant. `tokens == 0` removes this participant's entry (it left) and returns the
    /// others'; `ttl` is then unused.
    ///
    /// A participant's post replaces its earlier one. Participants and keys may be any
    /// strings; give each process a name of its own, and the same one on every post.
    ///
    /// # Errors
    ///
    /// [`Error::UnsupportedLimit`], before any call, for `tokens` above [`MAX_WANT_TOKENS`] or,
    /// when `tokens > 0`, a `ttl` of zero or above [`MAX_WANT_TTL`].
    /// [`Error::StoreUnavailable`] when Redis cannot be reached in the store's timeout, its
    /// circuit breaker is open, or it answers something that is not a board
    /// ([`Unavailable::Script`]: the key holds something else).
    pub async fn post_want(
        &self,
        key: &str,
        participant: &str,
        tokens: u64,
        ttl: Duration,
    ) -> Result<Vec<Want>, Error> {
        if tokens > MAX_WANT_TOKENS {
            return Err(Error::UnsupportedLimit {
                reason: "a want must be at most 2^53 - 1 tokens",
            });
        }
        let ttl = if tokens == 0 { 0 } else { ttl_ms(ttl)? };
        let board = self.wants_board(key);
        let (tokens, ttl) = (tokens.to_string(), ttl.to_string());
        let work = async {
            let connection = self.link.get();
            let reply = match connection
                .query::<Value>(&command(
                    "EVALSHA",
                    &SCRIPT.sha,
                    &board,
                    participant,
                    &tokens,
                    &ttl,
                ))
                .await
            {
                // After `SCRIPT FLUSH` or a restart: the source, which also caches it in that
                // node for the next `EVALSHA`.
                Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    connection
                        .query::<Value>(&command(
                            "EVAL",
                            SCRIPT.source,
                            &board,
                            participant,
                            &tokens,
                            &ttl,
                        ))
                        .await
                }
                reply => reply,
            }
            .map_err(|err| classify(&err))?;
            match Board::parse(reply).ok_or(Unavailable::Protocol)? {
                Board::Wants(wants) => Ok(Ok(wants)),
                // Redis answered: this board's posts fail, and the breaker stays closed.
                Board::Unreadable => Ok(Err(Error::StoreUnavailable {
                    reason: Unavailable::Script,
                })),
            }
        };
        self.guarded(std::slice::from_ref(&board), work).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(text: &[u8]) -> Value {
        Value::BulkString(text.to_vec())
    }

    fn want(participant: &str, tokens: u64) -> Want {
        Want {
            participant: participant.to_owned(),
            tokens,
        }
    }

    #[test]
    fn replies_parse_into_sorted_wants() {
        let reply = Value::Array(vec![
            Value::Int(1),
            bulk("eu".as_bytes()),
            Value::Int(5),
            bulk("ap:{é}".as_bytes()),
            Value::Int(MAX_WANT_TOKENS as i64),
        ]);
        assert_eq!(
            Board::parse(reply),
            Some(Board::Wants(vec![
                want("ap:{é}", MAX_WANT_TOKENS),
                want("eu", 5)
            ]))
        );
        assert_eq!(
            Board::parse(Value::Array(vec![Value::Int(1)])),
            Some(Board::Wants(Vec::new()))
        );
        assert_eq!(
            Board::parse(Value::Array(vec![Value::Int(-2)])),
            Some(Board::Unreadable)
        );
    }

    #[test]
    fn malformed_replies_are_refused() {
        let malformed = [
            Value::Nil,
            Value::Int(1),
            bulk(b"1"),
            Value::Array(Vec::new()),
            Value::Array(vec![Value::Int(0)]),
            Value::Array(vec![Value::Int(-2), bulk(b"a")]),
            Value::Array(vec![Value::Int(1), bulk(b"a")]),
            Value::Array(vec![Value::Int(1), bulk(b"a"), bulk(b"5")]),
            Value::Array(vec![Value::Int(1), Value::Int(5), Value::Int(5)]),
            Value::Array(vec![Value::Int(1), bulk(b"a"), Value::Int(0)]),
            Value::Array(vec![Value::Int(1), bulk(b"a"), Value::Int(-1)]),
            Value::Array(vec![Value::Int(1), bulk(b"a"), Value::Int(1 << 53)]),
        ];
        for reply in malformed {
            assert_eq!(Board::parse(reply.clone()), None, "{reply:?}");
        }
        // Redis answered, with a participant no tollgate wrote.
        let foreign = Value::Array(vec![Value::Int(1), bulk(b"\xff"), Value::Int(1)]);
        assert_eq!(Board::parse(foreign), Some(Board::Unreadable));
    }

    #[test]
    fn ttls_are_whole_milliseconds_rounded_up_up_to_a_day() {
        assert_eq!(ttl_ms(Duration::from_millis(200)), Ok(200));
        assert_eq!(ttl_ms(Duration::from_nanos(1)), Ok(1));
        assert_eq!(ttl_ms(Duration::from_micros(1_500)), Ok(2));
        assert_eq!(ttl_ms(MAX_WANT_TTL), Ok(86_400_000));
        assert!(ttl_ms(Duration::ZERO).is_err());
        assert!(ttl_ms(MAX_WANT_TTL + Duration::from_nanos(1)).is_err());
    }
}
