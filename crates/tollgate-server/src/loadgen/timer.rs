//! A one-shot timer precise to the microsecond, inside the tokio runtime: a Linux `timerfd`
//! watched by the runtime's reactor.
//!
//! The open-loop pacer wakes every 100 µs or so (`PACER_TICK` in `run.rs`), and tokio's own
//! timer wheel ticks every millisecond. A pacer on a thread of its own (the fallback elsewhere)
//! sleeps on the operating system's timer, but then each of its wake-ups wakes the runtime in
//! turn: two threads scheduled where one would do, on the cores the generator shares with the
//! server it measures. On a timer the reactor watches, the runtime's own thread wakes for the
//! tick.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::time::{
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create,
    timerfd_settime,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// A monotonic `timerfd`, registered with the current runtime's reactor.
pub(crate) struct Timer {
    fd: AsyncFd<OwnedFd>,
}

impl Timer {
    /// A disarmed timer. Must be called inside a tokio runtime.
    pub(crate) fn new() -> io::Result<Self> {
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )?;
        // Deprecated because a type whose `as_raw_fd` could change, or whose descriptor could
        // be closed while registered, would break the reactor. An `OwnedFd` can do neither:
        // its descriptor stays open and the same until the `AsyncFd` drops it. (The
        // replacement is an `unsafe` function, which this workspace forbids.)
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(fd, Interest::READABLE)?;
        Ok(Self { fd })
    }

    /// Returns once `wait` has passed (at least a nanosecond: a zero time disarms a timerfd).
    pub(crate) async fn sleep(&self, wait: Duration) -> io::Result<()> {
        let wait = wait.max(Duration::from_nanos(1));
        let after = Timespec {
            tv_sec: i64::try_from(wait.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(wait.subsec_nanos()),
        };
        let once = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: after,
        };
        timerfd_settime(self.fd.get_ref(), TimerfdTimerFlags::empty(), &once)?;
        loop {
            let mut ready = self.fd.readable().await?;
            // The count of expirations since the last read: one, for a one-shot timer.
            let mut expirations = [0u8; 8];
            match rustix::io::read(self.fd.get_ref(), &mut expirations) {
                Ok(_) => return Ok(()),
                // Readiness left over from an earlier expiry that was already read.
                Err(rustix::io::Errno::AGAIN) => ready.clear_ready(),
                Err(err) => return Err(err.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::time::Instant;

    use super::*;

    #[tokio::test]
    async fn a_sleep_lasts_at_least_the_time_asked_again_and_again() {
        let timer = Timer::new().expect("a timerfd");
        for wait in [
            Duration::from_micros(200),
            Duration::ZERO,
            Duration::from_millis(3),
        ] {
            let start = Instant::now();
            timer.sleep(wait).await.expect("the timer");
            assert!(start.elapsed() >= wait, "{wait:?}");
        }
    }
}
