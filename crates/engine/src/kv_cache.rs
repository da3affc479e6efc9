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
pub(crate) fn hash_block(
    parent: Option<u64>,
    salt: u64,
    tokens: &[u32],
    scratch: &mut Vec<u8>,
) -> u64 {
    // The salt enters through the root seed; later blocks inherit it through the chain.
    let seed = parent.unwrap_or(ROOT_SEED ^ salt);
    // Common block sizes fit a stack buffer; byte-wise stores keep the
    // conversion branch- and call-free (a per-token memcpy was a hot spot).
    const STACK_TOKENS: usize = 64;
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; STACK_TOKENS * 4];
        for (i, t) in tokens.iter().enumerate() {
            let b = t.to_le_bytes();
            buf[4 * i] = b[0];
            buf[4 * i + 1] = b[1];
            buf[4 * i + 2] = b[2];
            buf[4 * i + 3] = b[3];
        }
        return nonzero(xxh3_64_with_seed(&buf[..tokens.len() * 4], seed));
    }
    scratch.clear();
    for t in tokens {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    nonzero(xxh3_64_with_seed(scratch, seed))
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
pub(crate) fn hash_prompt(
    tokens: &[u32],
    block_size: usize,
    salt: u64,
    scratch: &mut Vec<u8>,
) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for chunk in tokens.chunks_exact(block_size) {
        let h = hash_block(parent, salt, chunk, scratch);
        out.push(h);
        parent = Some(h);
    }
    out
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
    blocks: Vec<Block>,
    /// Free queue, LRU first; entries whose stamp is not the block's are stale.
    queue: VecDeque<(u32, u32)>,
    /// Live entries in `queue` (= blocks with `ref_cnt == 0`).
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
        let blocks = vec![
            Block {
                hash: NO_HASH,
                ref_cnt: 0,
                stamp: 0,
            };
            n
        ];
        let mut queue = VecDeque::with_capacity(2 * n + 64);
        queue.extend((0..num_blocks).map(|b| (b, 0)));
        Self {
            block_size,
            blocks,
            queue,
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
        self.blocks.len() as u32
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
        for _ in 0..n {
            let b = self.pop_front();
            out.push(b);
            let blk = &mut self.blocks[b as usize];
            blk.ref_cnt = 1;
            let h = std::mem::replace(&mut blk.hash, NO_HASH);
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

    /// Drop one reference on each block, last block first, queueing those that become free.
    pub(crate) fn free(&mut self, blocks: &[u32]) {
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
        if self.queue.len() > 2 * self.blocks.len() + 64 {
            self.compact();
        }
    }

    /// Take the live entry at the head of the free queue (there is one: `free_len > 0`).
    fn pop_front(&mut self) -> u32 {
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
    pub(crate) fn commit(&mut self, block: u32, hash: u64) -> bool {
        if !self.prefix_caching || self.blocks[block as usize].hash != NO_HASH {
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

    /// Whether a block is in the free queue (evictable if it caches a hash).
    pub(crate) fn is_free(&self, block: u32) -> bool {
        self.blocks[block as usize].ref_cnt == 0
    }

    /// Position in the free queue (0 = next evicted) of the first of
    /// `sorted` found within the first `limit` queued blocks.
    pub(crate) fn first_queued_among(&self, sorted: &[u32], limit: u64) -> Option<u64> {
        let mut pos = 0u64;
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
        if expected_refs.len() != self.blocks.len() {
            return Err("reference vector has the wrong length".into());
        }
        let mut in_queue = vec![false; self.blocks.len()];
        let mut queued = 0u32;
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
        for (i, (blk, &want)) in self.blocks.iter().zip(expected_refs).enumerate() {
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
