//! The prefix cache's hash → block index: an open-addressing table with
//! linear probing and backward-shift deletion.
//!
//! Why not `HashMap`: with a thousand engines in one simulation the index is
//! cold in the CPU cache and the TLB, and every full block costs an insert,
//! a removal and usually a lookup. A slot here is 8 bytes, a 32-bit tag of
//! the hash and the block id, so the table is a quarter of a hashbrown
//! `HashMap<u64, u32>` of the same capacity and a probe is one cache miss.
//! The full hash lives in the block itself; the caller supplies it to
//! confirm a tag match. The table is sized for twice the number of blocks
//! so it is never more than half full.

/// An empty slot. Slots store `block + 1` (block ids are below
/// `u32::MAX`), so that an all-zero table is empty: it comes from the
/// allocator as untouched zero pages, which matters with a thousand
/// engines, most of whose tables are never filled in a short run.
const EMPTY: u64 = 0;

/// Map from block hash to block id, holding at most `capacity` entries.
#[derive(Debug, Clone)]
pub(crate) struct BlockIndex {
    /// `tag << 32 | (block + 1)`, or `EMPTY`.
    slots: Vec<u64>,
    mask: usize,
    len: usize,
}

impl BlockIndex {
    /// An empty index for up to `capacity` entries.
    pub(crate) fn new(capacity: usize) -> Self {
        let size = (capacity.max(8) * 2).next_power_of_two();
        Self {
            slots: vec![EMPTY; size],
            mask: size - 1,
            len: 0,
        }
    }

    /// The part of a hash stored in a slot; it also picks the home slot,
    /// so entries can be moved without knowing their full hash.
    pub(crate) fn tag(hash: u64) -> u32 {
        (hash >> 32) as u32
    }

    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn home(&self, tag: u32) -> usize {
        // Hashes are xxh3 outputs: any 32 of their bits are well mixed.
        (tag as usize) & self.mask
    }

    fn pack(hash: u64, block: u32) -> u64 {
        (u64::from(Self::tag(hash)) << 32) | (u64::from(block) + 1)
    }

    fn slot_tag(slot: u64) -> u32 {
        (slot >> 32) as u32
    }

    fn slot_block(slot: u64) -> u32 {
        (slot as u32).wrapping_sub(1)
    }

    /// Start fetching the slot where a probe for `hash` begins.
    pub(crate) fn prefetch(&self, hash: u64) {
        crate::prefetch::prefetch(&self.slots[self.home(Self::tag(hash))]);
    }

    /// The block indexed under `hash`; `hash_of(block)` gives a block's full hash.
    pub(crate) fn get(&self, hash: u64, hash_of: impl Fn(u32) -> u64) -> Option<u32> {
        let tag = Self::tag(hash);
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            if Self::slot_tag(s) == tag && hash_of(Self::slot_block(s)) == hash {
                return Some(Self::slot_block(s));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Index `block` under `hash` unless another block has that hash; true if inserted.
    ///
    /// The caller never inserts more than the capacity (one entry per block).
    pub(crate) fn insert_if_absent(
        &mut self,
        hash: u64,
        block: u32,
        hash_of: impl Fn(u32) -> u64,
    ) -> bool {
        debug_assert!(self.len < self.slots.len() / 2 + 1);
        let tag = Self::tag(hash);
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                self.slots[i] = Self::pack(hash, block);
                self.len += 1;
                return true;
            }
            if Self::slot_tag(s) == tag && hash_of(Self::slot_block(s)) == hash {
                return false;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Remove the entry of `block` under `hash`; false if there is none.
    pub(crate) fn remove(&mut self, hash: u64, block: u32) -> bool {
        let target = Self::pack(hash, block);
        let mut i = self.home(Self::tag(hash));
        loop {
            let s = self.slots[i];
            if s == target {
                break;
            }
            if s == EMPTY {
                return false;
            }
            i = (i + 1) & self.mask;
        }
        // Backward shift: pull later entries of the probe run into the hole
        // unless their home lies cyclically in (hole, position].
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            let home = self.home(Self::slot_tag(s));
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(i) & self.mask) {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = EMPTY;
        self.len -= 1;
        true
    }

    /// Remove every entry.
    pub(crate) fn clear(&mut self) {
        self.slots.fill(EMPTY);
        self.len = 0;
    }

    /// All entries as (tag, block), in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.slots
            .iter()
            .filter(|&&s| s != EMPTY)
            .map(|&s| (Self::slot_tag(s), Self::slot_block(s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Full hashes of test blocks: block id b has hash `hashes[b]`.
    fn lookup_in(hashes: &[u64]) -> impl Fn(u32) -> u64 + '_ {
        move |b| hashes[b as usize]
    }

    #[test]
    fn collisions_and_wraparound() {
        let mut t = BlockIndex::new(4); // 16 slots
                                        // All share home slot 15 (tag low bits) so the run wraps to 0, 1, ...;
                                        // two of them even share the tag.
        let hashes: Vec<u64> = vec![
            (15u64 << 32) | 1,
            (31u64 << 32) | 2,
            (47u64 << 32) | 3,
            (47u64 << 32) | 4,
            (63u64 << 32) | 5,
        ];
        let h = lookup_in(&hashes);
        for (b, &k) in hashes.iter().enumerate() {
            assert!(t.insert_if_absent(k, b as u32, &h));
        }
        assert!(!t.insert_if_absent(hashes[2], 2, &h));
        assert!(t.remove(hashes[0], 0));
        assert!(!t.remove(hashes[0], 0));
        assert!(!t.remove(hashes[3], 4), "no such entry");
        for (b, &k) in hashes.iter().enumerate().skip(1) {
            assert_eq!(t.get(k, &h), Some(b as u32));
        }
        assert_eq!(t.get(hashes[0], &h), None);
        assert_eq!(t.len(), 4);
        t.clear();
        assert_eq!(t.get(hashes[1], &h), None);
        assert_eq!(t.iter().count(), 0);
    }

    proptest! {
        /// Behaves like a HashMap under random inserts and removals with many collisions.
        #[test]
        fn matches_hashmap(ops in prop::collection::vec((any::<bool>(), 0u32..150), 0..500)) {
            // Block b has hash with tag in a tiny range (long probe runs, shared tags).
            let hashes: Vec<u64> = (0..150u64).map(|b| ((b % 7) << 32) | (b + 1)).collect();
            let h = lookup_in(&hashes);
            let mut t = BlockIndex::new(150);
            let mut m: HashMap<u64, u32> = HashMap::new();
            for (insert, b) in ops {
                let key = hashes[b as usize];
                if insert {
                    let fresh = !m.contains_key(&key);
                    if fresh {
                        m.insert(key, b);
                    }
                    prop_assert_eq!(t.insert_if_absent(key, b, &h), fresh);
                } else {
                    prop_assert_eq!(t.remove(key, b), m.remove(&key).is_some());
                }
                prop_assert_eq!(t.len(), m.len());
            }
            for (&k, &v) in &m {
                prop_assert_eq!(t.get(k, &h), Some(v));
            }
            prop_assert_eq!(t.iter().count(), m.len());
        }
    }
}
