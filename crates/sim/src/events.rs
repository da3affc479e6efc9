//! The event queue: a binary heap of (time, kind, instance) with lazy invalidation.
//!
//! Each instance has at most one live engine event (its engine's `next_event_time`) and one
//! scrape. Rescheduling an engine does not search the heap: it bumps the instance's generation
//! and pushes a new entry; entries of an older generation are dropped when they reach the top.
//! So every operation is O(log n) in the number of instances.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// What happens at a queued time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// An engine's step (or wake-up) completes.
    Engine(usize),
    /// The router scrapes an instance's metrics.
    Scrape(usize),
}

/// Kind order at equal times: engine work first (so a scrape sees it), then scrapes.
const ENGINE: u8 = 0;
const SCRAPE: u8 = 1;

#[derive(Debug, Clone, Copy)]
struct Entry {
    time: f64,
    kind: u8,
    index: u32,
    generation: u32,
}

impl Entry {
    fn key(&self) -> (u8, u32, u32) {
        (self.kind, self.index, self.generation)
    }
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    // Reversed: `BinaryHeap` is a max-heap and the earliest entry must come out first.
    // Ties are broken by kind and instance so the order never depends on insertion history.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .time
            .total_cmp(&self.time)
            .then_with(|| other.key().cmp(&self.key()))
    }
}

/// Pending engine events and scrapes in time order.
#[derive(Debug, Default)]
pub struct EventQueue {
    heap: BinaryHeap<Entry>,
    /// Per instance, the generation of its one live engine entry.
    generation: Vec<u32>,
    /// Per instance, the time of its live engine entry (NaN: none).
    scheduled: Vec<f64>,
    /// Instances with a live engine entry.
    live_engines: usize,
}

impl EventQueue {
    /// A queue for `instances` instances.
    pub fn new(instances: usize) -> EventQueue {
        EventQueue {
            heap: BinaryHeap::with_capacity(instances * 2),
            generation: vec![0; instances],
            scheduled: vec![f64::NAN; instances],
            live_engines: 0,
        }
    }

    /// Sets (or clears, with `None`) the time of instance `i`'s next engine event.
    pub fn schedule_engine(&mut self, i: usize, time: Option<f64>) {
        let current = self.scheduled[i];
        match time {
            Some(t) if t == current => {}
            Some(t) => {
                self.generation[i] = self.generation[i].wrapping_add(1);
                if current.is_nan() {
                    self.live_engines += 1;
                }
                self.scheduled[i] = t;
                self.heap.push(Entry {
                    time: t,
                    kind: ENGINE,
                    index: i as u32,
                    generation: self.generation[i],
                });
            }
            None => {
                if !current.is_nan() {
                    self.generation[i] = self.generation[i].wrapping_add(1);
                    self.scheduled[i] = f64::NAN;
                    self.live_engines -= 1;
                }
            }
        }
    }

    /// Queues a scrape of instance `i` at `time`.
    pub fn schedule_scrape(&mut self, i: usize, time: f64) {
        self.heap.push(Entry {
            time,
            kind: SCRAPE,
            index: i as u32,
            generation: 0,
        });
    }

    fn is_live(&self, e: &Entry) -> bool {
        e.kind == SCRAPE || e.generation == self.generation[e.index as usize]
    }

    /// Time of the earliest live entry, dropping stale ones on the way.
    pub fn peek_time(&mut self) -> Option<f64> {
        while let Some(top) = self.heap.peek() {
            if self.is_live(top) {
                return Some(top.time);
            }
            self.heap.pop();
        }
        None
    }

    /// Removes and returns the earliest live entry.
    pub fn pop(&mut self) -> Option<(f64, Event)> {
        while let Some(e) = self.heap.pop() {
            if !self.is_live(&e) {
                continue;
            }
            let i = e.index as usize;
            return Some(match e.kind {
                ENGINE => {
                    self.scheduled[i] = f64::NAN;
                    self.live_engines -= 1;
                    (e.time, Event::Engine(i))
                }
                _ => (e.time, Event::Scrape(i)),
            });
        }
        None
    }

    /// Whether any engine event is pending (scrapes aside).
    pub fn has_engine_work(&self) -> bool {
        self.live_engines > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_in_time_order_with_engines_before_scrapes() {
        let mut q = EventQueue::new(3);
        q.schedule_scrape(0, 1.0);
        q.schedule_engine(2, Some(1.0));
        q.schedule_engine(1, Some(0.5));
        assert_eq!(q.pop(), Some((0.5, Event::Engine(1))));
        assert_eq!(q.pop(), Some((1.0, Event::Engine(2))));
        assert_eq!(q.pop(), Some((1.0, Event::Scrape(0))));
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn rescheduling_invalidates_the_old_entry() {
        let mut q = EventQueue::new(2);
        q.schedule_engine(0, Some(5.0));
        q.schedule_engine(0, Some(2.0));
        q.schedule_engine(1, Some(3.0));
        q.schedule_engine(1, None);
        assert!(q.has_engine_work());
        assert_eq!(q.peek_time(), Some(2.0));
        assert_eq!(q.pop(), Some((2.0, Event::Engine(0))));
        assert_eq!(q.pop(), None);
        assert!(!q.has_engine_work());
    }

    #[test]
    fn same_time_again_is_not_pushed_twice() {
        let mut q = EventQueue::new(1);
        q.schedule_engine(0, Some(1.0));
        q.schedule_engine(0, Some(1.0));
        assert_eq!(q.pop(), Some((1.0, Event::Engine(0))));
        assert_eq!(q.pop(), None);
    }
}
