//! Admission control: when every candidate is saturated, a request waits in a bounded FIFO
//! queue for capacity until its deadline, then gets 429 with `Retry-After`.
//!
//! There is one line per model. Only its head routes again, whenever capacity may have
//! appeared (a request ended, a scrape landed, a backend was readmitted: [`Admission::wake`]
//! wakes each line's head once); when the head is admitted or leaves, the next in line gets its
//! turn at once, since more than one place may have freed up. A newcomer joins the end of a
//! non-empty line instead of routing past it, so requests are admitted in arrival order. Wake-ups
//! are never lost: each place has its own `Notify`, whose permit is kept when its owner is busy
//! routing. The router still decides who fits: the head routes exactly as a newcomer would.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use std::collections::HashMap;
use tokio::sync::Notify;

/// One waiting request.
struct Waiter {
    id: u64,
    notify: Notify,
}

/// The lines, by model.
#[derive(Default)]
pub struct Admission {
    /// Places taken over every line (checked without the lock on the hot path).
    waiting: AtomicUsize,
    next_id: AtomicU64,
    lines: Mutex<HashMap<String, VecDeque<Arc<Waiter>>>>,
}

/// A place in a line; leaving it (drop) frees it and hands the turn on.
pub struct Place<'a> {
    admission: &'a Admission,
    line: String,
    waiter: Arc<Waiter>,
    gauge: &'a prometheus_client::metrics::gauge::Gauge,
}

/// Longest wait of a line's head between re-checks even without a wake-up (a safety net, e.g.
/// for scraped queue lengths that fall without any request ending here).
const RECHECK: Duration = Duration::from_millis(100);

impl Admission {
    fn lines(&self) -> MutexGuard<'_, HashMap<String, VecDeque<Arc<Waiter>>>> {
        // A panic while holding this lock leaves plain data behind (no invariant spans it).
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the last place of `line` if fewer than `max` wait over all lines.
    pub fn enter<'a>(
        &'a self,
        line: &str,
        max: usize,
        gauge: &'a prometheus_client::metrics::gauge::Gauge,
    ) -> Option<Place<'a>> {
        let mut lines = self.lines();
        if self.waiting.load(Ordering::Acquire) >= max {
            return None;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let waiter = Arc::new(Waiter {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            notify: Notify::new(),
        });
        lines
            .entry(line.to_string())
            .or_default()
            .push_back(waiter.clone());
        gauge.inc();
        Some(Place {
            admission: self,
            line: line.to_string(),
            waiter,
            gauge,
        })
    }

    /// Requests waiting now, over all lines.
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether requests for `line` are waiting (a newcomer for it must join the line).
    pub fn has_line(&self, line: &str) -> bool {
        !self.is_empty() && self.lines().get(line).is_some_and(|l| !l.is_empty())
    }

    /// Capacity may have appeared: the head of each line routes again (cheap when nobody waits).
    pub fn wake(&self) {
        if self.is_empty() {
            return;
        }
        for line in self.lines().values() {
            if let Some(head) = line.front() {
                head.notify.notify_one();
            }
        }
    }
}

impl Place<'_> {
    fn is_head(&self) -> bool {
        self.admission
            .lines()
            .get(&self.line)
            .and_then(|l| l.front())
            .is_some_and(|w| w.id == self.waiter.id)
    }

    /// Waits until this place may route: it is the head of its line and was woken (or
    /// [`RECHECK`] passed). Returns false once `deadline` has passed.
    pub async fn turn(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return false;
            }
            let head = self.is_head();
            let until = if head {
                deadline.min(now + RECHECK)
            } else {
                deadline
            };
            let _ = tokio::time::timeout_at(until, self.waiter.notify.notified()).await;
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            // A place behind the head is only woken when it has just become the head.
            if head || self.is_head() {
                return true;
            }
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut lines = self.admission.lines();
        if let Some(line) = lines.get_mut(&self.line) {
            let was_head = line.front().is_some_and(|w| w.id == self.waiter.id);
            line.retain(|w| w.id != self.waiter.id);
            if was_head {
                // The place just freed may not have been the only one: the next gets its turn.
                if let Some(next) = line.front() {
                    next.notify.notify_one();
                }
            }
            if line.is_empty() {
                lines.remove(&self.line);
            }
        }
        self.admission.waiting.fetch_sub(1, Ordering::AcqRel);
        self.gauge.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::gauge::Gauge;
    use std::sync::atomic::AtomicU32;

    fn far() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(30)
    }

    #[test]
    fn the_queue_is_bounded_over_all_lines() {
        let a = Admission::default();
        let g = Gauge::default();
        let p1 = a.enter("m", 2, &g).unwrap();
        let _p2 = a.enter("n", 2, &g).unwrap();
        assert!(a.enter("m", 2, &g).is_none());
        assert_eq!(g.get(), 2);
        assert!(a.has_line("m") && a.has_line("n") && !a.has_line("o"));
        drop(p1);
        assert_eq!(a.len(), 1);
        assert!(!a.has_line("m"));
        assert!(a.enter("m", 2, &g).is_some());
        assert!(a.enter("m", 0, &g).is_none());
    }

    #[tokio::test]
    async fn the_head_waits_for_a_wake_or_the_deadline() {
        let a = Arc::new(Admission::default());
        let g = Gauge::default();
        let place = a.enter("m", 4, &g).unwrap();
        // A wake before the head waits is kept, not lost.
        a.wake();
        assert!(place.turn(far()).await);
        let past = tokio::time::Instant::now();
        assert!(!place.turn(past).await);
    }

    /// Waiters admitted one per freed slot, as the proxy does: route when it is your turn,
    /// leave when admitted. Returns the order of admission.
    async fn admit_in_turn(waiters: u32, slots_freed_one_by_one: bool) -> Vec<u32> {
        let a: &'static Admission = Box::leak(Box::default());
        let g: &'static Gauge = Box::leak(Box::default());
        let capacity: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..waiters {
            let place = a.enter("m", 100, g).unwrap();
            let order = order.clone();
            tasks.push(tokio::spawn(async move {
                while place.turn(far()).await {
                    let free = capacity.load(Ordering::Acquire);
                    if free > 0
                        && capacity
                            .compare_exchange(free, free - 1, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                    {
                        order.lock().unwrap().push(i);
                        return;
                    }
                }
                panic!("waiter {i} timed out");
            }));
        }
        tokio::task::yield_now().await;
        if slots_freed_one_by_one {
            for _ in 0..waiters {
                capacity.fetch_add(1, Ordering::AcqRel);
                a.wake();
                tokio::task::yield_now().await;
            }
        } else {
            capacity.fetch_add(waiters, Ordering::AcqRel);
            a.wake();
        }
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        order
    }

    #[tokio::test]
    async fn waiters_are_admitted_in_arrival_order() {
        assert_eq!(admit_in_turn(6, true).await, (0..6).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn one_wake_for_many_free_places_admits_them_all_in_order() {
        assert_eq!(admit_in_turn(5, false).await, (0..5).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_waiter_that_leaves_hands_the_turn_on() {
        let a = Admission::default();
        let g = Gauge::default();
        let first = a.enter("m", 4, &g).unwrap();
        let second = a.enter("m", 4, &g).unwrap();
        assert!(!second.is_head());
        drop(first);
        assert!(second.is_head());
        // Its turn came with the hand-over: no further wake is needed.
        assert!(second.turn(far()).await);
    }
}
