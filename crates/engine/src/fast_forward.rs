//! Fast-forward: many identical pure-decode steps in closed form.
//!
//! When a composed step only decodes (every running request computes one
//! token, nothing was admitted, preempted or loaded), the following steps
//! compose identically until one of these changes the picture:
//!
//! * a request reaches `max_tokens` (the earliest finish ends the run);
//! * the cache runs out of free blocks for the block-boundary allocations
//!   of later steps (a step-by-step run would preempt there);
//! * an in-flight KV transfer completes (its request becomes admissible);
//! * the caller submits, aborts or changes adapters (the run is cut to the
//!   step in flight; see `Engine::interrupt`).
//!
//! Waiting requests that could not be admitted at the run's first step
//! cannot be admitted later either: the running set, the budget and the
//! adapter slots stay the same, and free blocks only shrink (and cached
//! prefixes only get evicted), so an allocation that failed keeps failing.
//!
//! Step `i` of a run (1-based) costs
//! `base + n·per_seq + k·(C + n·i)/1000`, with `n` requests whose contexts
//! sum to `C` before the run, so `j` steps take
//! `j·(base + n·per_seq + k·C/1000) + k·n/1000 · j(j+1)/2`.
//! Per-request counters and block allocations are applied lazily: when the
//! run ends, or when the caller advances to a time inside it.

use crate::events::{EngineEvent, FinishReason};
use crate::profile::Profile;
use crate::scheduler::Scheduler;
use crate::seq::Phase;

/// A stretch of identical pure-decode steps being computed.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    /// Start of the first step not yet applied (its blocks are allocated).
    pub start: f64,
    /// Steps left, at least 1.
    pub steps: u64,
    /// The running requests, in running-queue order, as (slot, key).
    members: Vec<(u32, u64)>,
    /// Number of members when the run started.
    n: u64,
    /// Their summed context before the first unapplied step.
    ctx0: u64,
}

impl Run {
    /// Try to turn the just-composed step `sched.plan` starting at `start`
    /// into a run of at least two steps.
    pub(crate) fn try_start(sched: &mut Scheduler, start: f64, profile: &Profile) -> Option<Run> {
        let plan = &sched.plan;
        if plan.admitted > 0
            || plan.preempted
            || plan.lora_loads > 0
            || plan.items.is_empty()
            || plan.items.len() != sched.running.len()
        {
            return None;
        }
        let mut f = u64::MAX;
        let mut ctx0 = 0u64;
        for it in &plan.items {
            let s = sched.seq(it.slot);
            if it.tokens != 1 || !s.is_decoding() {
                return None;
            }
            f = f.min(u64::from(s.max_tokens - s.output));
            ctx0 += u64::from(s.computed);
        }
        // The member list's buffer is reused from run to run.
        let mut members = std::mem::take(&mut sched.spare_members);
        members.clear();
        members.extend(plan.items.iter().map(|it| (it.slot, it.key)));
        let n = members.len() as u64;
        let mut run = Run {
            start,
            steps: 1,
            members,
            n,
            ctx0,
        };
        let free = u64::from(sched.cache.num_free());
        let mut m = f.min(run.block_bound(sched, f, free));
        if let Some(blocked) = sched.plan.blocked {
            // A request blocked on blocks whose cached prefix gets evicted
            // may need *fewer* blocks afterwards (its first chunk starts
            // earlier and is budget-capped), so stop before the first of
            // its cached blocks is reused.
            let hits = sched.evictable_hits(blocked);
            if !hits.is_empty() {
                let pops = run.pops(sched, m);
                if let Some(q) = sched.cache.first_queued_among(&hits, pops) {
                    m = m.min(run.block_bound(sched, m, q));
                }
            }
        }
        if let Some(ready) = sched.next_transfer_ready() {
            m = m.min(run.first_step_ending_at_or_after(profile, ready, m));
        }
        if m < 2 {
            run.recycle(sched);
            return None;
        }
        run.steps = m;
        Some(run)
    }

    /// Give the member list's buffer back to `sched` for the next run.
    pub(crate) fn recycle(self, sched: &mut Scheduler) {
        sched.spare_members = self.members;
    }

    /// Blocks taken from the free queue by steps 2..=m.
    fn pops(&self, sched: &Scheduler, m: u64) -> u64 {
        let bs = u64::from(sched.bs);
        self.members
            .iter()
            .map(|&(slot, _)| new_blocks((u64::from(sched.seq(slot).computed) + 1) % bs, m, bs))
            .sum()
    }

    /// Largest `m <= f` such that steps 2..=m take at most `free` blocks.
    fn block_bound(&self, sched: &mut Scheduler, f: u64, free: u64) -> u64 {
        let bs = u64::from(sched.bs);
        let count = |r: u64, m: u64| new_blocks(r, m, bs);
        let use_buckets = bs <= self.n;
        if use_buckets {
            sched.bucket_scratch.clear();
            sched.bucket_scratch.resize(bs as usize, 0);
            for &(slot, _) in &self.members {
                let p = u64::from(sched.seq(slot).computed);
                sched.bucket_scratch[((p + 1) % bs) as usize] += 1;
            }
        }
        let need = |m: u64, sched: &Scheduler| -> u64 {
            if use_buckets {
                sched
                    .bucket_scratch
                    .iter()
                    .enumerate()
                    .map(|(r, &c)| c * count(r as u64, m))
                    .sum()
            } else {
                self.members
                    .iter()
                    .map(|&(slot, _)| count((u64::from(sched.seq(slot).computed) + 1) % bs, m))
                    .sum()
            }
        };
        if need(f, sched) <= free {
            return f;
        }
        // need(1) = 0 <= free; need(f) > free. Invariant: lo fits, hi does not.
        let (mut lo, mut hi) = (1u64, f);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if need(mid, sched) <= free {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Smallest `j` in `1..=cap` whose step ends at or after `t` (`cap` if none).
    fn first_step_ending_at_or_after(&self, profile: &Profile, t: f64, cap: u64) -> u64 {
        let (mut lo, mut hi) = (0u64, cap);
        // Invariant: step lo ends before t (or lo = 0); step hi ends at/after t or hi = cap.
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.start + self.cum(profile, mid) >= t {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi.max(1)
    }

    /// Duration of the next `j` steps.
    pub(crate) fn cum(&self, p: &Profile, j: u64) -> f64 {
        let n = self.n as f64;
        let jf = j as f64;
        let per_step = p.step_base_s
            + n * p.decode_s_per_seq
            + p.decode_s_per_1k_ctx * self.ctx0 as f64 / 1000.0;
        jf * per_step + p.decode_s_per_1k_ctx * n / 1000.0 * (jf * (jf + 1.0) / 2.0)
    }

    /// When the run's last step completes.
    pub(crate) fn end(&self, p: &Profile) -> f64 {
        self.start + self.cum(p, self.steps)
    }

    /// Number of steps (fewer than all) completed by time `t`: ending at or
    /// before `t`, or strictly before it with `strict`.
    pub(crate) fn steps_done_by(&self, p: &Profile, t: f64, strict: bool) -> u64 {
        let done = |j: u64| {
            let end = self.start + self.cum(p, j);
            if strict {
                end < t
            } else {
                end <= t
            }
        };
        let cap = self.steps - 1;
        if cap == 0 || !done(1) {
            return 0;
        }
        let (mut lo, mut hi) = (1u64, cap + 1);
        // Invariant: step lo is done by t; step hi is not (or hi = cap + 1).
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if done(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Apply the first `j` steps. With `last`, `j` must be all remaining
    /// steps: members reaching `max_tokens` finish at `time`. Otherwise the
    /// run continues from the end of step `j`, whose successor's blocks are
    /// allocated here.
    pub(crate) fn apply(
        &mut self,
        sched: &mut Scheduler,
        profile: &Profile,
        j: u64,
        last: bool,
        time: f64,
        out: &mut Vec<EngineEvent>,
    ) {
        if j == 0 {
            return;
        }
        // j ≤ max_tokens ≤ u32::MAX by construction of the run.
        let ju = u32::try_from(j).unwrap_or(u32::MAX);
        sched.prepare_apply(self.members.iter().map(|&(slot, key)| (slot, key, ju)));
        let mut finished_any = false;
        for &(slot, key) in &self.members {
            let Some(s) = sched.slab[slot as usize]
                .as_mut()
                .filter(|s| s.key == key && s.phase == Phase::Running)
            else {
                continue;
            };
            s.computed += ju;
            s.output += ju;
            let target = s.computed + u32::from(!last);
            let done = last && s.output >= s.max_tokens;
            sched.counters.generation_tokens += j;
            let ok = sched.grow(slot, target);
            debug_assert!(ok, "run length bounded by free blocks");
            sched.commit_blocks(slot);
            if done {
                sched.finish(slot, time, FinishReason::Length, out);
                finished_any = true;
            }
        }
        if finished_any {
            sched.drop_dead_running();
        }
        if !last {
            self.start += self.cum(profile, j);
            self.ctx0 += self.n * j;
            self.steps -= j;
        }
    }
}

/// New blocks a decoding request allocates in steps 2..=m of a run, when it
/// holds `p` tokens before the run and `r = (p+1) mod bs`: ceil((r+m-1)/bs) - [r>0].
fn new_blocks(r: u64, m: u64, bs: u64) -> u64 {
    (r + m - 1).div_ceil(bs) - u64::from(r > 0)
}

#[cfg(test)]
mod tests {
    use super::new_blocks;
    use crate::testutil::{req, small_config};
    use crate::{Engine, EngineConfig, EngineEvent};

    #[test]
    fn new_block_count_matches_direct_count() {
        for bs in [1u64, 2, 4, 16] {
            for p in 1u64..70 {
                for m in 1u64..70 {
                    // Blocks held after step m minus blocks held after step 1.
                    let direct = (p + m).div_ceil(bs) - (p + 1).div_ceil(bs);
                    assert_eq!(
                        new_blocks((p + 1) % bs, m, bs),
                        direct,
                        "bs {bs} p {p} m {m}"
                    );
                }
            }
        }
    }

    /// Count the `advance` calls a driver needs to finish everything.
    fn wakeups(step_by_step: bool, cfg: EngineConfig) -> (usize, Vec<EngineEvent>) {
        let mut e = Engine::new(cfg).unwrap();
        e.set_step_by_step(step_by_step);
        e.submit(req(1, 1, 100, 1500), 0.0).unwrap();
        e.submit(req(2, 2, 100, 1000), 0.0).unwrap();
        let mut out = Vec::new();
        let mut n = 0;
        while let Some(t) = e.next_event_time() {
            e.advance(t, &mut out);
            n += 1;
        }
        (n, out)
    }

    #[test]
    fn pure_decode_stretches_cost_one_wakeup() {
        let (ff, ev_ff) = wakeups(false, small_config());
        let (st, ev_st) = wakeups(true, small_config());
        // Wake-up, prefill, run to the first finish, step, run to the second finish.
        assert!(ff <= 6, "{ff} wake-ups with fast-forward");
        assert!(st > 1500, "{st} wake-ups step by step");
        assert_eq!(ev_ff.len(), ev_st.len());
        for (a, b) in ev_ff.iter().zip(&ev_st) {
            assert_eq!(a.id(), b.id());
            assert!((a.time() - b.time()).abs() < 1e-9 * a.time().max(1.0));
        }
    }

    #[test]
    fn runs_stop_where_blocks_run_out() {
        // 1600 + 1100 tokens need 169 blocks of 16; give 100: preemption must
        // happen at the same time with and without fast-forward.
        let cfg = EngineConfig {
            num_gpu_blocks: 100,
            max_model_len: 1600,
            enable_prefix_caching: false,
            ..small_config()
        };
        let (_, ev_ff) = wakeups(false, cfg.clone());
        let (_, ev_st) = wakeups(true, cfg);
        let pre = |ev: &[EngineEvent]| {
            ev.iter()
                .filter(|e| matches!(e, EngineEvent::Preempted { .. }))
                .map(|e| (e.id(), e.time()))
                .collect::<Vec<_>>()
        };
        let (a, b) = (pre(&ev_ff), pre(&ev_st));
        assert!(!a.is_empty());
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.0, y.0);
            assert!((x.1 - y.1).abs() < 1e-9 * x.1);
        }
    }
}
