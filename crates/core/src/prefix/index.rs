//! Which instance holds which prompt blocks: per-instance LRU lanes over one shared block table.
//!
//! Memory: one node (40 bytes) per (instance, block) entry plus a bucket (17 bytes) in each of
//! two hash tables. Growth by doubling at most doubles the node array, and a table keeps at most
//! 16/7 buckets per entry, so an entry costs at most 2 × 40 + 2 × (16/7) × 17 < 160 bytes, and
//! about 75 in steady state ([`PrefixIndex::memory_bytes`]
//! reports the real figure). Every lane is bounded by its capacity, so the index is bounded by
//! the sum of the capacities.
//!
//! Invariant (prefix closure): if an instance holds block k of a chain it holds blocks 0..k.
//! Inserting touches a chain deepest-first, so a parent is always more recent than its
//! children; LRU eviction therefore removes leaves, and [`PrefixIndex::forget_not_newer_than`]
//! removes children with their parents. Lookups rely on it: the number of holders of block k
//! never grows with k, so a lookup only walks holder lists where that number drops.

use rustc_hash::FxHashMap;

pub use crate::id::Slot;

const NIL: u32 = u32::MAX;

/// One (instance, block) entry, linked into its instance's LRU lane and its block's holder list.
#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    /// Touch sequence number: larger is more recent.
    seq: u64,
    lru_prev: u32,
    lru_next: u32,
    holder_prev: u32,
    holder_next: u32,
    slot: Slot,
}

/// One instance's LRU list: `head` is the most recent entry, `tail` the next to evict.
#[derive(Debug, Clone, Copy)]
struct Lane {
    head: u32,
    tail: u32,
    len: u32,
    capacity: u32,
    /// Touches so far: a block's age is how many blocks the instance was given since.
    seq: u64,
}

impl Lane {
    const EMPTY: Lane = Lane {
        head: NIL,
        tail: NIL,
        len: 0,
        capacity: 0,
        seq: 0,
    };
}

/// Holder list of one block: first holder node, how many there are and (in the top bits of
/// the same word, so that a table bucket stays 17 bytes) how many chains continued past it.
#[derive(Debug, Clone, Copy)]
struct Holders {
    head: u32,
    count_and_branches: u32,
}

impl Holders {
    /// Bits of `count_and_branches` below the branch count.
    const BRANCH_SHIFT: u32 = 30;
    const COUNT_MASK: u32 = (1 << Self::BRANCH_SHIFT) - 1;
    /// Branches are counted up to here: what matters is whether there are two.
    const MAX_BRANCHES: u32 = 3;

    const EMPTY: Holders = Holders {
        head: NIL,
        count_and_branches: 0,
    };

    /// Instances holding the block (a fleet has far fewer than 2^30).
    fn count(&self) -> u32 {
        self.count_and_branches & Self::COUNT_MASK
    }

    fn set_count(&mut self, count: u32) {
        debug_assert!(count <= Self::COUNT_MASK);
        self.count_and_branches = (self.count_and_branches & !Self::COUNT_MASK) | count;
    }

    /// Chains that continued past this block with a block new to the table (at most
    /// [`Self::MAX_BRANCHES`]): one for a conversation's own history, more where different
    /// prompts share the block.
    fn branches(&self) -> u32 {
        self.count_and_branches >> Self::BRANCH_SHIFT
    }

    fn add_branch(&mut self) {
        let branches = (self.branches() + 1).min(Self::MAX_BRANCHES);
        self.count_and_branches = (branches << Self::BRANCH_SHIFT) | self.count();
    }
}

/// How many leading blocks of a prompt one instance holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMatch {
    /// The instance.
    pub slot: Slot,
    /// Number of leading blocks it holds.
    pub blocks: u32,
}

/// The approximate prefix index (see the module documentation).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    nodes: Vec<Node>,
    free_head: Option<u32>,
    holders: FxHashMap<u64, Holders>,
    owned: FxHashMap<u64, u32>,
    lanes: Vec<Lane>,
    /// Per-slot scratch for lookups: (lookup epoch, matched depth).
    scratch: Vec<(u32, u32)>,
    epoch: u32,
}

/// Key of the (block, instance) entry in `owned`; collisions are detected by checking the node.
fn owner_key(hash: u64, slot: Slot) -> u64 {
    hash ^ (u64::from(slot) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    fn lane_mut(&mut self, slot: Slot) -> &mut Lane {
        let i = slot as usize;
        if i >= self.lanes.len() {
            self.lanes.resize(i + 1, Lane::EMPTY);
            self.scratch.resize(i + 1, (0, 0));
        }
        &mut self.lanes[i]
    }

    /// Sets how many blocks `slot` may hold, evicting its oldest entries if it holds more.
    pub fn set_capacity(&mut self, slot: Slot, blocks: u32) {
        self.lane_mut(slot).capacity = blocks;
        while self.lane_mut(slot).len > blocks {
            self.evict_tail(slot);
        }
    }

    /// Capacity of `slot` in blocks.
    pub fn capacity(&self, slot: Slot) -> u32 {
        self.lanes.get(slot as usize).map_or(0, |l| l.capacity)
    }

    /// Number of blocks `slot` holds.
    pub fn len(&self, slot: Slot) -> u32 {
        self.lanes.get(slot as usize).map_or(0, |l| l.len)
    }

    /// Whether no instance holds anything.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Entries over all instances.
    pub fn total_entries(&self) -> usize {
        self.owned.len()
    }

    /// Bytes the index has allocated (nodes and both hash tables, at their capacities).
    pub fn memory_bytes(&self) -> usize {
        // hashbrown keeps a power-of-two number of buckets, at most 7/8 full, and one control
        // byte per bucket besides the entry itself.
        let bucket = |entry: usize, capacity: usize| {
            let buckets = if capacity == 0 {
                0
            } else {
                (capacity * 8 / 7).next_power_of_two()
            };
            buckets * (entry + 1)
        };
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + bucket(
                std::mem::size_of::<(u64, Holders)>(),
                self.holders.capacity(),
            )
            + bucket(std::mem::size_of::<(u64, u32)>(), self.owned.capacity())
            + self.lanes.capacity() * std::mem::size_of::<Lane>()
            + self.scratch.capacity() * std::mem::size_of::<(u32, u32)>()
    }

    fn find(&self, slot: Slot, hash: u64) -> Option<u32> {
        let node = *self.owned.get(&owner_key(hash, slot))?;
        let n = &self.nodes[node as usize];
        (n.slot == slot && n.hash == hash).then_some(node)
    }

    /// Whether `slot` holds the block `hash`.
    pub fn holds(&self, slot: Slot, hash: u64) -> bool {
        self.find(slot, hash).is_some()
    }

    /// Touch sequence of the block `hash` on `slot`, if held (larger is more recent).
    pub fn seq_of(&self, slot: Slot, hash: u64) -> Option<u64> {
        self.find(slot, hash).map(|n| self.nodes[n as usize].seq)
    }

    /// Most recent touch sequence handed out so far on `slot` (sequences are per instance).
    pub fn current_seq(&self, slot: Slot) -> u64 {
        self.lanes.get(slot as usize).map_or(0, |l| l.seq)
    }

    /// Records that `slot` now holds the chain `hashes` (root first), as the most recent entries.
    /// Only the first `capacity` blocks are kept: deeper ones would evict their own parents.
    pub fn insert(&mut self, slot: Slot, hashes: &[u64]) {
        let capacity = self.lane_mut(slot).capacity as usize;
        let kept = &hashes[..hashes.len().min(capacity)];
        // Whether the block after the current one (visited just before it) was new to the table.
        let mut child_is_new = false;
        for &hash in kept.iter().rev() {
            let lane = &mut self.lanes[slot as usize];
            lane.seq += 1;
            let seq = lane.seq;
            let is_new = match self.find(slot, hash) {
                Some(node) => {
                    self.lru_unlink(node);
                    self.nodes[node as usize].seq = seq;
                    self.lru_push_front(node);
                    false
                }
                None => {
                    if self.lanes[slot as usize].len >= self.lanes[slot as usize].capacity {
                        self.evict_tail(slot);
                    }
                    self.add_node(slot, hash, seq)
                }
            };
            if child_is_new {
                if let Some(holders) = self.holders.get_mut(&hash) {
                    holders.add_branch();
                }
            }
            child_is_new = is_new;
        }
    }

    /// How many chains have continued past block `hash` with a block new to the index (while
    /// some instance held it), counted up to 3: 0 or 1 for the end of one conversation's
    /// history, more for a prefix that different prompts share.
    pub fn branches(&self, hash: u64) -> u32 {
        self.holders.get(&hash).map_or(0, Holders::branches)
    }

    /// Adds the entry; returns whether the block is new to the table (no instance held it).
    fn add_node(&mut self, slot: Slot, hash: u64, seq: u64) -> bool {
        let key = owner_key(hash, slot);
        if self.owned.contains_key(&key) {
            // A 64-bit key collision with another (block, instance) pair: skip this entry,
            // which only makes the index a little more pessimistic.
            return false;
        }
        let node = Node {
            hash,
            seq,
            lru_prev: NIL,
            lru_next: NIL,
            holder_prev: NIL,
            holder_next: NIL,
            slot,
        };
        let id = match self.free_head {
            Some(id) => {
                let next = self.nodes[id as usize].lru_next;
                self.free_head = (next != NIL).then_some(next);
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.owned.insert(key, id);
        let holders = self.holders.entry(hash).or_insert(Holders::EMPTY);
        let old_head = holders.head;
        holders.head = id;
        holders.set_count(holders.count() + 1);
        self.nodes[id as usize].holder_next = old_head;
        if old_head != NIL {
            self.nodes[old_head as usize].holder_prev = id;
        }
        self.lru_push_front(id);
        old_head == NIL
    }

    fn lru_push_front(&mut self, node: u32) {
        let slot = self.nodes[node as usize].slot;
        let lane = &mut self.lanes[slot as usize];
        let old_head = lane.head;
        lane.head = node;
        if lane.tail == NIL {
            lane.tail = node;
        }
        lane.len += 1;
        self.nodes[node as usize].lru_prev = NIL;
        self.nodes[node as usize].lru_next = old_head;
        if old_head != NIL {
            self.nodes[old_head as usize].lru_prev = node;
        }
    }

    fn lru_unlink(&mut self, node: u32) {
        let Node {
            lru_prev,
            lru_next,
            slot,
            ..
        } = self.nodes[node as usize];
        if lru_prev != NIL {
            self.nodes[lru_prev as usize].lru_next = lru_next;
        }
        if lru_next != NIL {
            self.nodes[lru_next as usize].lru_prev = lru_prev;
        }
        let lane = &mut self.lanes[slot as usize];
        if lane.head == node {
            lane.head = lru_next;
        }
        if lane.tail == node {
            lane.tail = lru_prev;
        }
        lane.len -= 1;
    }

    fn remove_node(&mut self, node: u32) {
        self.lru_unlink(node);
        let Node {
            hash,
            slot,
            holder_prev,
            holder_next,
            ..
        } = self.nodes[node as usize];
        if holder_prev != NIL {
            self.nodes[holder_prev as usize].holder_next = holder_next;
        }
        if holder_next != NIL {
            self.nodes[holder_next as usize].holder_prev = holder_prev;
        }
        if let Some(holders) = self.holders.get_mut(&hash) {
            holders.set_count(holders.count() - 1);
            if holders.head == node {
                holders.head = holder_next;
            }
            if holders.count() == 0 {
                self.holders.remove(&hash);
            }
        }
        self.owned.remove(&owner_key(hash, slot));
        self.nodes[node as usize].lru_next = self.free_head.unwrap_or(NIL);
        self.free_head = Some(node);
    }

    fn evict_tail(&mut self, slot: Slot) {
        let tail = self.lanes[slot as usize].tail;
        if tail != NIL {
            self.remove_node(tail);
        }
    }

    /// Forgets every entry of `slot` touched at or before `seq`; returns how many.
    ///
    /// Used when an engine proves it no longer holds a block we believed it held: an LRU
    /// cache that evicted that block also evicted everything older.
    pub fn forget_not_newer_than(&mut self, slot: Slot, seq: u64) -> usize {
        let mut forgotten = 0;
        while let Some(lane) = self.lanes.get(slot as usize) {
            let tail = lane.tail;
            if tail == NIL || self.nodes[tail as usize].seq > seq {
                break;
            }
            self.remove_node(tail);
            forgotten += 1;
        }
        forgotten
    }

    /// Forgets everything `slot` holds (instance removed, or its cache was reset).
    pub fn clear_slot(&mut self, slot: Slot) {
        self.forget_not_newer_than(slot, u64::MAX);
    }

    /// Per instance holding at least the first block, how many leading blocks of `hashes` it
    /// holds. Results go to `out` (cleared first), in no particular order.
    pub fn lookup(&mut self, hashes: &[u64], out: &mut Vec<BlockMatch>) {
        out.clear();
        let count_at = |k: usize| -> u32 {
            hashes
                .get(k)
                .and_then(|h| self.holders.get(h))
                .map_or(0, Holders::count)
        };
        let first = count_at(0);
        if first == 0 {
            return;
        }
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.scratch.iter_mut().for_each(|s| *s = (0, 0));
            self.epoch = 1;
        }
        let epoch = self.epoch;
        let mut level = 0usize;
        let mut level_count = first;
        while level_count > 0 {
            // Holder sets only shrink along the chain, so equal counts mean equal sets: skip to
            // the last block held by exactly as many instances as `level`.
            let last = last_index_with_count(level, hashes.len(), level_count, &count_at);
            let next_count = count_at(last + 1);
            let next_hash = hashes.get(last + 1).copied();
            let mut node = self.holders[&hashes[last]].head;
            while node != NIL {
                let n = self.nodes[node as usize];
                node = n.holder_next;
                let scratch = &mut self.scratch[n.slot as usize];
                if scratch.0 == epoch {
                    continue;
                }
                let goes_deeper = next_hash.is_some_and(|h| {
                    self.owned
                        .get(&owner_key(h, n.slot))
                        .is_some_and(|&m| self.nodes[m as usize].slot == n.slot)
                });
                if !goes_deeper {
                    *scratch = (epoch, last as u32 + 1);
                    out.push(BlockMatch {
                        slot: n.slot,
                        blocks: last as u32 + 1,
                    });
                }
            }
            level = last + 1;
            level_count = next_count;
        }
    }

    /// Consecutive-run lookup that does not rely on prefix closure (exact mode, where the
    /// engine may evict a parent before its child). Cost grows with the holders walked.
    pub fn lookup_consecutive(&mut self, hashes: &[u64], out: &mut Vec<BlockMatch>) {
        out.clear();
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.scratch.iter_mut().for_each(|s| *s = (0, 0));
            self.epoch = 1;
        }
        let epoch = self.epoch;
        let mut candidates: Vec<Slot> = Vec::new();
        for (k, hash) in hashes.iter().enumerate() {
            let Some(holders) = self.holders.get(hash) else {
                break;
            };
            let mut node = holders.head;
            let mut alive = 0;
            while node != NIL {
                let n = self.nodes[node as usize];
                node = n.holder_next;
                let scratch = &mut self.scratch[n.slot as usize];
                if k == 0 {
                    *scratch = (epoch, 1);
                    candidates.push(n.slot);
                    alive += 1;
                } else if scratch.0 == epoch && scratch.1 == k as u32 {
                    scratch.1 += 1;
                    alive += 1;
                }
            }
            if alive == 0 {
                break;
            }
        }
        out.extend(candidates.into_iter().map(|slot| BlockMatch {
            slot,
            blocks: self.scratch[slot as usize].1,
        }));
    }

    /// Forgets one block of `slot` (exact mode: the engine said it removed it).
    pub fn remove(&mut self, slot: Slot, hash: u64) -> bool {
        match self.find(slot, hash) {
            Some(node) => {
                self.remove_node(node);
                true
            }
            None => false,
        }
    }
}

/// Largest `j` in `[from, len)` with `count_at(j) == count`, given that counts never grow with `j`
/// and `count_at(from) == count`. Gallops then bisects: O(log distance) table probes.
fn last_index_with_count(
    from: usize,
    len: usize,
    count: u32,
    count_at: &impl Fn(usize) -> u32,
) -> usize {
    let mut good = from;
    let mut step = 1usize;
    let mut bad = len;
    while good + step < len {
        if count_at(good + step) == count {
            good += step;
            step *= 2;
        } else {
            bad = good + step;
            break;
        }
    }
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if count_at(mid) == count {
            good = mid;
        } else {
            bad = mid;
        }
    }
    good
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashMap};

    fn matches(index: &mut PrefixIndex, hashes: &[u64]) -> BTreeMap<Slot, u32> {
        let mut out = Vec::new();
        index.lookup(hashes, &mut out);
        let map: BTreeMap<_, _> = out.iter().map(|m| (m.slot, m.blocks)).collect();
        assert_eq!(map.len(), out.len(), "a slot reported twice");
        map
    }

    /// The obvious model: per slot, an LRU list of hashes; lookup counts the leading run held.
    #[derive(Default)]
    struct Naive {
        lanes: HashMap<Slot, (u32, Vec<u64>)>, // capacity, most recent first
    }

    impl Naive {
        fn insert(&mut self, slot: Slot, capacity: u32, hashes: &[u64]) {
            let lane = self.lanes.entry(slot).or_insert((capacity, Vec::new()));
            for &h in hashes[..hashes.len().min(capacity as usize)].iter().rev() {
                lane.1.retain(|&x| x != h);
                lane.1.insert(0, h);
                lane.1.truncate(capacity as usize);
            }
        }

        fn lookup(&self, hashes: &[u64]) -> BTreeMap<Slot, u32> {
            let mut out = BTreeMap::new();
            for (&slot, (_, held)) in &self.lanes {
                let run = hashes.iter().take_while(|h| held.contains(h)).count() as u32;
                if run > 0 {
                    out.insert(slot, run);
                }
            }
            out
        }
    }

    /// Chains drawn from a small tree of prefixes so that they share and diverge.
    fn chain(branch: &[u8]) -> Vec<u64> {
        let mut hashes = Vec::new();
        let mut parent = 0u64;
        for &b in branch {
            parent = xxhash_rust::xxh3::xxh3_64_with_seed(&[b], parent);
            hashes.push(parent);
        }
        hashes
    }

    #[test]
    fn lookup_reports_depth_per_instance() {
        let mut index = PrefixIndex::new();
        for slot in 0..3 {
            index.set_capacity(slot, 100);
        }
        let a = chain(&[1, 2, 3, 4]);
        let b = chain(&[1, 2, 9]);
        index.insert(0, &a);
        index.insert(1, &b);
        assert_eq!(matches(&mut index, &a), BTreeMap::from([(0, 4), (1, 2)]));
        assert_eq!(matches(&mut index, &chain(&[7])), BTreeMap::new());
    }

    #[test]
    fn branches_tell_a_shared_prefix_from_one_conversations_history() {
        let mut index = PrefixIndex::new();
        for slot in 0..2 {
            index.set_capacity(slot, 100);
        }
        // One conversation: each turn extends the last one's prompt.
        let turn1 = chain(&[1, 2]);
        let turn2 = chain(&[1, 2, 3, 4]);
        index.insert(0, &turn1);
        index.insert(0, &turn2);
        assert_eq!(index.branches(turn2[1]), 1);
        assert_eq!(index.branches(turn2[3]), 0);
        // The same history stored again elsewhere is no new branch.
        index.insert(1, &turn2);
        assert_eq!(index.branches(turn2[1]), 1);
        // Another prompt continuing the same prefix differently makes it shared.
        index.insert(1, &chain(&[1, 2, 7]));
        assert_eq!(index.branches(turn2[1]), 2);
        assert_eq!(index.branches(turn2[0]), 1);
        assert_eq!(index.branches(chain(&[9])[0]), 0);
        // Counted up to three, beside the holder count in the same word, which stays exact.
        for tail in 10..20 {
            index.insert(0, &chain(&[1, 2, tail]));
        }
        assert_eq!(index.branches(turn2[1]), 3);
        assert_eq!(
            matches(&mut index, &turn2),
            BTreeMap::from([(0, 4), (1, 4)])
        );
    }

    #[test]
    fn capacity_evicts_least_recent_leaves_first() {
        let mut index = PrefixIndex::new();
        index.set_capacity(0, 4);
        let a = chain(&[1, 2, 3]);
        let b = chain(&[1, 5, 6]);
        index.insert(0, &a);
        index.insert(0, &b); // shares block 0; evicts a's deepest blocks first
        assert_eq!(index.len(0), 4);
        assert_eq!(matches(&mut index, &b), BTreeMap::from([(0, 3)]));
        assert_eq!(matches(&mut index, &a), BTreeMap::from([(0, 2)]));
    }

    #[test]
    fn forgetting_old_entries_keeps_newer_ones() {
        let mut index = PrefixIndex::new();
        index.set_capacity(0, 10);
        let a = chain(&[1, 2]);
        let b = chain(&[3, 4]);
        index.insert(0, &a);
        let seq_a_root = index.seq_of(0, a[0]).unwrap();
        index.insert(0, &b);
        assert_eq!(index.forget_not_newer_than(0, seq_a_root), 2);
        assert!(matches(&mut index, &a).is_empty());
        assert_eq!(matches(&mut index, &b), BTreeMap::from([(0, 2)]));
    }

    #[test]
    fn clearing_a_slot_releases_its_nodes_for_reuse() {
        let mut index = PrefixIndex::new();
        index.set_capacity(0, 10);
        index.insert(0, &chain(&[1, 2, 3]));
        let nodes = index.nodes.len();
        index.clear_slot(0);
        assert!(index.is_empty());
        index.insert(0, &chain(&[4, 5, 6]));
        assert_eq!(index.nodes.len(), nodes, "freed nodes are reused");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(Slot, Vec<u8>),
        Shrink(Slot, u32),
        Forget(Slot, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        let branch = proptest::collection::vec(0u8..3, 1..12);
        prop_oneof![
            6 => (0u32..4, branch).prop_map(|(s, b)| Op::Insert(s, b)),
            1 => (0u32..4, 1u32..20).prop_map(|(s, c)| Op::Shrink(s, c)),
            1 => (0u32..4, any::<u8>()).prop_map(|(s, k)| Op::Forget(s, k)),
        ]
    }

    proptest! {
        #[test]
        fn lookup_equals_the_naive_reference(ops in proptest::collection::vec(op(), 1..60),
                                            probe in proptest::collection::vec(0u8..3, 1..12)) {
            let mut index = PrefixIndex::new();
            let mut naive = Naive::default();
            let mut capacity = [16u32; 4];
            for slot in 0..4 {
                index.set_capacity(slot, capacity[slot as usize]);
            }
            for op in ops {
                match op {
                    Op::Insert(slot, branch) => {
                        let hashes = chain(&branch);
                        index.insert(slot, &hashes);
                        naive.insert(slot, capacity[slot as usize], &hashes);
                    }
                    Op::Shrink(slot, cap) => {
                        capacity[slot as usize] = cap;
                        index.set_capacity(slot, cap);
                        if let Some(lane) = naive.lanes.get_mut(&slot) {
                            lane.0 = cap;
                            lane.1.truncate(cap as usize);
                        }
                    }
                    Op::Forget(slot, k) => {
                        // Forget everything at or older than the k-th most recent entry.
                        if let Some(lane) = naive.lanes.get_mut(&slot) {
                            if !lane.1.is_empty() {
                                let k = k as usize % lane.1.len();
                                let seq = index.seq_of(slot, lane.1[k]).unwrap();
                                let forgotten = index.forget_not_newer_than(slot, seq);
                                prop_assert_eq!(forgotten, lane.1.len() - k);
                                lane.1.truncate(k);
                            }
                        }
                    }
                }
                for slot in 0..4u32 {
                    let held = naive.lanes.get(&slot).map_or(0, |l| l.1.len());
                    prop_assert_eq!(index.len(slot) as usize, held);
                    prop_assert!(index.len(slot) <= index.capacity(slot));
                }
                for branch in [&probe[..], &[0, 0, 0, 0][..], &[1, 2, 0, 1, 2][..]] {
                    let hashes = chain(branch);
                    let expected = naive.lookup(&hashes);
                    prop_assert_eq!(matches(&mut index, &hashes), expected.clone());
                    let mut out = Vec::new();
                    index.lookup_consecutive(&hashes, &mut out);
                    let consecutive: BTreeMap<_, _> = out.iter().map(|m| (m.slot, m.blocks)).collect();
                    prop_assert_eq!(consecutive, expected);
                }
            }
        }

        #[test]
        fn memory_stays_within_the_stated_bound(inserts in proptest::collection::vec(
            (0u32..8, proptest::collection::vec(any::<u8>(), 1..40)), 1..200)) {
            let mut index = PrefixIndex::new();
            for slot in 0..8 {
                index.set_capacity(slot, 50);
            }
            for (slot, branch) in inserts {
                index.insert(slot, &chain(&branch));
            }
            prop_assert!(index.total_entries() <= 8 * 50);
            // The stated bound: 160 bytes per entry the lanes can hold, plus the per-slot
            // overhead and the tables' minimum sizes.
            let bound = 8 * 50 * 160 + 8 * 64 + 1024;
            prop_assert!(index.memory_bytes() <= bound, "{} > {}", index.memory_bytes(), bound);
        }
    }
}
