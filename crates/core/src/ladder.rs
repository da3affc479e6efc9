//! The load ladder: healthy instances of each role ordered by estimated wait, so that a large
//! pool can be scored on a shortlist (the prompt's prefix holders plus the least loaded) instead
//! of instance by instance.
//!
//! The order is an estimate kept up to date as observations arrive; the policy still scores
//! every shortlisted candidate exactly. What the ladder can get wrong is only which non-holders
//! are scored, and it orders them by the same quantities the `cost` policy charges for.

use std::collections::BTreeSet;

use crate::fleet::Slot;
use crate::fleet::{Health, Instance, Role};

/// Instances ordered by estimated wait, one ladder per role.
#[derive(Debug, Default)]
pub(crate) struct LoadLadder {
    /// Per role (both, prefill, decode): (wait key, slot), least loaded first.
    rungs: [BTreeSet<(u64, Slot)>; 3],
    /// Per slot, its current entry (role index, key), if on a ladder.
    entry: Vec<Option<(usize, u64)>>,
}

fn role_index(role: Role) -> usize {
    match role {
        Role::Both => 0,
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

/// The ladder's key in nanoseconds: the `cost` policy's wait of a typical request
/// ([`crate::policy::cost::typical_wait_s`]), then requests in flight, so idle-looking
/// instances with queued work sort later.
fn wait_key(instance: &Instance, wait_s: f64) -> u64 {
    (wait_s.max(0.0) * 1e9) as u64 + u64::from(instance.load.in_flight())
}

impl LoadLadder {
    /// Puts `instance` on its rung with its estimated wait (off the ladder unless healthy).
    pub(crate) fn update(&mut self, instance: &Instance, wait_s: f64) {
        let slot = instance.id.slot;
        let next = (instance.health == Health::Healthy)
            .then(|| (role_index(instance.spec.role), wait_key(instance, wait_s)));
        let index = slot as usize;
        if self.entry.len() <= index {
            self.entry.resize(index + 1, None);
        }
        if self.entry[index] == next {
            return;
        }
        if let Some((role, key)) = self.entry[index] {
            self.rungs[role].remove(&(key, slot));
        }
        if let Some((role, key)) = next {
            self.rungs[role].insert((key, slot));
        }
        self.entry[index] = next;
    }

    /// Takes `slot` off the ladder (the instance left).
    pub(crate) fn remove(&mut self, slot: Slot) {
        if let Some(entry) = self.entry.get_mut(slot as usize) {
            if let Some((role, key)) = entry.take() {
                self.rungs[role].remove(&(key, slot));
            }
        }
    }

    /// Slots of one role, least loaded first.
    pub(crate) fn least_loaded(&self, role: Role) -> impl Iterator<Item = Slot> + '_ {
        self.rungs[role_index(role)].iter().map(|&(_, slot)| slot)
    }

    /// Instances on the ladder.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.rungs.iter().map(BTreeSet::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{Fleet, InstanceSpec, Learned};

    fn put(ladder: &mut LoadLadder, instance: &Instance) {
        let wait_s =
            crate::policy::cost::typical_wait_s(&crate::RouterConfig::default(), instance, 0.0);
        ladder.update(instance, wait_s);
    }

    fn learned() -> Learned {
        Learned {
            prefill_tokens_per_s: 10_000.0,
            service_time_s: 10.0,
            service_samples: 0,
            cache_trust: 1.0,
            mean_uncached_tokens: 1000.0,
            survival: Default::default(),
            hit_share: 0.0,
            cache_unit_tokens: 0,
            exact_error: 0.0,
            approx_error: 0.0,
            view_samples: 0,
            speed_samples: 0,
            max_running: None,
            slot_pressure: Default::default(),
            short_speed: 0.0,
            short_samples: 0,
            decode_slope: Default::default(),
            shared_compute: Default::default(),
            ttft_fixed_s: crate::running_median::RunningMedian::new(0.01),
            ttft_fixed_calibrated_s: crate::running_median::RunningMedian::new(0.01),
        }
    }

    #[test]
    fn orders_by_queued_work_and_follows_updates_and_health() {
        let mut fleet = Fleet::default();
        let ids: Vec<_> = (0..3)
            .map(|i| {
                fleet
                    .add(InstanceSpec::new(format!("i{i}"), "m"), learned())
                    .unwrap()
            })
            .collect();
        let mut ladder = LoadLadder::default();
        for (n, id) in ids.iter().enumerate() {
            let instance = fleet.get_mut(*id).unwrap();
            instance.load.pending_tokens = 1000 * (3 - n as u64);
            put(&mut ladder, fleet.get(*id).unwrap());
        }
        let order: Vec<Slot> = ladder.least_loaded(Role::Both).collect();
        assert_eq!(order, vec![ids[2].slot, ids[1].slot, ids[0].slot]);
        // The busiest becomes idle: it moves to the front, and is never listed twice.
        fleet.get_mut(ids[0]).unwrap().load.pending_tokens = 0;
        put(&mut ladder, fleet.get(ids[0]).unwrap());
        let order: Vec<Slot> = ladder.least_loaded(Role::Both).collect();
        assert_eq!(order, vec![ids[0].slot, ids[2].slot, ids[1].slot]);
        // Unhealthy instances are off the ladder until healthy again.
        fleet.get_mut(ids[2]).unwrap().health = Health::Unhealthy;
        put(&mut ladder, fleet.get(ids[2]).unwrap());
        assert_eq!(ladder.len(), 2);
        ladder.remove(ids[1].slot);
        let order: Vec<Slot> = ladder.least_loaded(Role::Both).collect();
        assert_eq!(order, vec![ids[0].slot]);
        assert_eq!(ladder.least_loaded(Role::Decode).count(), 0);
    }

    #[test]
    fn running_batches_count_as_wait() {
        let mut fleet = Fleet::default();
        let a = fleet.add(InstanceSpec::new("a", "m"), learned()).unwrap();
        let b = fleet.add(InstanceSpec::new("b", "m"), learned()).unwrap();
        fleet.get_mut(a).unwrap().load.running_requests = 50;
        fleet.get_mut(b).unwrap().load.pending_tokens = 100;
        let mut ladder = LoadLadder::default();
        put(&mut ladder, fleet.get(a).unwrap());
        put(&mut ladder, fleet.get(b).unwrap());
        // 50 × 0.03 × 1000 tokens of stall outweighs 100 tokens queued.
        let order: Vec<Slot> = ladder.least_loaded(Role::Both).collect();
        assert_eq!(order, vec![b.slot, a.slot]);
    }
}
