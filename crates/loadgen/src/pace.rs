//! Precise pacing of an open-loop schedule.
//!
//! tokio's own timer has a 1 ms granularity: a schedule kept with it sends requests in bursts
//! (every request due within the same millisecond goes out at once, up to a millisecond late).
//! A [`Pacer`] sleeps until absolute deadlines instead, in one of two ways:
//!
//! - [`PaceMode::Timer`]: a one-shot `timerfd` (CLOCK_MONOTONIC, the clock [`Instant`] uses)
//!   armed for each deadline and read through the runtime's epoll ([`AsyncFd`]), so a wake-up is
//!   microsecond-precise and the thread sleeps in between. It works on any tokio runtime with
//!   I/O enabled, current-thread or multi-thread. (Off Linux it falls back to tokio's timer.)
//! - [`PaceMode::Spin`]: busy-polling the clock, yielding to the runtime between looks (for a
//!   generator pinned to a core of its own: no wake-up from idle delays a send or the reading
//!   of a response, which on a VM costs tens of µs). It also counts the stalls of the core:
//!   gaps over [`STALL`] between two looks at the clock.
//!
//! A pacer keeps one schedule: its sleeps are sequential (`&mut self`).

use std::time::{Duration, Instant};

/// A gap in the spin loop longer than this is a stall of the generator's core.
pub const STALL: Duration = Duration::from_micros(200);

/// How a [`Pacer`] waits for a deadline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PaceMode {
    /// Sleep on a one-shot timerfd (microsecond wake-ups).
    #[default]
    Timer,
    /// Busy-poll the clock, yielding to the runtime, and count stalls.
    Spin,
}

/// Sleeps until absolute deadlines with microsecond precision; see the module docs.
#[derive(Debug)]
pub struct Pacer {
    mode: PaceMode,
    #[cfg(target_os = "linux")]
    timer: timerfd::TimerFd,
    stalls: u64,
    stalled: Duration,
}

impl Pacer {
    /// A pacer waiting in `mode`.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime with I/O enabled (the timerfd registers with its reactor).
    pub fn new(mode: PaceMode) -> std::io::Result<Self> {
        Ok(Self {
            mode,
            #[cfg(target_os = "linux")]
            timer: timerfd::TimerFd::new()?,
            stalls: 0,
            stalled: Duration::ZERO,
        })
    }

    /// The mode it waits in.
    pub fn mode(&self) -> PaceMode {
        self.mode
    }

    /// Core stalls seen while spinning: how many, and their total length (zero with
    /// [`PaceMode::Timer`]).
    pub fn stalls(&self) -> (u64, Duration) {
        (self.stalls, self.stalled)
    }

    /// Returns at `deadline` or (by the wake-up latency) just after it, never before; at once
    /// if it has passed.
    pub async fn sleep_until(&mut self, deadline: Instant) -> std::io::Result<()> {
        let now = Instant::now();
        if now >= deadline {
            return Ok(());
        }
        match self.mode {
            PaceMode::Spin => {
                // Busy-poll: each yield lets the runtime poll its sockets (epoll with a zero
                // timeout), so neither the schedule nor the responses wait for a wake-up from
                // idle.
                let mut last = now;
                while last < deadline {
                    tokio::task::yield_now().await;
                    let now = Instant::now();
                    let gap = now - last;
                    if gap > STALL {
                        self.stalls += 1;
                        self.stalled += gap;
                    }
                    last = now;
                }
                Ok(())
            }
            #[cfg(target_os = "linux")]
            PaceMode::Timer => self.timer.sleep(deadline - now).await,
            #[cfg(not(target_os = "linux"))]
            PaceMode::Timer => {
                tokio::time::sleep_until(deadline.into()).await;
                Ok(())
            }
        }
    }
}

/// Lowers this thread's timer slack to 1 ns, so the runtime's own epoll timeouts wake it up
/// precisely too (the pacer does not depend on it). Linux only; elsewhere it does nothing.
pub fn precise_timer_slack() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain prctl with integer arguments.
        let rc = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(target_os = "linux")]
mod timerfd {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::time::Duration;

    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;

    /// CLOCK_MONOTONIC in nanoseconds (the clock `Instant` and the timerfd use).
    fn now_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid out-pointer to a timespec.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    /// A one-shot timerfd armed for each deadline, read through the runtime's epoll.
    #[derive(Debug)]
    pub(super) struct TimerFd {
        fd: AsyncFd<OwnedFd>,
    }

    impl TimerFd {
        pub(super) fn new() -> io::Result<Self> {
            // SAFETY: plain syscall; the result is checked before it is owned.
            let raw = unsafe {
                libc::timerfd_create(
                    libc::CLOCK_MONOTONIC,
                    libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
                )
            };
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `raw` is a fresh descriptor that nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // SAFETY: the descriptor is owned by the `AsyncFd` and stays open as long as it.
            let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
            Ok(Self { fd })
        }

        /// Sleeps for `left` from an `Instant` read just before the call.
        pub(super) async fn sleep(&self, left: Duration) -> io::Result<()> {
            // `Instant` does not expose its CLOCK_MONOTONIC reading: the clock read now is at or
            // after the caller's `Instant`, so this deadline is at or after the asked one (by the
            // nanoseconds between the two reads), never before it.
            let left_ns = u64::try_from(left.as_nanos()).unwrap_or(u64::MAX / 2);
            let deadline_ns = now_ns().saturating_add(left_ns);
            let spec = libc::itimerspec {
                it_interval: libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                },
                it_value: libc::timespec {
                    tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
                    tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
                },
            };
            // SAFETY: valid descriptor and itimerspec; old value not requested.
            let rc = unsafe {
                libc::timerfd_settime(
                    self.fd.as_raw_fd(),
                    libc::TFD_TIMER_ABSTIME,
                    &spec,
                    std::ptr::null_mut(),
                )
            };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
            loop {
                let mut guard = self.fd.readable().await?;
                let read = guard.try_io(|fd| {
                    let mut expirations = 0u64;
                    // SAFETY: reads 8 bytes into a u64.
                    let n = unsafe {
                        libc::read(fd.as_raw_fd(), (&mut expirations as *mut u64).cast(), 8)
                    };
                    if n < 0 {
                        Err(io::Error::last_os_error())
                    } else {
                        Ok(())
                    }
                });
                match read {
                    Ok(r) => return r,
                    Err(_would_block) => continue,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sleeps to a series of close deadlines; none returns early.
    async fn never_early(mode: PaceMode) {
        let mut p = Pacer::new(mode).unwrap();
        assert_eq!(p.mode(), mode);
        let start = Instant::now();
        for i in 1..=50u32 {
            let deadline = start + Duration::from_micros(137) * i;
            p.sleep_until(deadline).await.unwrap();
            let now = Instant::now();
            assert!(now >= deadline, "{mode:?}: woke {:?} early", deadline - now);
        }
        // One longer sleep (several of tokio's 1 ms ticks).
        let deadline = Instant::now() + Duration::from_millis(7);
        p.sleep_until(deadline).await.unwrap();
        assert!(Instant::now() >= deadline);
    }

    /// A deadline that has passed returns at once, without spinning.
    async fn past_returns_at_once(mode: PaceMode) {
        let mut p = Pacer::new(mode).unwrap();
        let past = Instant::now() - Duration::from_millis(5);
        let t = Instant::now();
        p.sleep_until(past).await.unwrap();
        p.sleep_until(t).await.unwrap();
        // Generous, for a busy machine; a spin would also count stalls.
        assert!(t.elapsed() < Duration::from_millis(20), "{:?}", t.elapsed());
        assert_eq!(p.stalls(), (0, Duration::ZERO));
    }

    #[tokio::test]
    async fn timer_sleeps_never_return_early() {
        never_early(PaceMode::Timer).await;
        past_returns_at_once(PaceMode::Timer).await;
    }

    #[tokio::test]
    async fn spin_sleeps_never_return_early() {
        never_early(PaceMode::Spin).await;
        past_returns_at_once(PaceMode::Spin).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn works_on_a_multi_thread_runtime() {
        // On a worker thread, and moved between tasks (the pacer is Send).
        let h = tokio::spawn(async {
            never_early(PaceMode::Timer).await;
            past_returns_at_once(PaceMode::Timer).await;
            never_early(PaceMode::Spin).await;
        });
        h.await.unwrap();
    }

    #[test]
    fn timer_slack() {
        precise_timer_slack().unwrap();
    }
}
