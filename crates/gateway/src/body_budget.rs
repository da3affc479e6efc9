//! A budget of request-body bytes held at once, over every request being received or sent:
//! `--max-body-bytes` bounds one body, this bounds their sum, so slow uploads (each within its
//! `--body-read-timeout`) cannot add up to more memory than the operator allows.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Budget granularity: permits count KiB, so a budget of terabytes fits a semaphore's u32 calls.
const UNIT: usize = 1024;

/// The shared budget (`None`: unlimited).
#[derive(Debug)]
pub struct BodyBudget {
    permits: Option<Arc<Semaphore>>,
    limit: usize,
    units: usize,
}

/// What one request holds of the budget; given back when dropped.
#[derive(Debug, Default)]
pub struct BodyHold {
    permit: Option<OwnedSemaphorePermit>,
}

impl BodyBudget {
    /// A budget of `limit` bytes (0: unlimited).
    pub fn new(limit: usize) -> Self {
        let units = limit.div_ceil(UNIT).min(Semaphore::MAX_PERMITS);
        BodyBudget {
            permits: (limit > 0).then(|| Arc::new(Semaphore::new(units))),
            limit,
            units,
        }
    }

    /// The budget in bytes (0: unlimited).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes currently held (in whole KiB; 0 when unlimited, which keeps no count).
    pub fn held_bytes(&self) -> usize {
        self.permits
            .as_ref()
            .map_or(0, |p| (self.units - p.available_permits()) * UNIT)
    }

    /// Grows `hold` to cover `bytes` in all; false (and `hold` unchanged) when the budget has
    /// not that much left. Never waits: a gateway out of body memory answers at once.
    pub fn reserve(&self, hold: &mut BodyHold, bytes: usize) -> bool {
        let Some(permits) = &self.permits else {
            return true;
        };
        let held = hold.permit.as_ref().map_or(0, |p| p.num_permits());
        let want = bytes.div_ceil(UNIT);
        if want <= held {
            return true;
        }
        let Ok(more) = u32::try_from(want - held) else {
            return false;
        };
        match Arc::clone(permits).try_acquire_many_owned(more) {
            Ok(p) => {
                match hold.permit.as_mut() {
                    Some(h) => h.merge(p),
                    None => hold.permit = Some(p),
                }
                true
            }
            Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_add_up_to_the_budget_and_are_given_back_when_dropped() {
        let budget = BodyBudget::new(10 * UNIT);
        let mut a = BodyHold::default();
        assert!(budget.reserve(&mut a, 6 * UNIT));
        // Growing a hold takes only the difference.
        assert!(budget.reserve(&mut a, 7 * UNIT - 10));
        let mut b = BodyHold::default();
        assert!(!budget.reserve(&mut b, 4 * UNIT), "7 + 4 > 10");
        assert!(budget.reserve(&mut b, 3 * UNIT));
        assert!(
            !budget.reserve(&mut b, 3 * UNIT + 1),
            "a partial unit counts whole"
        );
        assert_eq!(budget.held_bytes(), 10 * UNIT);
        drop(a);
        assert_eq!(budget.held_bytes(), 3 * UNIT);
        assert!(budget.reserve(&mut b, 10 * UNIT));
    }

    #[test]
    fn zero_is_unlimited() {
        let budget = BodyBudget::new(0);
        let mut a = BodyHold::default();
        assert!(budget.reserve(&mut a, usize::MAX));
    }
}
