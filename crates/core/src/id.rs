//! Instance identifiers, below everything that keys a table by instance (the fleet, the
//! prefix index, policies), so none of them depends on another for them.

use serde::{Deserialize, Serialize};

/// Dense index of an instance in the fleet (reused after it leaves; with a generation it makes
/// an [`InstanceId`]). Per-instance tables such as the prefix index are keyed by it.
pub type Slot = u32;

/// Stable handle of an instance; a removed instance's handle never matches a later one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InstanceId {
    /// Dense slot, reused after removal.
    pub slot: Slot,
    /// Bumped on each reuse of the slot.
    pub generation: u32,
}
