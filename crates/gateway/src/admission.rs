//! Admission control: when every candidate is saturated, a request waits in a bounded queue
//! for capacity until its deadline, then gets 429 with `Retry-After`.
//!
//! Waiters are woken whenever capacity may have appeared (a request ended, a scrape landed, a
//! backend was readmitted) and simply route again; the queue is a count, not a list, because the
//! router decides who fits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// The queue.
#[derive(Default)]
pub struct Admission {
    waiting: AtomicUsize,
    notify: Notify,
}

/// A place in the queue; leaving it (drop) frees it.
pub struct Place<'a> {
    admission: &'a Admission,
    gauge: &'a prometheus_client::metrics::gauge::Gauge,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.admission.waiting.fetch_sub(1, Ordering::AcqRel);
        self.gauge.dec();
    }
}

/// Longest wait between re-checks even without a wake-up (a safety net, e.g. for scraped
/// queue lengths that fall without any request ending here).
const RECHECK: Duration = Duration::from_millis(100);

impl Admission {
    /// Takes a place if fewer than `max` are waiting.
    pub fn enter<'a>(
        &'a self,
        max: usize,
        gauge: &'a prometheus_client::metrics::gauge::Gauge,
    ) -> Option<Place<'a>> {
        let mut current = self.waiting.load(Ordering::Acquire);
        loop {
            if current >= max {
                return None;
            }
            match self.waiting.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    gauge.inc();
                    return Some(Place {
                        admission: self,
                        gauge,
                    });
                }
                Err(seen) => current = seen,
            }
        }
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wakes every waiter to route again (cheap when nobody waits).
    pub fn wake(&self) {
        if !self.is_empty() {
            self.notify.notify_waiters();
        }
    }

    /// Waits for a wake-up, at most until `deadline` and at most [`RECHECK`].
    /// Returns false once the deadline has passed.
    pub async fn wait(&self, deadline: tokio::time::Instant) -> bool {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return false;
        }
        let until = deadline.min(now + RECHECK);
        let _ = tokio::time::timeout_at(until, self.notify.notified()).await;
        tokio::time::Instant::now() < deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::gauge::Gauge;

    #[test]
    fn the_queue_is_bounded() {
        let a = Admission::default();
        let g = Gauge::default();
        let p1 = a.enter(2, &g).unwrap();
        let _p2 = a.enter(2, &g).unwrap();
        assert!(a.enter(2, &g).is_none());
        assert_eq!(g.get(), 2);
        drop(p1);
        assert_eq!(a.len(), 1);
        assert!(a.enter(2, &g).is_some());
        assert!(a.enter(0, &g).is_none());
    }

    #[tokio::test]
    async fn waiters_wake_or_time_out() {
        let a = std::sync::Arc::new(Admission::default());
        let g = Gauge::default();
        let _p = a.enter(1, &g).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.wait(deadline).await })
        };
        tokio::task::yield_now().await;
        a.wake();
        assert!(waiter.await.unwrap());
        let past = tokio::time::Instant::now();
        assert!(!a.wait(past).await);
    }
}
