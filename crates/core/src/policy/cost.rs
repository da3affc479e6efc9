//! The default policy: minimise the estimated time to first token.
//!
//! `est_ttft = wait + prefill(uncached) + adapter (+ transfer)`, plus two protections that are
//! also priced in seconds: the delay a prefill inflicts on the sequences decoding beside it, and
//! the preemption risk of a nearly full KV cache. Hot-spotting is priced, not forbidden: a popular
//! prefix's holder keeps winning only while the prefill it saves exceeds the queue that builds
//! on it; then the next instance wins, prefills the prefix once, and holds it too.

use rand::rngs::SmallRng;
use rustc_hash::FxHashMap;

use super::{Policy, PolicyTraits, ScoringContext, Stage, TieBreak};
use crate::config::RouterConfig;
use crate::decision::{Candidate, CostTerms, Exclusion};
use crate::fleet::{Instance, LoadView, Role};

/// The `cost` policy (stateless: everything it needs is in the fleet view).
pub struct CostPolicy;

fn load_view(ctx: &ScoringContext<'_>, instance: &Instance) -> LoadView {
    instance.load_view(ctx.now, ctx.config.estimates.metrics_stale_after_s)
}

/// What a request pays on `instance` before and because of its own prefill, apart from the
/// prefill itself: (queue wait, the stall its prefill of `prefill_s` inflicts on the decoding
/// batch and the requests queued behind it). `unavoidable_s` is the prefill the request causes
/// wherever it goes (the cheapest candidate's): only the rest is charged to the decoding batch.
/// The load ladder orders instances by the same function, so the shortlist and the score cannot
/// drift apart.
fn wait_and_interference_s(
    config: &RouterConfig,
    instance: &Instance,
    view: &LoadView,
    speed: f64,
    decode_slope_s: f64,
    prefill_s: f64,
    unavoidable_s: f64,
) -> (f64, f64) {
    let cost = &config.cost;
    let wait_s = view.pending_tokens / speed
        + slot_wait_s(instance, view.in_system)
        + batch_steps_s(instance, view, decode_slope_s);
    // Requests queued behind this one wait for its prefill too: by Little's law about as many
    // arrive while it waits as are queued now (the first one queued is this request's own
    // company, not a backlog). Without this term an overloaded fleet trades cache hits for
    // queue balance, and the misses it takes add the work that keeps it overloaded. A queue
    // that waits for a sequence slot drains as sequences end, not as prompts are computed: the
    // requests behind this one wait for a slot to free, and what its prefill adds to that is
    // the slot held longer (the slot-pressure charge below). Charging the whole prefill per
    // queued request there priced the wrong resource (few-slots overload ITL p99 1.21x the best
    // baseline's, long-tail overload TTFT p99 1.24x, where 256-slot engines fill up).
    let backlog = if full_slots(instance, view.in_system).is_some() {
        0.0
    } else {
        f64::from(
            view.in_system
                .saturating_sub(view.running)
                .saturating_sub(1),
        )
    };
    // The decoding batch is charged only for the prefill this instance adds beyond the cheapest
    // candidate's: the rest stalls some instance's decodes wherever it runs. Charging all of it
    // pulled long prompts onto whichever instance had the fewest running sequences, whatever
    // its queue, and the queue of long prefills that built there stalled everyone on it (the
    // suite's long-tail workload: ITL p99 1.32x the best baseline's, mean TTFT 1.05x in
    // overload).
    let avoidable_s = (prefill_s - unavoidable_s).max(0.0);
    // A decode instance's batch is one the operator set apart from prefills (that is what
    // disaggregating buys): a prompt run whole there stalls it in full, not discounted as a
    // mixed batch's stall is.
    let weight = if instance.spec.role == Role::Decode {
        1.0
    } else {
        cost.decode_interference_weight
    };
    // Prefill beyond the cheapest candidate's also holds a slot longer: where every slot is
    // often taken, the requests that queue for this one inherit the delay, one after another.
    let p = instance.learned.slot_pressure.share.clamp(0.0, 0.9);
    let interference = weight * f64::from(view.running) * avoidable_s
        + avoidable_s * p / (1.0 - p)
        + cost.queue_interference_weight * backlog * prefill_s;
    (wait_s, interference)
}

/// The estimated wait of a typical request (the instance's mean uncached prompt) on
/// `instance`: the load ladder's key.
pub fn typical_wait_s(config: &RouterConfig, instance: &Instance, now: f64) -> f64 {
    let view = instance.load_view(now, config.estimates.metrics_stale_after_s);
    let speed = instance.learned.prefill_tokens_per_s.max(1.0);
    let prefill_s = instance.learned.mean_uncached_tokens / speed;
    let slope = instance.learned.decode_slope.per_sequence_s;
    let (wait_s, interference_s) =
        wait_and_interference_s(config, instance, &view, speed, slope, prefill_s, 0.0);
    wait_s + interference_s
}

/// The decode work in the steps before this request's first token: its prefill, and each
/// prefill queued ahead of it, runs in a step that also advances every sequence decoding there,
/// at the instance's learned cost per sequence ([`crate::decode_slope`]). A GPU's batch costs
/// next to nothing a step and its slope stays untrusted (0); a CPU engine's costs about a
/// millisecond per sequence, so a first token behind a batch of 100 comes 0.1 s later per step,
/// which the prefill speed, learned as an average over all batches, does not say. Requests
/// waiting for a slot wait for sequences to end, not for steps: their wait is the slot's.
fn batch_steps_s(instance: &Instance, view: &LoadView, decode_slope_s: f64) -> f64 {
    // A prefill instance's requests leave at their first token: no batch decodes there.
    if decode_slope_s <= 0.0 || instance.spec.role == Role::Prefill {
        return 0.0;
    }
    // Every sequence in the instance decodes in those steps once its own prefill is done (up
    // to the slots it runs at once): the queued prompts ahead join the batch step by step.
    let (batch, steps) = match full_slots(instance, view.in_system) {
        Some(max) => (max - 1, 1),
        None => (
            view.in_system,
            1 + view.in_system - view.running.min(view.in_system),
        ),
    };
    decode_slope_s * f64::from(batch) * f64::from(steps)
}

/// Waiting for a free sequence slot once `max_running` sequences are busy (configured, or
/// learned from the engine's own reports of requests waiting beside a full batch).
fn slot_wait_s(instance: &Instance, in_system: u32) -> f64 {
    full_slots(instance, in_system).map_or(0.0, |max| {
        let excess = f64::from(in_system + 1 - max);
        excess * instance.learned.service_time_s / f64::from(max)
    })
}

/// The instance's sequence slots when `in_system` requests take all of them, so that a new
/// request queues for one.
fn full_slots(instance: &Instance, in_system: u32) -> Option<u32> {
    instance
        .max_running()
        .filter(|&max| max > 0 && in_system >= max)
}

/// Preemption risk once the projected KV usage passes the high watermark.
fn kv_penalty_s(
    ctx: &ScoringContext<'_>,
    instance: &Instance,
    view: &LoadView,
    new_tokens: f64,
) -> f64 {
    let Some(capacity) = instance.kv_capacity_tokens().filter(|&c| c > 0) else {
        return 0.0;
    };
    let capacity = capacity as f64;
    let router_usage = instance.load.kv_tokens(ctx.output_share) as f64 / capacity;
    let engine_usage = view.kv_usage.unwrap_or(0.0);
    let projected = router_usage.max(engine_usage) + new_tokens / capacity;
    let mark = ctx.config.cost.kv_high_watermark;
    ((projected - mark) / (1.0 - mark)).max(0.0) * ctx.config.cost.kv_pressure_s
}

/// Adapters with running requests on the instance, from fresh metrics (empty if unknown).
fn running_adapters<'a>(ctx: &ScoringContext<'_>, instance: &'a Instance) -> &'a [String] {
    instance
        .fresh_metrics(ctx.now, ctx.config.estimates.metrics_stale_after_s)
        .map_or(&[], |m| m.running_adapters.as_slice())
}

/// Whether a request for `adapter` would wait for a slot on `instance`: the last scrape shows
/// adapters with running requests, plus adapters waiting for a slot, filling every slot, and
/// `adapter` is not running there. The engine (like vLLM's scheduler) skips such a request until
/// one running adapter has no request left.
fn waits_for_slot(ctx: &ScoringContext<'_>, instance: &Instance, adapter: &str) -> bool {
    let Some(m) = instance.fresh_metrics(ctx.now, ctx.config.estimates.metrics_stale_after_s)
    else {
        return false;
    };
    let running = &m.running_adapters;
    if running.iter().any(|a| a == adapter) {
        return false;
    }
    let queued = m
        .waiting_adapters
        .iter()
        .filter(|a| !running.contains(a))
        .count();
    (running.len() + queued) as u32 >= instance.adapter_slots()
}

/// Loading the request's adapter if it is not resident (at the learned load time,
/// [`ScoringContext::adapter_load_s`]), plus evicting another if slots are full, plus waiting for
/// a slot (about a request's service time) when the slots are spoken for: (all of it, whether it
/// is a load and nothing else).
fn adapter_s(ctx: &ScoringContext<'_>, instance: &Instance) -> (f64, bool) {
    let Some(adapter) = ctx.request.adapter else {
        return (0.0, false);
    };
    let cost = &ctx.config.cost;
    let contended = waits_for_slot(ctx, instance, adapter);
    if !contended && instance.adapters.is_resident(adapter) {
        return (0.0, false);
    }
    let full = contended || instance.adapters.resident.len() as u32 >= instance.adapter_slots();
    if !full {
        return (ctx.adapter_load_s, true);
    }
    let slot_wait = if contended {
        instance.learned.service_time_s
    } else {
        0.0
    };
    (
        ctx.adapter_load_s + cost.adapter_eviction_s + slot_wait,
        false,
    )
}

/// Evicting the only resident copy of an adapter means its next request pays a load somewhere:
/// a load that would evict the last copy (the least recently used adapter with no running
/// request, as the engine picks it) costs another load. Evicting a replica of an
/// adapter that other candidates hold costs only the eviction already priced. `resident[i]`:
/// the router believes candidate `i` holds the request's adapter.
fn price_last_copy_evictions(
    ctx: &ScoringContext<'_>,
    candidates: &mut [Candidate],
    resident: &[bool],
) {
    // Which candidates must evict, and whom: (candidate, victim).
    let mut evicting: Vec<(usize, &str)> = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        let instance = ctx.instance(c);
        let held = &instance.adapters.resident;
        if resident[i] || (held.len() as u32) < instance.adapter_slots() {
            continue;
        }
        let running = running_adapters(ctx, instance);
        if let Some(victim) = held.iter().rev().find(|a| !running.contains(a)) {
            evicting.push((i, victim.as_str()));
        }
    }
    if evicting.is_empty() {
        return;
    }
    // Holders of each victim among the candidates (only the victims are counted).
    let mut holders: FxHashMap<&str, u32> = FxHashMap::default();
    holders.reserve(evicting.len());
    for &(_, victim) in &evicting {
        holders.insert(victim, 0);
    }
    for c in candidates.iter() {
        for a in &ctx.instance(c).adapters.resident {
            if let Some(n) = holders.get_mut(a.as_str()) {
                *n += 1;
            }
        }
    }
    let load = ctx.adapter_load_s;
    for (i, victim) in evicting {
        if holders.get(victim).copied().unwrap_or(0) <= 1 {
            candidates[i].terms.adapter_s += load;
            candidates[i].score += load;
        }
    }
}

/// Speeds learned within this factor of the pool's median ([`ScoringContext::pool_speed`]) are taken as the median: on
/// identical engines, TTFT noise (a loaded host, batching) made learned speeds differ up to 3x,
/// enough to pull conversations off their caches onto the engine that looked fastest. A real
/// difference (another accelerator generation) is larger and is kept.
const SAME_SPEED_FACTOR: f64 = 2.0;

/// The speed an instance is priced at: its own when it differs from the pool's beyond noise.
/// An instance that has given no full speed sample (short prompts, long answers) is its prior
/// scaled by how its short first tokens compare with the pool's: those measure a step more than
/// a prefill, so only the ratio is trusted (on one kind of engine it stays inside the noise
/// band; an engine of another generation shows its 2-4x).
fn priced_speed(ctx: &ScoringContext<'_>, instance: &Instance) -> f64 {
    let learned = &instance.learned;
    let own =
        if learned.speed_samples == 0 && learned.short_samples > 0 && ctx.pool_short_speed > 0.0 {
            learned.prefill_tokens_per_s * learned.short_speed / ctx.pool_short_speed
        } else {
            learned.prefill_tokens_per_s
        };
    let pool = ctx.pool_speed;
    if within_noise_of(own, pool) {
        pool
    } else {
        own
    }
}

/// Whether an instance's learned figure is within [`SAME_SPEED_FACTOR`] of the pool's median
/// (known): noise between engines of one kind, priced as the median.
fn within_noise_of(own: f64, pool: f64) -> bool {
    pool > 0.0 && own <= pool * SAME_SPEED_FACTOR && own * SAME_SPEED_FACTOR >= pool
}

/// The marginal step time per decoding sequence an instance is priced at: its own learned slope
/// when it differs from the pool's beyond noise, else the pool's (which an instance that always
/// ran one batch size, and so learned none, borrows).
fn priced_decode_slope_s(ctx: &ScoringContext<'_>, instance: &Instance) -> f64 {
    let own = instance.learned.decode_slope.per_sequence_s;
    let pool = ctx.pool_decode_slope_s;
    if own <= 0.0 || within_noise_of(own, pool) {
        pool
    } else {
        own
    }
}

/// The prefill time of `terms`' uncached tokens on `instance`, at its priced speed.
fn prefill_s(ctx: &ScoringContext<'_>, instance: &Instance, terms: &CostTerms) -> f64 {
    let speed = priced_speed(ctx, instance);
    (f64::from(ctx.prompt_tokens) - f64::from(terms.cached_tokens)) / speed
}

/// The prefill-side estimate for one candidate (unified or prefill stage); `unavoidable_s`: the
/// least prefill time among the candidates ([`wait_and_interference_s`]).
pub fn prefill_terms(
    ctx: &ScoringContext<'_>,
    instance: &Instance,
    mut terms: CostTerms,
    unavoidable_s: f64,
) -> CostTerms {
    let speed = priced_speed(ctx, instance);
    // The index's match is already weighted by how likely the instance still holds it.
    let cached = f64::from(terms.cached_tokens);
    let uncached = f64::from(ctx.prompt_tokens) - cached;
    terms.cached_tokens = cached as u32;
    terms.uncached_tokens = uncached as u32;
    let view = load_view(ctx, instance);
    terms.prefill_s = uncached / speed;
    (terms.wait_s, terms.decode_penalty_s) = wait_and_interference_s(
        ctx.config,
        instance,
        &view,
        speed,
        priced_decode_slope_s(ctx, instance),
        terms.prefill_s,
        unavoidable_s,
    );
    terms.raw_wait_prefill_s = (terms.wait_s, terms.prefill_s);
    // What a hit saves, priced at what a second of estimated prefill has been worth (1 unless
    // `cost.calibrate_prefill`): the prefill every candidate pays is not a trade, so it stays at
    // face value, and so do the stalls it inflicts on others (the factor is learned from the
    // request's own first token, which says nothing of theirs).
    let avoidable_s = (terms.prefill_s - unavoidable_s).max(0.0);
    terms.prefill_s += (ctx.prefill_factor - 1.0) * avoidable_s;
    (terms.adapter_s, terms.loads_adapter) = adapter_s(ctx, instance);
    // A prefill half hands its KV over after one token: the answer grows on the decode side.
    let answer = if ctx.stage == Stage::Prefill {
        0.0
    } else {
        ctx.expected_answer_tokens()
    };
    let new_tokens = uncached + answer;
    terms.kv_penalty_s = kv_penalty_s(ctx, instance, &view, new_tokens);
    terms
}

/// The decode-side estimate for one candidate of a disaggregated request: the KV transfer,
/// waiting for a sequence slot, and the protections; no prefill happens there.
pub fn decode_terms(
    ctx: &ScoringContext<'_>,
    instance: &Instance,
    mut terms: CostTerms,
) -> CostTerms {
    let cost = &ctx.config.cost;
    let view = load_view(ctx, instance);
    // What the decode instance already holds (an earlier turn landed there) is not moved.
    let held = f64::from(terms.cached_tokens);
    terms.cached_tokens = 0;
    terms.uncached_tokens = 0;
    terms.transfer_s =
        (f64::from(ctx.prompt_tokens) - held).max(0.0) * cost.kv_transfer_s_per_token;
    terms.wait_s = slot_wait_s(instance, view.in_system);
    (terms.adapter_s, terms.loads_adapter) = adapter_s(ctx, instance);
    // A decode joins the batch: every running sequence's step gets a little longer.
    terms.decode_penalty_s = cost.decode_interference_weight * f64::from(view.running) * 0.01;
    let new_tokens = f64::from(ctx.prompt_tokens) + ctx.expected_answer_tokens();
    terms.kv_penalty_s = kv_penalty_s(ctx, instance, &view, new_tokens);
    terms
}

/// The tie order of a unified or prefill candidate: where the request would start at once, the
/// KV its in-flight requests will hold (the decode batch it joins, whose attention sets its
/// inter-token time and which a long answer stays in); where it would queue, after all of
/// those and in no order among themselves (the batch will have turned over by then). Decided
/// by chance, a new conversation's first turn lands on a busier batch as often as not, and its
/// later turns follow it there (chat with 600-token answers: ITL p99 1.20x the best
/// baseline's; docs/results.md).
fn start_now_kv(ctx: &ScoringContext<'_>, instance: &Instance, terms: &CostTerms) -> u64 {
    if terms.wait_s > 0.0 {
        u64::MAX
    } else {
        instance.load.kv_tokens(ctx.output_share)
    }
}

fn total(terms: &CostTerms) -> f64 {
    terms.wait_s
        + terms.prefill_s
        + terms.adapter_s
        + terms.transfer_s
        + terms.decode_penalty_s
        + terms.kv_penalty_s
        + terms.cache_room_s
        + terms.packing_s
}

/// The batch a request would decode in on `instance`: the requests there and itself, at most
/// the sequences it runs at once.
fn decode_batch(ctx: &ScoringContext<'_>, instance: &Instance) -> f64 {
    let in_system = load_view(ctx, instance).in_system + 1;
    let batch = match instance.max_running().filter(|&max| max > 0) {
        Some(max) => in_system.min(max),
        None => in_system,
    };
    f64::from(batch)
}

/// The packing guard: what the answer loses decoding in a batch larger than load balancing
/// alone gives (the largest batch among the candidates nothing pulls, `reference_batch`): the
/// instance's learned cost of a sequence in a step ([`crate::decode_slope`]) times the expected
/// answer tokens, per sequence above it. Charged only where an affinity that many requests
/// share pulls the request (a prefix that different prompts continue, or an adapter some
/// candidate lacks): such a pull sends request after request to its holders, and the TTFT
/// terms alone let their batch grow until each step is slow for everyone there (a CPU engine's
/// sequence costs about a millisecond a step: zipf and LoRA inter-token p99 3x and 9x the best
/// baseline's, docs/results.md). One conversation's own history pulls only its next turn, so
/// it packs nothing; and where nothing pulls, the TTFT terms already balance the load
/// (charging every candidate traded first tokens for decode time).
fn packing_s(ctx: &ScoringContext<'_>, instance: &Instance, reference_batch: f64) -> f64 {
    let excess = decode_batch(ctx, instance) - reference_batch;
    if excess <= 0.0 {
        return 0.0;
    }
    priced_decode_slope_s(ctx, instance) * ctx.expected_answer_tokens() * excess
}

/// On engines that share compute, prefill this candidate adds beyond the cheapest candidate's
/// slows every other busy instance meanwhile, and each request waiting there for a first token
/// waits that much longer: the avoidable prefill times the pool's learned share of speed lost
/// per busy neighbour ([`crate::shared_compute`]) per such request. Zero on separate devices,
/// where the share is not trusted.
fn shared_stall_s(
    ctx: &ScoringContext<'_>,
    instance: &Instance,
    terms: &CostTerms,
    unavoidable_s: f64,
) -> f64 {
    let share = ctx.pool_shared_share;
    if share <= 0.0 {
        return 0.0;
    }
    let elsewhere = ctx
        .pool_waiting
        .saturating_sub(instance.load.pending_requests);
    (terms.prefill_s - unavoidable_s).max(0.0) * share * f64::from(elsewhere)
}

/// The cache room a candidate spends storing again the `duplicated` prompt tokens that the best
/// holder among the candidates already has: that room held other prefixes, which the instance
/// reuses at its learned hit share `h`. In steady state every token stored displaces one, and a
/// stored token is reused about h / (1 − h) times before it leaves, so the copy costs that many
/// tokens of someone's prefill (priced as a hit is, [`ScoringContext::prefill_factor`]). Engines that report no cached tokens never learn a share and pay
/// nothing.
/// `weight`: `cost.cache_room_weight`, or `cost.history_room_weight` where the best holder's
/// copy is one conversation's own history.
fn cache_room_s(
    ctx: &ScoringContext<'_>,
    instance: &Instance,
    duplicated: u32,
    weight: f64,
) -> f64 {
    let h = instance.learned.hit_share.clamp(0.0, 0.9);
    let speed = priced_speed(ctx, instance);
    weight * f64::from(duplicated) * h / (1.0 - h) / speed * ctx.prefill_factor
}

/// Thrashing guard for adapters: a swap must beat an instance already holding the adapter by a
/// margin, and an instance that just swapped is not asked to swap again within the cooldown
/// while another candidate can take the request without waiting for a slot.
fn guard_adapter_swaps(ctx: &ScoringContext<'_>, candidates: &mut [Candidate]) {
    let Some(adapter) = ctx.request.adapter else {
        return;
    };
    // One pass of string comparisons per candidate: the lists are short, the fleet may not be.
    let resident: Vec<bool> = candidates
        .iter()
        .map(|c| ctx.instance(c).adapters.is_resident(adapter))
        .collect();
    price_last_copy_evictions(ctx, candidates, &resident);
    let cost = &ctx.config.cost;
    let resident_somewhere = resident.iter().any(|&r| r);
    let mut cooling = vec![false; candidates.len()];
    for (i, c) in candidates.iter_mut().enumerate() {
        if resident[i] {
            continue;
        }
        let instance = ctx.instance(c);
        if resident_somewhere {
            c.terms.adapter_s += cost.adapter_switch_margin_s;
            c.score += cost.adapter_switch_margin_s;
        }
        // Evicting another adapter soon after the last swap is what thrashing looks like.
        let slots_full = instance.adapters.resident.len() as u32 >= instance.adapter_slots();
        let recently_swapped = instance
            .adapters
            .last_load_at
            .is_some_and(|at| ctx.now - at < cost.adapter_cooldown_s);
        cooling[i] = slots_full && recently_swapped;
    }
    // Funnelling every request onto the instances left would starve them when they wait for a
    // slot; and a request must go somewhere.
    let ready_elsewhere = candidates
        .iter()
        .zip(&cooling)
        .any(|(c, &cool)| !cool && !waits_for_slot(ctx, ctx.instance(c), adapter));
    if ready_elsewhere {
        for (c, _) in candidates
            .iter_mut()
            .zip(&cooling)
            .filter(|(_, &cool)| cool)
        {
            c.excluded = Some(Exclusion::AdapterCooldown);
        }
    }
}

impl Policy for CostPolicy {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "cost",
            uses_prefix_index: true,
            tie_break: TieBreak::Near,
            prices_local_prefill: true,
            // Every instance outside the shortlist holds none of the prompt and waits at least
            // as long as the shortlisted non-holders (by the ladder's estimate).
            scores_shortlist: true,
        };
        &TRAITS
    }

    fn score(
        &mut self,
        ctx: &ScoringContext<'_>,
        candidates: &mut [Candidate],
        _rng: &mut SmallRng,
    ) {
        debug_assert!(ctx.stage != Stage::Decode);
        let least_prefill_s = candidates
            .iter()
            .map(|c| prefill_s(ctx, ctx.instance(c), &c.terms))
            .fold(f64::INFINITY, f64::min);
        // One pass: the least and most cached, and whether a best holder's copy is one
        // conversation's own history (its deepest block continued by no other prompt), whose
        // copy is priced at its own weight: that room serves one conversation.
        let (least_cached, most_cached, history) =
            candidates
                .iter()
                .fold((u32::MAX, 0, false), |(least, most, history), c| {
                    let t = c.terms.cached_tokens;
                    let own = !c.terms.shared_prefix;
                    let history = match t.cmp(&most) {
                        std::cmp::Ordering::Greater => own,
                        std::cmp::Ordering::Equal => history || own,
                        std::cmp::Ordering::Less => history,
                    };
                    (least.min(t), most.max(t), history)
                });
        let room_weight = if history && most_cached > 0 {
            ctx.config.cost.history_room_weight
        } else {
            ctx.config.cost.cache_room_weight
        };
        // A prefill half decodes nothing: its answer grows on the decode side.
        let decodes_here = ctx.stage != Stage::Prefill;
        let adapter = ctx.request.adapter;
        let adapter_missing_somewhere = adapter.is_some_and(|a| {
            candidates
                .iter()
                .any(|c| !ctx.instance(c).adapters.is_resident(a))
        });
        let pulled: Vec<bool> = candidates
            .iter()
            .map(|c| {
                let shared_pull = c.terms.shared_prefix && c.terms.cached_tokens > least_cached;
                let adapter_pull = adapter_missing_somewhere
                    && adapter.is_some_and(|a| ctx.instance(c).adapters.is_resident(a));
                decodes_here && (shared_pull || adapter_pull)
            })
            .collect();
        // The batch load balancing alone gives: the largest among the candidates nothing pulls.
        let unpulled_batch = candidates
            .iter()
            .zip(&pulled)
            .filter(|(_, &pulled)| !pulled)
            .map(|(c, _)| decode_batch(ctx, ctx.instance(c)))
            .reduce(f64::max);
        for (c, &pulled) in candidates.iter_mut().zip(&pulled) {
            let instance = ctx.instance(c);
            let packing = match unpulled_batch {
                Some(reference) if pulled => packing_s(ctx, instance, reference),
                _ => 0.0,
            };
            // A decode instance scored for running a request whole competes with a hand-off
            // that stalls no decoding batch: all of its prefill is avoidable.
            let unavoidable_s = if instance.spec.role == Role::Decode {
                0.0
            } else {
                least_prefill_s
            };
            let duplicated = most_cached - c.terms.cached_tokens;
            c.terms = prefill_terms(ctx, instance, c.terms, unavoidable_s);
            c.terms.decode_penalty_s += shared_stall_s(ctx, instance, &c.terms, unavoidable_s);
            c.terms.cache_room_s = cache_room_s(ctx, instance, duplicated, room_weight);
            c.terms.packing_s = packing;
            c.score = total(&c.terms);
            c.tie_load = start_now_kv(ctx, instance, &c.terms);
        }
        guard_adapter_swaps(ctx, candidates);
    }

    fn score_decode(
        &mut self,
        ctx: &ScoringContext<'_>,
        candidates: &mut [Candidate],
        _rng: &mut SmallRng,
    ) {
        for c in candidates.iter_mut() {
            let instance = ctx.instance(c);
            c.terms = decode_terms(ctx, instance, c.terms);
            c.score = total(&c.terms);
            // Decode candidates mostly tie (the same transfer wherever the prompt is new): the
            // one holding the least KV gives the shortest decode steps, at random the longest
            // contexts pile up (PD inter-token p99 1.07-1.18x the best baseline's).
            c.tie_load = instance.load.kv_tokens(ctx.output_share);
        }
    }
}
