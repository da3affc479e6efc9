//! LoRA adapters: which are known, which sit in one of `max_loras` GPU
//! slots, and which slot to give up (least recently used among those no
//! running request needs).

use std::collections::HashMap;

/// Why an adapter operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterError {
    /// No adapter of that name is registered.
    #[error("LoRA adapter '{0}' not found")]
    Unknown(String),
    /// Requests still use the adapter.
    #[error("LoRA adapter '{0}' is in use by queued or running requests")]
    Busy(String),
    /// Every slot holds an adapter that running requests need.
    #[error("no free LoRA slot to load '{0}': all resident adapters are in use")]
    NoFreeSlot(String),
    /// The engine has `max_loras = 0`.
    #[error("LoRA is disabled on this engine (max_loras = 0)")]
    Disabled,
}

/// One adapter's state.
#[derive(Debug, Clone)]
struct Adapter {
    name: String,
    registered: bool,
    resident: bool,
    /// Logical time of last use, for LRU eviction.
    last_used: u64,
    /// Running requests using it (it cannot be evicted while > 0).
    running: u32,
    /// Live requests (waiting or running) using it (it cannot be unloaded while > 0).
    live: u32,
}

/// Adapter registry and slot residency.
#[derive(Debug)]
pub(crate) struct Loras {
    adapters: Vec<Adapter>,
    by_name: HashMap<String, u32>,
    max_loras: u32,
    tick: u64,
}

impl Loras {
    /// An empty registry with `max_loras` slots.
    pub(crate) fn new(max_loras: u32) -> Self {
        Self {
            adapters: Vec::new(),
            by_name: HashMap::new(),
            max_loras,
            tick: 0,
        }
    }

    /// Number of slots.
    pub(crate) fn max_loras(&self) -> u32 {
        self.max_loras
    }

    /// Make `name` known (idempotent); returns its index.
    pub(crate) fn register(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.by_name.get(name) {
            self.adapters[i as usize].registered = true;
            return i;
        }
        let i = self.adapters.len() as u32;
        self.adapters.push(Adapter {
            name: name.to_string(),
            registered: true,
            resident: false,
            last_used: 0,
            running: 0,
            live: 0,
        });
        self.by_name.insert(name.to_string(), i);
        i
    }

    /// Index of a registered adapter.
    pub(crate) fn lookup(&self, name: &str) -> Option<u32> {
        self.by_name
            .get(name)
            .copied()
            .filter(|&i| self.adapters[i as usize].registered)
    }

    /// The adapter's name.
    pub(crate) fn name(&self, idx: u32) -> &str {
        &self.adapters[idx as usize].name
    }

    /// Whether it occupies a slot.
    pub(crate) fn is_resident(&self, idx: u32) -> bool {
        self.adapters[idx as usize].resident
    }

    fn resident_count(&self) -> u32 {
        self.adapters.iter().filter(|a| a.resident).count() as u32
    }

    /// Least recently used resident adapter no running request needs.
    fn eviction_victim(&self) -> Option<usize> {
        self.adapters
            .iter()
            .enumerate()
            .filter(|(_, a)| a.resident && a.running == 0)
            .min_by_key(|(_, a)| a.last_used)
            .map(|(i, _)| i)
    }

    /// Whether `idx` is resident or could be made resident now.
    pub(crate) fn can_be_resident(&self, idx: u32) -> bool {
        self.is_resident(idx)
            || (self.max_loras > 0
                && (self.resident_count() < self.max_loras || self.eviction_victim().is_some()))
    }

    /// Make `idx` resident, evicting the LRU idle adapter if the slots are
    /// full. `Some(true)` if a load happened, `Some(false)` if it was
    /// resident already, `None` if impossible.
    pub(crate) fn make_resident(&mut self, idx: u32) -> Option<bool> {
        if self.is_resident(idx) {
            return Some(false);
        }
        if self.max_loras == 0 {
            return None;
        }
        if self.resident_count() >= self.max_loras {
            let v = self.eviction_victim()?;
            self.adapters[v].resident = false;
        }
        self.tick += 1;
        let a = &mut self.adapters[idx as usize];
        a.resident = true;
        a.last_used = self.tick;
        Some(true)
    }

    /// A request for `idx` entered the engine.
    pub(crate) fn add_live(&mut self, idx: u32) {
        self.adapters[idx as usize].live += 1;
    }

    /// A request for `idx` left the engine.
    pub(crate) fn remove_live(&mut self, idx: u32) {
        let a = &mut self.adapters[idx as usize];
        a.live = a.live.saturating_sub(1);
    }

    /// A request for `idx` joined the running batch.
    pub(crate) fn start_running(&mut self, idx: u32) {
        self.tick += 1;
        let a = &mut self.adapters[idx as usize];
        a.running += 1;
        a.last_used = self.tick;
    }

    /// A request for `idx` left the running batch (finished, preempted or aborted).
    pub(crate) fn stop_running(&mut self, idx: u32) {
        self.tick += 1;
        let a = &mut self.adapters[idx as usize];
        a.running = a.running.saturating_sub(1);
        a.last_used = self.tick;
    }

    /// Explicitly load `name` (registering it); `Ok(true)` if a load happened.
    pub(crate) fn load(&mut self, name: &str) -> Result<bool, AdapterError> {
        if self.max_loras == 0 {
            return Err(AdapterError::Disabled);
        }
        let idx = self.register(name);
        self.make_resident(idx)
            .ok_or_else(|| AdapterError::NoFreeSlot(name.to_string()))
    }

    /// Unregister `name` and free its slot; refused while requests use it.
    pub(crate) fn unload(&mut self, name: &str) -> Result<(), AdapterError> {
        let idx = self
            .lookup(name)
            .ok_or_else(|| AdapterError::Unknown(name.to_string()))?;
        let a = &mut self.adapters[idx as usize];
        if a.live > 0 || a.running > 0 {
            return Err(AdapterError::Busy(name.to_string()));
        }
        a.registered = false;
        a.resident = false;
        Ok(())
    }

    /// Registered adapter names, sorted.
    pub(crate) fn known(&self) -> Vec<String> {
        self.sorted(|a| a.registered)
    }

    /// Resident adapter names, sorted.
    pub(crate) fn resident(&self) -> Vec<String> {
        self.sorted(|a| a.resident)
    }

    /// Names of adapters with running requests, sorted.
    pub(crate) fn running(&self) -> Vec<String> {
        self.sorted(|a| a.running > 0)
    }

    /// Names of adapters with live requests that are not running, sorted.
    pub(crate) fn waiting(&self) -> Vec<String> {
        self.sorted(|a| a.live > a.running)
    }

    fn sorted(&self, keep: impl Fn(&Adapter) -> bool) -> Vec<String> {
        let mut v: Vec<String> = self
            .adapters
            .iter()
            .filter(|a| keep(a))
            .map(|a| a.name.clone())
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_into_free_slots_then_evicts_lru_idle() {
        let mut l = Loras::new(2);
        let a = l.register("a");
        let b = l.register("b");
        let c = l.register("c");
        assert_eq!(l.make_resident(a), Some(true));
        assert_eq!(l.make_resident(b), Some(true));
        assert_eq!(l.make_resident(a), Some(false));
        // a is older than b, but a is busy: b must go.
        l.start_running(a);
        assert!(l.can_be_resident(c));
        assert_eq!(l.make_resident(c), Some(true));
        assert_eq!(l.resident(), vec!["a", "c"]);
        // Both busy: no room for b.
        l.start_running(c);
        assert!(!l.can_be_resident(b));
        assert_eq!(l.make_resident(b), None);
        l.stop_running(a);
        assert_eq!(l.make_resident(b), Some(true));
        assert_eq!(l.resident(), vec!["b", "c"]);
    }

    #[test]
    fn unload_refused_while_live() {
        let mut l = Loras::new(1);
        let a = l.register("a");
        l.add_live(a);
        assert_eq!(l.unload("a"), Err(AdapterError::Busy("a".into())));
        l.remove_live(a);
        assert_eq!(l.unload("a"), Ok(()));
        assert_eq!(l.lookup("a"), None);
        assert_eq!(l.unload("a"), Err(AdapterError::Unknown("a".into())));
        assert!(l.known().is_empty());
    }

    #[test]
    fn disabled_when_no_slots() {
        let mut l = Loras::new(0);
        let a = l.register("a");
        assert!(!l.can_be_resident(a));
        assert_eq!(l.load("a"), Err(AdapterError::Disabled));
    }

    #[test]
    fn explicit_load_registers_and_reports_state() {
        let mut l = Loras::new(1);
        assert_eq!(l.load("x"), Ok(true));
        assert_eq!(l.load("x"), Ok(false));
        assert_eq!(l.known(), vec!["x"]);
        let x = l.lookup("x").unwrap();
        l.add_live(x);
        assert_eq!(l.waiting(), vec!["x"]);
        l.start_running(x);
        assert_eq!(l.running(), vec!["x"]);
        assert!(l.waiting().is_empty());
        assert_eq!(l.load("y"), Err(AdapterError::NoFreeSlot("y".into())));
    }
}
