//! Software prefetch: start loading a cache line well before it is used.
//!
//! With a thousand engines in one simulation every engine's block pool and
//! prefix index are cold when its turn comes, and the index probes of
//! consecutive operations are dependent on work in between, so the CPU
//! cannot overlap their misses by itself. Issuing the loads early, in a
//! pass that only computes addresses, lets them proceed in parallel. A
//! prefetch is only a hint: it never changes a result.

/// Hint the CPU to bring the first `lines` 64-byte cache lines of `x` into the cache.
#[inline(always)]
pub(crate) fn prefetch_lines<T>(x: &T, lines: usize) {
    let base: *const u8 = (x as *const T).cast();
    for i in 0..lines.min(size_of::<T>().div_ceil(64)) {
        // Stays within `x`: `i * 64 < size_of::<T>()`.
        prefetch_ptr(base.wrapping_add(i * 64));
    }
}

/// Hint the CPU to bring the cache line holding `x` into the cache.
#[inline(always)]
pub(crate) fn prefetch<T>(x: &T) {
    prefetch_ptr((x as *const T).cast());
}

/// Hint the CPU to bring the cache line at `p` into the cache.
#[inline(always)]
fn prefetch_ptr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` never faults and writes nothing, whatever the
    // address (callers pass addresses inside live objects anyway); SSE is
    // part of the x86_64 baseline, so the instruction always exists.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
