//! A bounded, approximately-LRU map used to share `Arc` values.
//!
//! Sharing only matters while requests holding a value are alive, but an
//! unbounded cache of every block or segment ever seen would itself cost what
//! sharing saves (the Mooncake trace alone has 182,790 distinct 2 KiB blocks).
//! Two generations approximate LRU at O(1): hits in the old generation are
//! promoted, and when the young one fills, the old one is dropped. Values are
//! deterministic, so a value evicted and made again is byte-identical; it just
//! lives in a new allocation.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

/// A two-generation cache holding at most `capacity` entries.
#[derive(Debug)]
pub struct GenCache<K, V> {
    young: HashMap<K, V>,
    old: HashMap<K, V>,
    half: usize,
}

impl<K: Hash + Eq, V: Clone> GenCache<K, V> {
    /// An empty cache keeping at most `capacity` entries (at least 2).
    pub fn new(capacity: usize) -> Self {
        Self {
            young: HashMap::new(),
            old: HashMap::new(),
            half: (capacity / 2).max(1),
        }
    }

    /// Entries currently held.
    pub fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value for `key`, made by `make` (with its owned key) on a miss.
    pub fn get_or_insert_with<Q>(&mut self, key: &Q, make: impl FnOnce() -> (K, V)) -> V
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some(v) = self.young.get(key) {
            return v.clone();
        }
        let (k, v) = match self.old.remove_entry(key) {
            Some(kv) => kv,
            None => make(),
        };
        if self.young.len() >= self.half {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(k, v.clone());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn shares_and_bounds() {
        let mut c: GenCache<u64, Arc<str>> = GenCache::new(4);
        let a = c.get_or_insert_with(&1, || (1, Arc::from("one")));
        let b = c.get_or_insert_with(&1, || (1, Arc::from("other")));
        assert!(Arc::ptr_eq(&a, &b));
        for k in 2..100 {
            c.get_or_insert_with(&k, || (k, Arc::from(k.to_string())));
            assert!(c.len() <= 4);
        }
        // Evicted long ago: made again.
        let again = c.get_or_insert_with(&1, || (1, Arc::from("one")));
        assert!(!Arc::ptr_eq(&a, &again));
    }

    #[test]
    fn hot_key_survives_generations() {
        let mut c: GenCache<u64, Arc<str>> = GenCache::new(4);
        let hot = c.get_or_insert_with(&0, || (0, Arc::from("hot")));
        for k in 1..1000 {
            c.get_or_insert_with(&k, || (k, Arc::from("x")));
            let h = c.get_or_insert_with(&0, || (0, Arc::from("hot")));
            assert!(Arc::ptr_eq(&hot, &h), "hot key evicted at {k}");
        }
    }

    #[test]
    fn borrowed_lookup() {
        let mut c: GenCache<Arc<str>, ()> = GenCache::new(8);
        let mut made = 0;
        for _ in 0..3 {
            c.get_or_insert_with("abc", || {
                made += 1;
                (Arc::from("abc"), ())
            });
        }
        assert_eq!(made, 1);
    }
}
