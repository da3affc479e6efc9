//! The last known set of one kind of object, folded from kube's watcher events. A relist
//! (after a restart, a `410 Gone` or an outage) is buffered and swapped in whole at its end, so
//! objects deleted while the watch was down disappear and a half-done relist never shrinks
//! the fleet.

use std::collections::BTreeMap;

use kube::runtime::watcher::Event;

/// Objects by name, as views of type `V`.
#[derive(Debug)]
pub struct Snapshot<V> {
    live: BTreeMap<String, V>,
    relisting: Option<BTreeMap<String, V>>,
    synced: bool,
}

impl<V> Default for Snapshot<V> {
    fn default() -> Self {
        Snapshot {
            live: BTreeMap::new(),
            relisting: None,
            synced: false,
        }
    }
}

impl<V: PartialEq> Snapshot<V> {
    /// Folds one event in, `view` giving an object's name and view; whether the live set
    /// changed.
    pub fn apply<K>(&mut self, event: Event<K>, view: impl Fn(&K) -> (String, V)) -> bool {
        match event {
            Event::Init => {
                self.relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(obj) => {
                let (name, v) = view(&obj);
                self.relisting.get_or_insert_default().insert(name, v);
                false
            }
            Event::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                let changed = !self.synced || listed != self.live;
                self.live = listed;
                self.synced = true;
                changed
            }
            Event::Apply(obj) => {
                let (name, v) = view(&obj);
                self.live.get(&name) != Some(&v) && {
                    self.live.insert(name, v);
                    true
                }
            }
            Event::Delete(obj) => self.live.remove(&view(&obj).0).is_some(),
        }
    }

    /// Whether a first full list has been seen (before it, the set means nothing).
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// The live views.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.live.values()
    }

    /// The only view, when there is exactly one.
    pub fn single(&self) -> Option<&V> {
        let mut it = self.live.values();
        match (it.next(), it.next()) {
            (Some(v), None) => Some(v),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(o: &(&'static str, u32)) -> (String, u32) {
        (o.0.to_string(), o.1)
    }

    #[test]
    fn a_relist_replaces_the_set_only_when_done() {
        let mut s = Snapshot::default();
        assert!(!s.synced());
        s.apply(Event::Init, view);
        s.apply(Event::InitApply(("a", 1)), view);
        s.apply(Event::InitApply(("b", 1)), view);
        assert!(s.values().next().is_none(), "nothing before the list ends");
        assert!(s.apply(Event::InitDone, view));
        assert!(s.synced());
        assert_eq!(s.values().count(), 2);

        // A relist after 410: `b` was deleted meanwhile, `a` changed.
        s.apply(Event::Init, view);
        s.apply(Event::InitApply(("a", 2)), view);
        assert_eq!(s.values().count(), 2, "the old set holds during the relist");
        assert!(s.apply(Event::InitDone, view));
        assert_eq!(s.values().copied().collect::<Vec<_>>(), [2]);

        // The same set again is no change.
        s.apply(Event::Init, view);
        s.apply(Event::InitApply(("a", 2)), view);
        assert!(!s.apply(Event::InitDone, view));
    }

    #[test]
    fn applies_and_deletes_report_changes() {
        let mut s = Snapshot::default();
        s.apply(Event::Init, view);
        s.apply(Event::InitDone, view);
        assert!(s.synced() && s.single().is_none());
        assert!(s.apply(Event::Apply(("a", 1)), view));
        assert!(!s.apply(Event::Apply(("a", 1)), view), "unchanged");
        assert_eq!(s.single(), Some(&1));
        assert!(s.apply(Event::Apply(("b", 1)), view));
        assert!(s.single().is_none());
        assert!(s.apply(Event::Delete(("b", 1)), view));
        assert!(!s.apply(Event::Delete(("b", 1)), view), "already gone");
    }
}
