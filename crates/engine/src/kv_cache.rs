//! The paged KV cache: a block pool with reference counts, an LRU free
//! queue, and the prefix cache (chained block hash → block).
//!
//! Modelled on vLLM V1's `BlockPool`: a block whose reference count drops to
//! zero goes to the tail of the free queue but keeps its hash, so a later
//! request with the same prefix can take it back ("touch"); allocation pops
//! from the head, evicting the least recently freed cached block. Freed
//! blocks of one request are queued tail-first, so a prefix's tail is
//! evicted before its head.
//!
//! The free queue is a ring buffer of (block, stamp) entries rather than
//! vLLM's doubly linked list: taking a block out of the middle (a prefix
//! hit) just bumps the block's stamp, leaving a stale entry that is skipped
//! when it reaches the head. Allocation then reads the queue sequentially
//! instead of chasing pointers, which matters when a thousand engines keep
//! the pool out of the CPU cache. Stale entries are compacted away once
//! they outnumber the blocks.
//!
//! Blocks never allocated yet form the head of the free queue in id order
//! (the order a new pool queues them); they are kept implicit, as the ids
//! from `blocks.len()` up, and a block's entry in `blocks` is created when
//! it is first allocated. So a new engine writes nothing per block: with a
//! thousand engines of 27,000 blocks, touching every pool, queue and index
//! page up front cost about a gigabyte of page faults before the first
//! request, and a short simulation never touches most of it.
//!
//! Simplification: one block per hash. A newly filled block whose hash is
//! already cached stays unhashed (vLLM keeps both copies reachable).

use std::collections::VecDeque;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::block_index::BlockIndex;
use crate::events::KvEvent;

/// Seed of the first block of a chain (mixed with the adapter salt).
const ROOT_SEED: u64 = 0x5157_4954_4348_5944;

/// `Block::hash` of a block that caches nothing (block hashes are never 0).
const NO_HASH: u64 = 0;

/// Salt that makes an adapter's blocks distinct from the base model's.
pub(crate) fn adapter_salt(adapter: Option<&str>) -> u64 {
    adapter.map_or(0, |a| xxh3_64(a.as_bytes()))
}

/// Chained hash of one full block: covers its tokens, its parent's hash and the adapter salt.
#[inline] // into the per-prompt loop: a prompt is a hundred or more blocks
pub(crate) fn hash_block(
    parent: Option<u64>,
    salt: u64,
    tokens: &[u32],
    scratch: &mut Vec<u8>,
) -> u64 {
    // The salt enters through the root seed; later blocks inherit it through the chain.
    let seed = parent.unwrap_or(ROOT_SEED ^ salt);
    // Common block sizes go through a fixed-size stack array: with the
    // length a constant, the compiler converts the tokens with a few vector
    // moves and specialises the hash. (A variable-length copy into a stack
    // buffer compiles to a `memcpy` call whose stores the hash's first
    // loads then stall on: that was a tenth of the engine's time.)
    let fixed = match tokens.len() {
        8 => <&[u32; 8]>::try_from(tokens)
            .ok()
            .map(|t| hash_fixed::<8, 32>(t, seed)),
        16 => <&[u32; 16]>::try_from(tokens)
            .ok()
            .map(|t| hash_fixed::<16, 64>(t, seed)),
        32 => <&[u32; 32]>::try_from(tokens)
            .ok()
            .map(|t| hash_fixed::<32, 128>(t, seed)),
        64 => <&[u32; 64]>::try_from(tokens)
            .ok()
            .map(|t| hash_fixed::<64, 256>(t, seed)),
        _ => None,
    };
    nonzero(fixed.unwrap_or_else(|| hash_bytes(tokens, seed, scratch)))
}

/// xxh3 of the little-endian bytes of `N` tokens (`BYTES = 4 N`).
#[inline(always)]
fn hash_fixed<const N: usize, const BYTES: usize>(tokens: &[u32; N], seed: u64) -> u64 {
    const { assert!(N * 4 == BYTES) };
    let mut buf = [0u8; BYTES];
    for (i, t) in tokens.iter().enumerate() {
        buf[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&buf, seed)
}

/// xxh3 of the little-endian bytes of `tokens`, through `scratch`.
fn hash_bytes(tokens: &[u32], seed: u64, scratch: &mut Vec<u8>) -> u64 {
    scratch.clear();
    for t in tokens {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(scratch, seed)
}

/// Keep 0 free as the "no hash" marker.
fn nonzero(h: u64) -> u64 {
    if h == NO_HASH {
        1
    } else {
        h
    }
}

/// Hashes of every full block of `tokens`.
#[cfg(test)]
pub(crate) fn hash_prompt(
    tokens: &[u32],
    block_size: usize,
    salt: u64,
    scratch: &mut Vec<u8>,
) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    hash_prompt_into(tokens, block_size, salt, scratch, &mut out);
    out
}

/// Append the hashes of every full block of `tokens` to `out`.
pub(crate) fn hash_prompt_into(
    tokens: &[u32],
    block_size: usize,
    salt: u64,
    scratch: &mut Vec<u8>,
    out: &mut Vec<u64>,
) {
    let mut parent = None;
    for chunk in tokens.chunks_exact(block_size) {
        let h = hash_block(parent, salt, chunk, scratch);
        out.push(h);
        parent = Some(h);
    }
}

/// One physical KV block (16 bytes: the pool is accessed at random a lot).
///
/// Invariant: a block has a live free-queue entry (one carrying its current
/// `stamp`) exactly when `ref_cnt == 0`.
#[derive(Debug, Clone)]
struct Block {
    /// Its prefix-cache hash, `NO_HASH` when it caches nothing.
    hash: u64,
    /// Requests holding it.
    ref_cnt: u32,
    /// Bumped whenever the block enters or leaves the free queue, so older
    /// queue entries for it are recognisably stale. (Wrapping after 2^32
    /// moves of one block while a stale entry survives is not a concern:
    /// compaction bounds how long stale entries live.)
    stamp: u32,
}

/// The block pool with prefix caching.
#[derive(Debug)]
pub(crate) struct KvCache {
    block_size: u32,
    /// Pool size.
    num_blocks: u32,
    /// Blocks allocated at least once, by id; the rest (ids from
    /// `blocks.len()` to `num_blocks`) are free, hold nothing and head the
    /// free queue. The capacity is reserved up front, so it never moves.
    blocks: Vec<Block>,
    /// Free queue after the never-allocated blocks, LRU first; entries
    /// whose stamp is not the block's are stale.
    queue: VecDeque<(u32, u32)>,
    /// Blocks with `ref_cnt == 0`: the never-allocated ones plus the live entries in `queue`.
    free_len: u32,
    map: BlockIndex,
    prefix_caching: bool,
    emit: bool,
    events: Vec<KvEvent>,
    /// Hashes evicted by the current allocation, reported as one event.
    removed: Vec<u64>,
}

impl KvCache {
    /// A pool of `num_blocks` free blocks.
    pub(crate) fn new(num_blocks: u32, block_size: u32, prefix_caching: bool, emit: bool) -> Self {
        let n = num_blocks as usize;
        Self {
            block_size,
            num_blocks,
            // Reserved, not written: pages are touched as blocks come into use.
            blocks: Vec::with_capacity(n),
            queue: VecDeque::with_capacity(2 * n + 64),
            free_len: num_blocks,
            map: BlockIndex::new(n),
            prefix_caching,
            emit,
            events: Vec::new(),
            removed: Vec::new(),
        }
    }

    /// Tokens per block.
    pub(crate) fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether blocks are registered for reuse.
    pub(crate) fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Whether KV events are recorded.
    pub(crate) fn emits(&self) -> bool {
        self.emit
    }

    /// Total blocks.
    pub(crate) fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Blocks never allocated yet (the head of the free queue).
    fn num_fresh(&self) -> u32 {
        self.num_blocks - self.blocks.len() as u32
    }

    /// Blocks not held by any request (including cached ones that can be evicted).
    pub(crate) fn num_free(&self) -> u32 {
        self.free_len
    }

    /// Blocks held by requests.
    pub(crate) fn num_used(&self) -> u32 {
        self.num_blocks() - self.free_len
    }

    /// Blocks needed to hold `tokens` tokens.
    pub(crate) fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_size)
    }

    /// Append the blocks caching the longest prefix of `hashes` (at most `max_blocks`) to `out`.
    ///
    /// Nothing is touched; call [`KvCache::touch`] once admission is certain.
    pub(crate) fn find_prefix(
        &self,
        hashes: &[u64],
        max_blocks: usize,
        out: &mut Vec<u32>,
    ) -> usize {
        if !self.prefix_caching {
            return 0;
        }
        let mut n = 0;
        let mut prev: Option<u32> = None;
        for &h in hashes.iter().take(max_blocks) {
            // A prefix's blocks were usually allocated as one run of the free
            // queue, so a block's successor tends to sit next to it: check the
            // neighbours (whose entries share its cache line) before probing
            // the index, a likely cache and TLB miss. Same answer either way:
            // a block holding `h` is the one block the index maps `h` to.
            let found = prev
                .and_then(|p| self.neighbour_holding(p, h))
                .or_else(|| self.lookup(h));
            match found {
                Some(b) => {
                    out.push(b);
                    prev = Some(b);
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Block `p + 1` or `p - 1` if it caches `hash`.
    fn neighbour_holding(&self, p: u32, hash: u64) -> Option<u32> {
        let holds = |b: u32| self.blocks.get(b as usize).is_some_and(|x| x.hash == hash);
        let up = p.wrapping_add(1);
        if holds(up) {
            return Some(up);
        }
        let down = p.wrapping_sub(1);
        holds(down).then_some(down)
    }

    /// Start fetching the index slot where a lookup of `hash` begins.
    pub(crate) fn prefetch_lookup(&self, hash: u64) {
        if self.prefix_caching {
            self.map.prefetch(hash);
        }
    }

    /// The block caching `hash`, if any.
    fn lookup(&self, hash: u64) -> Option<u32> {
        let blocks = &self.blocks;
        self.map.get(hash, |b| blocks[b as usize].hash)
    }

    /// Whether `new_blocks` fresh blocks can be allocated after touching `hits`.
    ///
    /// Hit blocks that are free count against the free pool, since touching
    /// them takes them out of it.
    pub(crate) fn can_allocate(&self, hits: &[u32], new_blocks: u32) -> bool {
        let evictable_hits = hits
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count() as u64;
        u64::from(new_blocks) + evictable_hits <= u64::from(self.free_len)
    }

    /// Take a reference on cached blocks found by [`KvCache::find_prefix`].
    pub(crate) fn touch(&mut self, hits: &[u32]) {
        for &b in hits {
            let blk = &mut self.blocks[b as usize];
            if blk.ref_cnt == 0 {
                // Leaves the free queue: its entry there goes stale.
                blk.stamp = blk.stamp.wrapping_add(1);
                self.free_len -= 1;
            }
            blk.ref_cnt += 1;
        }
    }

    /// Allocate `n` blocks from the head of the free queue (evicting cached
    /// ones) and append them to `out`; false, allocating nothing, if too few are free.
    pub(crate) fn allocate(&mut self, n: u32, out: &mut Vec<u32>) -> bool {
        if n > self.free_len {
            return false;
        }
        let first = out.len();
        for _ in 0..n {
            let b = self.pop_front();
            out.push(b);
            let blk = &mut self.blocks[b as usize];
            blk.ref_cnt = 1;
            if blk.hash != NO_HASH {
                self.map.prefetch(blk.hash);
            }
        }
        // Evictions in a second pass, so the index probes of all the
        // blocks overlap (nothing reads the index in between).
        for &b in &out[first..] {
            let h = std::mem::replace(&mut self.blocks[b as usize].hash, NO_HASH);
            if h != NO_HASH {
                // A registered block is always the one its hash maps to.
                let removed = self.map.remove(h, b);
                debug_assert!(removed);
                if self.emit {
                    self.removed.push(h);
                }
            }
        }
        if !self.removed.is_empty() {
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: std::mem::take(&mut self.removed),
            });
        }
        true
    }

    /// Start fetching the pool entries of the next `n` blocks [`KvCache::allocate`] would take.
    pub(crate) fn prefetch_allocation(&self, n: u32) {
        // Never-allocated blocks come first and need no fetching. Stale
        // entries are skipped by allocation, so this may fetch fewer than
        // `n` live blocks; it is only a hint.
        let n = n.saturating_sub(self.num_fresh());
        for &(b, _) in self.queue.iter().take(n as usize) {
            if let Some(blk) = self.blocks.get(b as usize) {
                crate::prefetch::prefetch(blk);
            }
        }
    }

    /// Start fetching the index slots the next `n` allocations will clear
    /// (best after [`KvCache::prefetch_allocation`] had time to land).
    pub(crate) fn prefetch_evictions(&self, n: u32) {
        let n = n.saturating_sub(self.num_fresh());
        for &(b, stamp) in self.queue.iter().take(n as usize) {
            match self.blocks.get(b as usize) {
                Some(blk) if blk.stamp == stamp && blk.hash != NO_HASH => {
                    self.map.prefetch(blk.hash);
                }
                _ => {}
            }
        }
    }

    /// Drop one reference on each block, last block first, queueing those that become free.
    pub(crate) fn free(&mut self, blocks: &[u32]) {
        // A finished request's own blocks are scattered over the pool:
        // start fetching all of them before the dependent updates.
        for &b in blocks {
            if let Some(blk) = self.blocks.get(b as usize) {
                crate::prefetch::prefetch(blk);
            }
        }
        for &b in blocks.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.ref_cnt > 0, "double free of block {b}");
            blk.ref_cnt = blk.ref_cnt.saturating_sub(1);
            if blk.ref_cnt == 0 {
                blk.stamp = blk.stamp.wrapping_add(1);
                self.queue.push_back((b, blk.stamp));
                self.free_len += 1;
            }
        }
        if self.queue.len() > 2 * self.num_blocks as usize + 64 {
            self.compact();
        }
    }

    /// Take the live entry at the head of the free queue (there is one: `free_len > 0`).
    fn pop_front(&mut self) -> u32 {
        if self.num_fresh() > 0 {
            // Its implicit queue entry has stamp 0; leaving the queue bumps it.
            let b = self.blocks.len() as u32;
            self.blocks.push(Block {
                hash: NO_HASH,
                ref_cnt: 0,
                stamp: 1,
            });
            self.free_len -= 1;
            return b;
        }
        while let Some((b, stamp)) = self.queue.pop_front() {
            let blk = &mut self.blocks[b as usize];
            if blk.stamp == stamp && blk.ref_cnt == 0 {
                blk.stamp = blk.stamp.wrapping_add(1);
                self.free_len -= 1;
                return b;
            }
        }
        // Unreachable while free_len counts the live entries; returning a
        // block anyway would corrupt the pool, so fail loudly in debug only.
        debug_assert!(false, "free queue empty with free_len {}", self.free_len);
        0
    }

    /// Drop stale entries from the free queue.
    fn compact(&mut self) {
        let blocks = &self.blocks;
        self.queue.retain(|&(b, stamp)| {
            blocks[b as usize].stamp == stamp && blocks[b as usize].ref_cnt == 0
        });
    }

    /// Register a full block under `hash`; true if it became reusable.
    ///
    /// False when caching is off, the block is already registered (a prefix
    /// hit) or another block already caches this hash.
    #[cfg(test)]
    pub(crate) fn commit(&mut self, block: u32, hash: u64) -> bool {
        if self.blocks[block as usize].hash != NO_HASH {
            return false;
        }
        self.commit_computed(block, hash)
    }

    /// [`KvCache::commit`] for a block its holder has just computed, which
    /// therefore caches nothing yet (not a prefix hit).
    ///
    /// Skips reading the block, which is cold by then: with a thousand
    /// engines that read was a cache miss on every block that filled.
    pub(crate) fn commit_computed(&mut self, block: u32, hash: u64) -> bool {
        debug_assert_eq!(
            self.blocks[block as usize].hash, NO_HASH,
            "block {block} is cached"
        );
        if !self.prefix_caching {
            return false;
        }
        let blocks = &self.blocks;
        if !self
            .map
            .insert_if_absent(hash, block, |b| blocks[b as usize].hash)
        {
            return false;
        }
        self.blocks[block as usize].hash = hash;
        true
    }

    /// Start fetching the index slot [`KvCache::commit_computed`] will probe for `hash`.
    pub(crate) fn prefetch_commit(&self, hash: u64) {
        if self.prefix_caching {
            self.map.prefetch(hash);
        }
    }

    /// Whether a block is in the free queue (evictable if it caches a hash).
    pub(crate) fn is_free(&self, block: u32) -> bool {
        self.blocks[block as usize].ref_cnt == 0
    }

    /// Position in the free queue (0 = next evicted) of the first of
    /// `sorted` found within the first `limit` queued blocks.
    pub(crate) fn first_queued_among(&self, sorted: &[u32], limit: u64) -> Option<u64> {
        // Never-allocated blocks head the queue; none is in `sorted`, which
        // holds cached blocks.
        debug_assert!(sorted.iter().all(|&b| (b as usize) < self.blocks.len()));
        let mut pos = u64::from(self.num_fresh());
        for &(b, stamp) in &self.queue {
            if pos >= limit {
                break;
            }
            if self.blocks[b as usize].stamp != stamp {
                continue;
            }
            if sorted.binary_search(&b).is_ok() {
                return Some(pos);
            }
            pos += 1;
        }
        None
    }

    /// Record a KV event (when events are on).
    pub(crate) fn push_event(&mut self, ev: KvEvent) {
        if self.emit {
            self.events.push(ev);
        }
    }

    /// Forget every cached hash; refused (false) while any block is in use, as in vLLM.
    pub(crate) fn reset(&mut self) -> bool {
        if self.num_used() > 0 {
            return false;
        }
        for b in &mut self.blocks {
            b.hash = NO_HASH;
        }
        self.map.clear();
        self.push_event(KvEvent::AllBlocksCleared);
        true
    }

    /// Move recorded KV events to `out`.
    pub(crate) fn drain_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events);
    }

    /// Number of hashes in the prefix cache.
    #[cfg(test)]
    pub(crate) fn num_cached(&self) -> usize {
        self.blocks.iter().filter(|b| b.hash != NO_HASH).count()
    }

    /// Check internal consistency against the reference counts the requests imply.
    pub(crate) fn check(&self, expected_refs: &[u32]) -> Result<(), String> {
        let n = self.num_blocks as usize;
        if expected_refs.len() != n {
            return Err("reference vector has the wrong length".into());
        }
        if self.blocks.len() > n {
            return Err("more blocks than the pool holds".into());
        }
        // Never-allocated blocks are live queue entries by construction.
        let mut in_queue = vec![false; n];
        in_queue[self.blocks.len()..].fill(true);
        let mut queued = self.num_fresh();
        for &(b, stamp) in &self.queue {
            let Some(blk) = self.blocks.get(b as usize) else {
                return Err(format!("free queue holds bad block {b}"));
            };
            if blk.stamp != stamp {
                continue;
            }
            if in_queue[b as usize] {
                return Err(format!("block {b} is live twice in the free queue"));
            }
            in_queue[b as usize] = true;
            queued += 1;
        }
        if queued != self.free_len {
            return Err(format!(
                "free queue has {queued} live entries, free_len is {}",
                self.free_len
            ));
        }
        let fresh = Block {
            hash: NO_HASH,
            ref_cnt: 0,
            stamp: 0,
        };
        let all = self
            .blocks
            .iter()
            .chain(std::iter::repeat_n(&fresh, self.num_fresh() as usize));
        for (i, (blk, &want)) in all.zip(expected_refs).enumerate() {
            if blk.ref_cnt != want {
                return Err(format!(
                    "block {i}: ref_cnt {} but {want} holders",
                    blk.ref_cnt
                ));
            }
            if (blk.ref_cnt == 0) != in_queue[i] {
                return Err(format!(
                    "block {i}: ref_cnt {} but queued={}",
                    blk.ref_cnt, in_queue[i]
                ));
            }
            if blk.hash != NO_HASH && self.lookup(blk.hash) != Some(i as u32) {
                return Err(format!("block {i} has a hash not mapped to it"));
            }
        }
        let hashed = self.blocks.iter().filter(|b| b.hash != NO_HASH).count();
        if self.map.len() != hashed {
            return Err(format!(
                "{} index entries for {hashed} hashed blocks",
                self.map.len()
            ));
        }
        for (tag, b) in self.map.iter() {
            match self.blocks.get(b as usize).map(|x| x.hash) {
                Some(h) if h != NO_HASH && BlockIndex::tag(h) == tag => {}
                _ => return Err(format!("index entry for block {b} is stale")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(c: &KvCache, held: &[&[u32]]) -> Vec<u32> {
        let mut r = vec![0; c.num_blocks() as usize];
        for h in held {
            for &b in *h {
                r[b as usize] += 1;
            }
        }
        r
    }

    #[test]
    fn allocate_free_and_reuse_by_hash() {
        let mut c = KvCache::new(4, 16, true, true);
        let mut a = Vec::new();
        assert!(c.allocate(2, &mut a));
        assert_eq!(c.num_used(), 2);
        assert!(c.commit(a[0], 11));
        assert!(c.commit(a[1], 22));
        assert!(!c.commit(a[1], 22), "already registered");
        c.free(&a);
        assert_eq!(c.num_used(), 0);
        c.check(&refs(&c, &[])).unwrap();
        let mut hits = Vec::new();
        assert_eq!(c.find_prefix(&[11, 22, 33], 3, &mut hits), 2);
        assert_eq!(hits, a);
        assert!(c.can_allocate(&hits, 2));
        assert!(!c.can_allocate(&hits, 3));
        c.touch(&hits);
        assert_eq!(c.num_used(), 2);
        c.check(&refs(&c, &[&hits])).unwrap();
    }

    #[test]
    fn eviction_is_lru_and_tail_first() {
        let mut c = KvCache::new(4, 16, true, true);
        let mut a = Vec::new();
        assert!(c.allocate(4, &mut a));
        for (i, &b) in a.iter().enumerate() {
            assert!(c.commit(b, 100 + i as u64));
        }
        // Freed tail-first: block a[3] becomes the oldest free block.
        c.free(&a);
        let mut out = Vec::new();
        let mut x = Vec::new();
        c.drain_events(&mut out);
        assert!(c.allocate(1, &mut x));
        assert_eq!(x, vec![a[3]]);
        c.drain_events(&mut out);
        assert_eq!(
            out,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![103]
            }]
        );
        let mut hits = Vec::new();
        assert_eq!(c.find_prefix(&[100, 101, 102, 103], 4, &mut hits), 3);
        c.check(&refs(&c, &[&x])).unwrap();
    }

    #[test]
    fn shared_blocks_need_all_holders_to_free() {
        let mut c = KvCache::new(2, 16, true, false);
        let mut a = Vec::new();
        assert!(c.allocate(1, &mut a));
        assert!(c.commit(a[0], 5));
        let mut hits = Vec::new();
        c.find_prefix(&[5], 1, &mut hits);
        c.touch(&hits);
        c.free(&a);
        assert_eq!(c.num_used(), 1);
        c.free(&hits);
        assert_eq!(c.num_used(), 0);
        assert!(!c.allocate(3, &mut Vec::new()));
        c.check(&refs(&c, &[])).unwrap();
    }

    #[test]
    fn duplicate_hash_stays_unregistered() {
        let mut c = KvCache::new(3, 16, true, false);
        let mut a = Vec::new();
        assert!(c.allocate(2, &mut a));
        assert!(c.commit(a[0], 9));
        assert!(!c.commit(a[1], 9));
        assert_eq!(c.num_cached(), 1);
    }

    #[test]
    fn churn_keeps_only_live_hashes() {
        let mut c = KvCache::new(2, 16, true, false);
        for round in 0..100u64 {
            let mut a = Vec::new();
            assert!(c.allocate(2, &mut a));
            assert!(c.commit(a[0], 1000 + 2 * round));
            assert!(c.commit(a[1], 1001 + 2 * round));
            c.free(&a);
            c.check(&refs(&c, &[])).unwrap();
            assert_eq!(c.map.len(), 2);
        }
        let mut hits = Vec::new();
        assert_eq!(c.find_prefix(&[1000, 1001], 2, &mut hits), 0);
        assert_eq!(c.find_prefix(&[1198, 1199], 2, &mut hits), 2);
    }

    #[test]
    fn repeated_hits_do_not_grow_the_queue_without_bound() {
        let mut c = KvCache::new(4, 16, true, false);
        let mut a = Vec::new();
        assert!(c.allocate(2, &mut a));
        assert!(c.commit(a[0], 7));
        assert!(c.commit(a[1], 8));
        c.free(&a);
        for _ in 0..1000 {
            let mut hits = Vec::new();
            assert_eq!(c.find_prefix(&[7, 8], 2, &mut hits), 2);
            c.touch(&hits);
            c.free(&hits);
            assert!(c.queue.len() <= 2 * 4 + 64 + 2);
        }
        c.check(&refs(&c, &[])).unwrap();
        // LRU order survived: the two never-used blocks go first.
        let mut x = Vec::new();
        assert!(c.allocate(2, &mut x));
        assert!(!x.contains(&a[0]) && !x.contains(&a[1]));
        let mut hits = Vec::new();
        assert_eq!(c.find_prefix(&[7, 8], 2, &mut hits), 2);
    }

    #[test]
    fn disabled_caching_never_hits() {
        let mut c = KvCache::new(2, 16, false, false);
        let mut a = Vec::new();
        assert!(c.allocate(1, &mut a));
        assert!(!c.commit(a[0], 1));
        c.free(&a);
        assert_eq!(c.find_prefix(&[1], 1, &mut Vec::new()), 0);
    }

    #[test]
    fn reset_refused_while_in_use() {
        let mut c = KvCache::new(2, 16, true, true);
        let mut a = Vec::new();
        assert!(c.allocate(1, &mut a));
        assert!(c.commit(a[0], 1));
        assert!(!c.reset());
        c.free(&a);
        assert!(c.reset());
        assert_eq!(c.num_cached(), 0);
        let mut ev = Vec::new();
        c.drain_events(&mut ev);
        assert_eq!(ev, vec![KvEvent::AllBlocksCleared]);
    }

    #[test]
    fn never_used_blocks_head_the_queue_in_id_order() {
        // As if the new pool had queued 0..n: frees go behind the blocks
        // never allocated, and eviction order follows.
        let mut c = KvCache::new(5, 16, true, true);
        let mut a = Vec::new();
        assert!(c.allocate(2, &mut a));
        assert_eq!(a, vec![0, 1]);
        assert!(c.commit(a[0], 10));
        assert!(c.commit(a[1], 11));
        c.free(&a);
        c.check(&refs(&c, &[])).unwrap();
        assert_eq!(
            c.first_queued_among(&[0, 1], 10),
            Some(3),
            "behind 2, 3, 4, then 1"
        );
        let mut b = Vec::new();
        assert!(c.allocate(4, &mut b));
        assert_eq!(b, vec![2, 3, 4, 1], "freed tail-first");
        let mut ev = Vec::new();
        c.drain_events(&mut ev);
        assert_eq!(
            ev,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![11]
            }]
        );
        let mut hits = Vec::new();
        assert_eq!(c.find_prefix(&[10], 1, &mut hits), 1);
        c.check(&refs(&c, &[&b])).unwrap();
    }

    #[test]
    fn prefix_lookup_falls_back_to_the_index_past_neighbours() {
        // The chain's blocks are not adjacent, and a neighbour holds another hash.
        let mut c = KvCache::new(8, 16, true, false);
        let mut a = Vec::new();
        assert!(c.allocate(8, &mut a));
        for (b, h) in [(3, 100), (4, 555), (2, 556), (6, 101), (0, 102)] {
            assert!(c.commit(a[b], h));
        }
        c.free(&a);
        let mut hits = Vec::new();
        assert_eq!(c.find_prefix(&[100, 101, 102, 103], 4, &mut hits), 3);
        assert_eq!(hits, vec![3, 6, 0]);
        hits.clear();
        assert_eq!(c.find_prefix(&[100, 101, 102], 2, &mut hits), 2);
        assert_eq!(hits, vec![3, 6]);
    }

    proptest::proptest! {
        /// `find_prefix` (neighbour probing first) answers exactly as index
        /// lookups alone, and the pool stays consistent, under random use.
        #[test]
        fn prefix_lookup_matches_index_lookups(
            ops in proptest::collection::vec((0u8..4, 0u64..40, 1u32..6), 1..300),
        ) {
            let mut c = KvCache::new(24, 4, true, true);
            // Requests' blocks; a chain's hashes are `base + k`.
            let mut held: Vec<Vec<u32>> = Vec::new();
            for (op, base, n) in ops {
                let chain: Vec<u64> = (0..n as u64).map(|k| 1 + base * 8 + k).collect();
                match op {
                    0 => {
                        let mut hits = Vec::new();
                        let found = c.find_prefix(&chain, chain.len(), &mut hits);
                        let want: Vec<u32> = chain.iter().map_while(|&h| c.lookup(h)).collect();
                        proptest::prop_assert_eq!(found, want.len());
                        proptest::prop_assert_eq!(&hits, &want);
                        let new = n - found as u32;
                        if c.can_allocate(&hits, new) {
                            c.touch(&hits);
                            let mut blocks = hits.clone();
                            proptest::prop_assert!(c.allocate(new, &mut blocks));
                            for (k, &b) in blocks.iter().enumerate().skip(found) {
                                c.commit_computed(b, chain[k]);
                            }
                            held.push(blocks);
                        }
                    }
                    1 | 2 if !held.is_empty() => {
                        let blocks = held.swap_remove(base as usize % held.len());
                        c.free(&blocks);
                    }
                    _ => {
                        let mut blocks = Vec::new();
                        if c.allocate(n.min(c.num_free()), &mut blocks) {
                            held.push(blocks);
                        }
                    }
                }
                let all: Vec<&[u32]> = held.iter().map(Vec::as_slice).collect();
                c.check(&refs(&c, &all)).map_err(proptest::test_runner::TestCaseError::fail)?;
            }
        }
    }

    #[test]
    fn block_hash_is_xxh3_of_the_little_endian_tokens() {
        // Pins the hash (it is visible in KV events) across the fixed-size
        // fast paths and the general one.
        let mut scratch = Vec::new();
        for len in [1usize, 4, 8, 12, 16, 32, 64, 100, 128] {
            let toks: Vec<u32> = (0..len as u32)
                .map(|i| i.wrapping_mul(0x9E37_79B9))
                .collect();
            let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
            let want = nonzero(xxh3_64_with_seed(&bytes, 77));
            assert_eq!(
                hash_block(Some(77), 5, &toks, &mut scratch),
                want,
                "{len} tokens"
            );
            let root = nonzero(xxh3_64_with_seed(&bytes, ROOT_SEED ^ 5));
            assert_eq!(
                hash_block(None, 5, &toks, &mut scratch),
                root,
                "{len} tokens"
            );
        }
    }

    #[test]
    fn prompt_hashes_chain_and_depend_on_salt() {
        let toks: Vec<u32> = (0..40).collect();
        let mut s = Vec::new();
        let h = hash_prompt(&toks, 16, 0, &mut s);
        assert_eq!(h.len(), 2);
        let h2 = hash_prompt(&toks[..32], 16, 0, &mut s);
        assert_eq!(h, h2);
        let salted = hash_prompt(&toks, 16, adapter_salt(Some("a")), &mut s);
        assert_ne!(h[0], salted[0]);
        let mut other = toks.clone();
        other[0] = 999;
        let h3 = hash_prompt(&other, 16, 0, &mut s);
        assert_ne!(h[1], h3[1], "a change in block 0 changes block 1's hash");
    }
}
