//! Heap cost of materialised requests, measured with a counting allocator.
//!
//! This file is its own test binary, so the global allocator below only
//! counts this file's tests; they run one at a time through a lock.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use std::collections::HashSet;

use switchyard_workload::{
    read_trace, Request, SharedPrefixSpec, TraceSpec, MOONCAKE_BLOCK_TOKENS,
};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Live heap bytes per request while `n` requests of `make()` are held
/// (callers hold `ONE_AT_A_TIME`, so no other test allocates meanwhile).
fn bytes_per_request(n: usize, make: impl FnOnce() -> Box<dyn Iterator<Item = Request>>) -> f64 {
    let before = LIVE.load(Ordering::Relaxed);
    let it = make();
    let mut reqs = Vec::with_capacity(n);
    reqs.extend(it.take(n));
    let after = LIVE.load(Ordering::Relaxed);
    let inline = std::mem::size_of::<Request>() * n;
    let per = (after - before) as f64 / n as f64;
    eprintln!(
        "{n} requests: {per:.0} B/request incl. {} B inline, prompt {} tokens",
        inline / n,
        reqs[0].prompt_tokens()
    );
    per
}

#[test]
fn shared_prefix_requests_cost_their_question_not_their_prompt() {
    let _guard = ONE_AT_A_TIME.lock().unwrap();
    let spec = SharedPrefixSpec {
        num_requests: Some(100_000),
        ..Default::default()
    };
    let per = bytes_per_request(100_000, || Box::new(spec.build(0).unwrap()));
    // A private String prompt would be 4 * (2048 + 128) = 8704 B. Shared: the
    // 512 B question + its Arc header, 2 segment pointers, the inline struct,
    // and 64 system prompts of 8 KiB amortised over 100k requests (~5 B).
    assert!(per < 800.0, "{per} B/request");
}

#[test]
fn trace_requests_hold_each_block_once() {
    let _guard = ONE_AT_A_TIME.lock().unwrap();
    let n = 2_000;
    let spec = TraceSpec {
        max_requests: Some(n as u64),
        block_cache: 1 << 20,
        ..Default::default()
    };
    let rows = read_trace(&spec.resolved_path(), MOONCAKE_BLOCK_TOKENS).unwrap();
    let rows = &rows[..n];
    let private: usize = rows.iter().map(|r| 4 * r.input_length as usize).sum();
    let mut blocks = HashSet::new();
    for r in rows {
        let last = r.hash_ids.len() - 1;
        for (i, id) in r.hash_ids.iter().enumerate() {
            let cut = if i == last {
                r.input_length as usize - 512 * last
            } else {
                512
            };
            blocks.insert((*id, cut));
        }
    }
    let unique: usize = blocks.iter().map(|(_, t)| 4 * t).sum();
    let per = bytes_per_request(n, || spec.build(0).unwrap());
    let (private, unique) = (private as f64 / n as f64, unique as f64 / n as f64);
    eprintln!("trace: private text {private:.0} B/request, distinct blocks {unique:.0} B/request");
    // Each distinct block is held once: the text costs what the distinct
    // blocks weigh, plus per-request overhead (struct, segment pointers, Arc
    // headers, cache entries, the parsed rows of the whole trace) under 4 KB.
    assert!(per >= unique, "{per} < {unique}");
    assert!(per < unique + 4_000.0, "{per} vs {unique}");
    assert!(per < 0.9 * private, "{per} vs {private}");
}
